"""WeMask (weight-guided masking, ``paper.md`` §2.5) and the dim selections it is compared with.

For every layer ``l`` from a start layer to the last, zero ``k`` of the ``d`` dims of the *massive
token's* attention input ``RMSNorm_attn(h_l) = h_l / rms(h_l) ⊙ w_attn^{(l)}`` — only for the massive
token (absolute position 0 by default, or the detected massive positions), never the residual stream,
never the other tokens::

    ĥ_{l,t}[S_l] ← 0   for t ∈ massive positions, l ≥ start

The dim set ``S_l`` has four selections compared by the mask-rate study (:data:`VARIANTS`), named
apart, and one more:

* ``weight``     — ``TopK(|w_attn^{(l)}|, k)``: the paper's text (the same dims for every token/input);
* ``activation`` — the authors' released code: ``TopK(mean_b |ĥ_{l,b}|, int(r·d))``, the top dims of
  the *batch mean* of the massive tokens' *normalised* activations (after the gain), one set for the
  whole batch of the forward (every target token of the call; with the default ``positions=(0,)``
  that is ``|ĥ_0|`` averaged over the prompts), so it depends on which prompts share the batch;
* ``random``     — ``k`` dims drawn without replacement, seeded by ``(seed, layer)``: an ablation;
* ``magnitude``  — ``TopK(|h_{l,t}|, k)`` of the massive token's *residual* activation (the norm's
  input), per token: an ablation;
* ``activation_per_prompt`` — ``TopK(|ĥ_{l,t}|, k)`` per massive token (per prompt), not in the
  study's set: what ``activation`` was before it followed the released code.

**Dim count.** ``k = floor(r·d + 0.5)`` (``r·d`` rounded half up; :func:`core.n_selected`) for every
variant but ``activation``, which uses the released code's ``int(r·d)`` (:data:`COUNT_RULE`). On the
bundled model (``d = 576``) ``r = 0.1`` masks 58 dims, 57 with ``activation``.

Ties are broken towards the lower dim index (stable sort). The start layer is explicit: ``start="ge"``
masks layers ``≥ ME`` (the paper), ``"gt"`` layers ``> ME``. The ME layer is measured
(:func:`me_interp.probes.find_me_layer`) unless given; on a model without a massive activation that
raises :class:`me_interp.claims.NotApplicable` (there is nothing to mask), unless layers are given.

:func:`select_dims` is the one pure selection function; the TransformerLens hooks (:func:`we_mask`) and
the HF hooks (:mod:`me_interp.interventions.hf_hooks`) both call it through :class:`WeMask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float, Int

from me_interp.interventions import core
from me_interp.interventions.core import PositionsArg

#: The selections the mask-rate study compares (``experiments.wemask``).
VARIANTS: tuple[str, ...] = ("weight", "activation", "random", "magnitude")
#: Every selection :func:`select_dims` and :class:`WeMask` accept.
ALL_VARIANTS: tuple[str, ...] = (*VARIANTS, "activation_per_prompt")
STARTS: tuple[str, ...] = ("ge", "gt")
Variant = Literal["weight", "activation", "random", "magnitude", "activation_per_prompt"]
#: Count rule per variant (``core.COUNT_RULES``): the released code's ``int(r·d)`` for its own
#: selection, ``floor(r·d + 0.5)`` for the others.
COUNT_RULE: dict[str, str] = {v: "int" if v == "activation" else "half_up" for v in ALL_VARIANTS}
RANDOM_SEED_STRIDE = 1_000_003
# variants whose dims do not depend on the input ("given": explicit dims, used by soft.dim_projection)
FIXED_VARIANTS: tuple[str, ...] = ("weight", "random", "given")


def check_variant(variant: str) -> str:
    if variant not in ALL_VARIANTS:
        raise ValueError(f"unknown WeMask variant {variant!r}; choose one of {ALL_VARIANTS}")
    return variant


def n_dims(variant: str, rate: float | int, d: int) -> int:
    """How many dims ``variant`` masks at ``rate`` (see "Dim count" in the module docstring)."""
    return core.n_selected(rate, d, COUNT_RULE[check_variant(variant)])


def select_dims(
    model: Any,
    layer: int,
    variant: str,
    rate: float | int,
    activations: Float[torch.Tensor, "*rows d_model"] | None = None,
    seed: int = 0,
) -> Int[torch.Tensor, "*sets k"]:
    """The dims WeMask zeroes at ``layer``: ``k = n_dims(variant, rate, d_model)`` indices.

    Args:
        model: a :class:`~me_interp.models.LoadedModel` or an HF causal LM.
        layer: 0-based layer.
        variant: ``weight`` (``TopK |w_attn|``), ``activation`` (``TopK`` of the mean ``|ĥ|`` over
            all given normalised activation rows, ``int(r·d)`` dims: the released code),
            ``activation_per_prompt`` (``TopK |ĥ|`` per row), ``random`` (seeded by
            ``(seed, layer)``) or ``magnitude`` (``TopK |h|`` of the given residual activations,
            per row).
        rate: ``r ∈ [0, 1]``.
        activations: ``[..., d_model]``; required by ``activation``/``activation_per_prompt`` (the
            attention-norm *output* of the massive tokens) and ``magnitude`` (the norm's *input*, the
            residual stream).
        seed: for ``random``.

    Returns:
        ``[k]`` for ``weight``/``random``/``activation`` (sorted; one set for every token), ``[..., k]``
        (one row per activation row) for ``activation_per_prompt``/``magnitude``.

    Raises:
        ValueError: bad variant, rate outside [0, 1], missing or mis-shaped activations.
    """
    check_variant(variant)
    n_layers, d = core.n_layers_of(model), core.d_model_of(model)
    core.check_layers([layer], n_layers)
    k = n_dims(variant, rate, d)
    if variant == "weight":
        gain = core.attn_norm_gain(model, layer)
        return core.top_abs_dims(gain, k).sort().values.cpu()
    if variant == "random":
        gen = torch.Generator().manual_seed(int(seed) * RANDOM_SEED_STRIDE + layer)
        return torch.randperm(d, generator=gen)[:k].sort().values
    if activations is None:
        raise ValueError(
            f"variant {variant!r} selects dims from the massive token's activations: pass activations"
        )
    if activations.shape[-1] != d:
        raise ValueError(f"activations have {activations.shape[-1]} dims, the model has {d}")
    return _dims_of(variant, activations, k)


def _dims_of(variant: str, x: torch.Tensor, k: int) -> torch.Tensor:
    """The input-dependent selections: one set from the batch mean of ``|x|`` (``activation``) or
    one row of dims per row of ``x``."""
    if variant == "activation":
        mean_abs = x.detach().float().abs().reshape(-1, x.shape[-1]).mean(0)  # [d]
        return core.top_abs_dims(mean_abs, k).sort().values
    return core.top_abs_dims(x, k)


MASK_ANYWAY = "pass layers= or me_layer= to mask anyway"
"""What to do on a model without a massive activation (the hint of its "not applicable")."""


def me_layer_index(model: Any, batch: Any = None) -> int:
    """The measured ME layer (0-based) on ``batch`` (default: the built-in prompts), as an int.

    The layer of the Site (:func:`me_interp.probes.site.locate`), for callers that only need where
    to start masking.

    Raises:
        NotApplicable: when no layer meets the massive-activation criterion
            (:class:`me_interp.claims.NotApplicable`; the experiments report it as "not applicable").
    """
    from me_interp.loading.loaded import LoadedModel
    from me_interp.probes.site import locate

    if not isinstance(model, LoadedModel):
        raise TypeError(
            "detecting the ME layer needs a LoadedModel; pass me_layer= for an HF model"
        )
    if batch is None:
        from me_interp.prompts import builtin_prompts

        batch = model.tokenize(builtin_prompts())
    return int(locate(model, batch).require(MASK_ANYWAY))


def start_layer(model: Any, me_layer: int | None, location: Any, n_prompts: int) -> int:
    """The layer the masks start from: ``me_layer`` when given (checked against the model), else
    the ME layer of ``location`` (a :class:`~me_interp.probes.MELocation` on ``n_prompts`` prompts).

    Raises:
        NotApplicable: no ``me_layer`` given and no ME layer in ``location``.
    """
    from me_interp import claims
    from me_interp.probes.site import no_massive_why

    if me_layer is not None:
        return model.check_layer(me_layer)
    if location.me_layer is None:
        raise claims.NotApplicable(no_massive_why(location, n_prompts, MASK_ANYWAY))
    return int(location.me_layer)


def positions_label(positions: Any) -> str:
    """The masked positions in words: ``"[0]"``, or ``"detected massive positions [0, 3]"`` for
    one list per prompt."""
    if positions and isinstance(positions[0], (list, tuple)):
        return "detected massive positions " + str(sorted({p for row in positions for p in row}))
    return str(list(positions))


def mask_layers(
    model: Any,
    start: str = "ge",
    me_layer: int | None = None,
    end: int | None = None,
    batch: Any = None,
) -> tuple[int, ...]:
    """Layers WeMask acts on: ``[ME, end]`` (``start="ge"``) or ``[ME + 1, end]`` (``"gt"``).

    Args:
        me_layer: the ME layer (0-based); measured with :func:`me_layer_index` when ``None``.
        end: last layer (inclusive, default the model's last layer).

    Raises:
        NotApplicable: ``me_layer=None`` and the model has no massive activation.
        ValueError: a bad ``start``, a layer out of range, no layer from the start to ``end``.
    """
    if start not in STARTS:
        raise ValueError(f"start must be 'ge' (layers >= ME) or 'gt' (layers > ME), got {start!r}")
    n = core.n_layers_of(model)
    me = me_layer_index(model, batch) if me_layer is None else me_layer
    core.check_layers([me], n)
    last = n - 1 if end is None else end
    core.check_layers([last], n)
    first = me if start == "ge" else me + 1
    if first > last:
        raise ValueError(f"no layers from {first} to {last}: the ME layer {me} is the last layer")
    return tuple(range(first, last + 1))


def massive_positions(model: Any, batch: Any) -> list[list[int]]:
    """Detected massive positions per prompt at the ME layer (the Site's,
    :func:`me_interp.probes.site.locate`).

    Raises:
        NotApplicable: no massive activation in ``batch`` (no positions to mask).
    """
    from me_interp.probes.site import locate

    site = locate(model, batch)
    site.require(MASK_ANYWAY)
    return [list(p) for p in site.positions]


def index_positions(positions: PositionsArg, batch: Any) -> tuple[tuple[int, ...], ...]:
    """``positions`` counted from each row's first real token (the Site's, the HF hooks'
    ``positions_from="mask"``), as the indices of ``batch``'s tensors, one list per row: the same
    under right padding, shifted by each row's :attr:`~me_interp.loading.loaded.Batch.starts` under
    left padding (a TransformerLens forward has no cache: its index is the position it edits)."""
    norm = core.normalize_positions(positions)
    per_row = norm if norm and isinstance(norm[0], tuple) else (norm,) * len(batch)
    if len(per_row) != len(batch):
        raise ValueError(
            f"positions has {len(per_row)} rows but the batch has {len(batch)} prompts"
        )
    return tuple(tuple(int(p) + s for p in row) for row, s in zip(per_row, batch.starts))


def locate_with_directions(model: Any, batch: Any) -> tuple[Any, dict[int, torch.Tensor]]:
    """The ME location on ``batch`` (:func:`me_interp.probes.find_me_layer`) and, from the same
    forward, per layer the massive direction that
    :class:`~me_interp.interventions.soft.DirectionProjection` removes: the mean over the prompts of
    the attention input (``attn_in``, the pre-attention norm's output) at position 0.

    A model of another backend (:func:`~me_interp.probes.batching.own_backend`) measures both in
    its own traces (``model.locate_with_directions``).
    """
    from me_interp import names
    from me_interp.probes import Activations
    from me_interp.probes import find_me_layer as _find
    from me_interp.probes.batching import Chunk, own_backend

    if own_backend(model):
        return model.locate_with_directions(batch)
    # the attention input of the token at position 0, in the ME-layer probe's forward
    first = Activations(model, batch, [names.attn_in(L) for L in range(model.n_layers)], at=0)
    loc = _find(model, batch, fwd_hooks=first.hooks(Chunk.whole(batch)))
    return loc, {L: first[names.attn_in(L)].float().cpu().mean(0) for L in range(model.n_layers)}


@dataclass(frozen=True)
class WeMask:
    """A WeMask spec (see module docstring); build it with :meth:`build` or :func:`we_mask`.

    ``fixed_dims`` holds the precomputed dims of the input-independent variants (``weight``,
    ``random``) per layer; ``activation`` (one set per forward, from the batch mean),
    ``activation_per_prompt`` and ``magnitude`` select from the input in :meth:`edit`.
    ``keep`` is the factor the selected coordinates are multiplied by (0 for the hard mask).
    """

    layers: tuple[int, ...]
    rate: float
    variant: str = "weight"
    positions: tuple = (0,)
    seed: int = 0
    fixed_dims: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    site: str = "attn_in"
    keep: float = 0.0
    d_model: int = 0

    @property
    def needs_resid(self) -> bool:
        return self.variant == "magnitude" and self.site == "attn_in"

    @classmethod
    def build(
        cls,
        model: Any,
        layers: Sequence[int],
        rate: float | int,
        variant: str = "weight",
        positions: PositionsArg = (0,),
        seed: int = 0,
        site: str = "attn_in",
        keep: float | int = 0.0,
    ) -> WeMask:
        """Validate the arguments and precompute the input-independent dims for ``model``."""
        check_variant(variant)
        core.check_fraction(rate, "rate")
        core.check_site(site)
        layers = core.check_layers(layers, core.n_layers_of(model))
        fixed = {}
        if variant in ("weight", "random"):
            fixed = {L: select_dims(model, L, variant, rate, seed=seed) for L in layers}
        return cls(
            layers=layers,
            rate=float(rate),
            variant=variant,
            positions=core.normalize_positions(positions),
            seed=int(seed),
            fixed_dims=fixed,
            site=site,
            keep=float(keep),
            d_model=core.d_model_of(model),
        )

    def dims_for(
        self, layer: int, h_sel: torch.Tensor, resid_sel: torch.Tensor | None
    ) -> torch.Tensor:
        """Dims to edit for the target tokens (``h_sel``/``resid_sel``: their rows ``[n, d]``)."""
        if self.variant in FIXED_VARIANTS:
            return self.fixed_dims[layer]
        k = n_dims(self.variant, self.rate, h_sel.shape[-1])
        if self.variant == "magnitude":
            return _dims_of(self.variant, resid_sel if resid_sel is not None else h_sel, k)
        return _dims_of(self.variant, h_sel, k)

    def edit(
        self,
        h: torch.Tensor,
        layer: int,
        target: torch.Tensor,
        resid: torch.Tensor | None,
    ) -> torch.Tensor:
        if layer not in self.layers:
            return h
        if self.needs_resid and resid is None:
            raise ValueError("the magnitude variant needs the residual input of the norm")
        if not bool(target.any()):
            return h.clone()
        dims = self.dims_for(layer, h[target], resid[target] if resid is not None else None)
        return core.scale_dims(h, target, dims, self.keep)

    def to_dict(self) -> dict:
        return {
            "kind": "wemask" if self.keep == 0.0 else "dim_projection",
            "layers": list(self.layers),
            "rate": self.rate,
            "variant": self.variant,
            "positions": self.positions,
            "seed": self.seed,
            "site": self.site,
            "alpha": 1.0 - self.keep,
        }


def we_mask(
    model: Any,
    rate: float | int,
    variant: str = "weight",
    *,
    layers: Sequence[int] | None = None,
    start: str = "ge",
    me_layer: int | None = None,
    positions: PositionsArg | str = (0,),
    seed: int = 0,
    batch: Any = None,
) -> list[tuple[str, Any]]:
    """TransformerLens hooks for WeMask: zero ``n_dims(variant, rate, d)`` dims of the massive token's
    attention input.

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        rate: ``r ∈ [0, 1]``.
        variant: ``weight`` | ``activation`` | ``random`` | ``magnitude`` |
            ``activation_per_prompt`` (module docstring).
        layers: explicit 0-based layers; default :func:`mask_layers` (``start`` from ``me_layer``).
        start: ``"ge"`` (layers ≥ ME, the paper) or ``"gt"`` (layers > ME).
        me_layer: the ME layer; measured on ``batch`` (default built-in prompts) when ``None``.
        positions: positions of the massive token(s), counted from each row's first real token: all
            prompts, or one list per prompt; ``"massive"``: the massive positions detected in
            ``batch`` (required then) at the ME layer. With a left-padded ``batch`` they follow its
            real tokens (:func:`index_positions`).
        seed: seed of the ``random`` variant.
        batch: prompts for detecting the ME layer (default: built-in prompts) and, with
            ``positions="massive"``, the massive positions — use the batch you will run.

    Returns:
        ``[(hook_name, fn), ...]`` for ``model.run_with_hooks`` / ``bridge.hooks(fwd_hooks=...)``.

    Raises:
        NotApplicable: neither ``layers`` nor ``me_layer`` given and the model has no massive
            activation (also for ``positions="massive"`` on a batch without one).
    """
    if isinstance(positions, str):
        if positions != "massive":
            raise ValueError(f"positions must be a list or 'massive', got {positions!r}")
        if batch is None:
            raise ValueError("positions='massive' detects them in the batch you run: pass batch=")
        positions = massive_positions(model, batch)
    if batch is not None and batch.left_padded:  # follow each row's first real token
        positions = index_positions(positions, batch)
    if layers is None:
        layers = mask_layers(model, start=start, me_layer=me_layer, batch=batch)
    spec = WeMask.build(model, layers, rate, variant, positions, seed)
    return core.tl_hooks(spec)


__all__ = [
    "ALL_VARIANTS",
    "COUNT_RULE",
    "STARTS",
    "VARIANTS",
    "WeMask",
    "locate_with_directions",
    "mask_layers",
    "massive_positions",
    "me_layer_index",
    "n_dims",
    "positions_label",
    "MASK_ANYWAY",
    "select_dims",
    "start_layer",
    "index_positions",
    "we_mask",
]
