"""Soft alternatives to the hard WeMask (``paper.md`` §3), for the massive token only.

* **Dim projection** — ``h − α P_S h`` with ``P_S`` the projection on a coordinate dim set ``S``
  (explicit dims, or any WeMask selection at a rate): the coordinates in ``S`` are scaled by ``1 − α``.
  ``α = 1`` on the attention input is exactly WeMask; ``α = 0`` is the identity.
* **Direction projection** — ``h − α (⟨h, v⟩ / ‖v‖²) v`` for a massive direction ``v`` per layer
  (given, or estimated as the mean of the massive tokens' vectors at that site by
  :func:`estimate_direction`). ``α = 1`` removes the component along ``v`` entirely.

:class:`MaskCondition` names one of these masks of the massive token's attention input, or a WeMask
selection, and builds it (the conditions of the mask-rate study, ``experiments.wemask``).

Both act at the attention input (``site="attn_in"``: ``RMSNorm_attn`` output, residual untouched) or in
the residual stream (``site="resid_post"``: the layer output, carried downstream). ``α ∈ [0, 1]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float

from me_interp import names
from me_interp.interventions import core
from me_interp.interventions.core import PositionsArg
from me_interp.interventions.wemask import WeMask
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record


def dim_projection(
    model: Any,
    alpha: float | int,
    layers: Sequence[int],
    *,
    dims: Sequence[int] | None = None,
    variant: str = "weight",
    rate: float = 0.1,
    site: str = "attn_in",
    positions: PositionsArg = (0,),
    seed: int = 0,
) -> WeMask:
    """Spec of ``h − α P_S h`` on the target tokens (``S``: ``dims``, else the WeMask ``variant`` at ``rate``).

    Raises:
        ValueError: ``alpha`` or ``rate`` outside [0, 1], dims out of range, bad site/layers.
    """
    alpha = core.check_fraction(alpha, "alpha")
    keep = 1.0 - alpha
    if dims is None:
        return WeMask.build(model, layers, rate, variant, positions, seed, site=site, keep=keep)
    d = core.d_model_of(model)
    dims_t = torch.as_tensor(list(dims), dtype=torch.long)
    if dims_t.numel() and (dims_t.min() < 0 or dims_t.max() >= d):
        raise ValueError(f"dims must lie in 0..{d - 1}, got {list(dims)}")
    dims_t = dims_t.unique()
    layers = core.check_layers(layers, core.n_layers_of(model))
    return WeMask(
        layers=layers,
        rate=dims_t.numel() / d,
        variant="given",
        positions=core.normalize_positions(positions),
        seed=seed,
        fixed_dims={L: dims_t for L in layers},
        site=core.check_site(site),
        keep=keep,
        d_model=d,
    )


@dataclass(frozen=True)
class DirectionProjection:
    """Spec of ``h − α (⟨h, v_l⟩ / ‖v_l‖²) v_l`` on the target tokens at ``site`` of each layer ``l``."""

    layers: tuple[int, ...]
    alpha: float
    directions: dict[int, torch.Tensor] = field(compare=False, repr=False)
    site: str = "attn_in"
    positions: tuple = (0,)
    needs_resid: bool = False

    @classmethod
    def build(
        cls,
        model: Any,
        alpha: float | int,
        directions: Mapping[int, torch.Tensor] | torch.Tensor,
        layers: Sequence[int] | None = None,
        site: str = "attn_in",
        positions: PositionsArg = (0,),
    ) -> DirectionProjection:
        """``directions``: one vector for every layer in ``layers``, or a ``{layer: v}`` mapping."""
        alpha = core.check_fraction(alpha, "alpha")
        core.check_site(site)
        d = core.d_model_of(model)
        if isinstance(directions, torch.Tensor):
            if layers is None:
                raise ValueError("give layers= with a single direction vector")
            dirs = {L: directions for L in layers}
        else:
            dirs = dict(directions)
            layers = tuple(dirs) if layers is None else layers
        layers = core.check_layers(layers, core.n_layers_of(model))
        out = {}
        for L in layers:
            if L not in dirs:
                raise ValueError(f"no direction given for layer {L}")
            v = torch.as_tensor(dirs[L]).detach().float().flatten()
            if v.shape[0] != d:
                raise ValueError(
                    f"direction for layer {L} has {v.shape[0]} dims, the model has {d}"
                )
            if not torch.isfinite(v).all() or float(v.norm()) == 0.0:
                raise ValueError(f"direction for layer {L} is zero or not finite")
            out[L] = v
        return cls(layers, alpha, out, site, core.normalize_positions(positions))

    def edit(
        self, h: torch.Tensor, layer: int, target: torch.Tensor, resid: torch.Tensor | None
    ) -> torch.Tensor:
        if layer not in self.layers:
            return h
        return core.remove_direction(h, target, self.directions[layer], self.alpha)

    def to_dict(self) -> dict:
        return {
            "kind": "direction_projection",
            "layers": list(self.layers),
            "alpha": self.alpha,
            "site": self.site,
            "positions": self.positions,
        }


def estimate_direction(
    model: Any,
    batch: Any,
    layers: Sequence[int],
    site: str = "attn_in",
    positions: PositionsArg = (0,),
) -> dict[int, Float[torch.Tensor, " d_model"]]:
    """The massive direction per layer: ``v_l = mean`` of the target tokens' vectors at ``site``.

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        batch: prompts to estimate from (``model.tokenize``).
        positions: absolute positions of the massive tokens (all prompts, or one list per prompt).
    """
    core.check_site(site)
    layers = core.check_layers(layers, model.n_layers)
    pos = core.normalize_positions(positions)
    acts = Activations(model, batch, [names.site(site, L) for L in layers])
    record(model, batch, [acts], last_layer=acts.last_layer, max_tokens=None)
    B, T = batch.tokens.shape
    target = core.target_mask(torch.arange(T)[None, :], pos, B) & batch.attention_mask.bool().cpu()
    if not target.any():
        raise ValueError("no target token inside the prompts: check positions")
    return {L: acts[names.site(site, L)].float().cpu()[target].mean(0) for L in layers}


def project_dims(model: Any, alpha: float | int, layers: Sequence[int], **kwargs: Any) -> list:
    """TransformerLens hooks of :func:`dim_projection`."""
    return core.tl_hooks(dim_projection(model, alpha, layers, **kwargs))


def project_direction(
    model: Any,
    alpha: float | int,
    directions: Mapping[int, torch.Tensor] | torch.Tensor,
    layers: Sequence[int] | None = None,
    site: str = "attn_in",
    positions: PositionsArg = (0,),
) -> list:
    """TransformerLens hooks of :class:`DirectionProjection`."""
    return core.tl_hooks(
        DirectionProjection.build(model, alpha, directions, layers, site, positions)
    )


__all__ = [
    "DirectionProjection",
    "MaskCondition",
    "dim_projection",
    "estimate_direction",
    "mask_conditions",
    "project_dims",
    "project_direction",
    "same_forward",
]


@dataclass(frozen=True)
class MaskCondition:
    """One mask of the massive token's attention input: a WeMask selection ``variant`` at ``rate``
    (``seed`` for ``random``), the dim projection of a selection at strength ``alpha``, or the
    direction projection at ``alpha``."""

    kind: Literal["wemask", "dim_projection", "direction_projection"]
    variant: str
    rate: float
    alpha: float = 1.0
    seed: int = 0

    def label(self) -> str:
        if self.kind == "wemask":
            tail = f" seed {self.seed}" if self.variant == "random" else ""
            return f"wemask {self.variant} r={self.rate:g}{tail}"
        if self.kind == "dim_projection":
            return f"dim_projection r={self.rate:g} α={self.alpha:g}"
        return f"direction_projection α={self.alpha:g}"

    def is_wemask(self, variant: str | None = None, rate: float | None = None) -> bool:
        """Whether this is a WeMask condition (of ``variant``, at ``rate``, when given)."""
        return (
            self.kind == "wemask"
            and variant in (None, self.variant)
            and (rate is None or self.rate == rate)
        )

    def spec(
        self,
        model: Any,
        layers: Sequence[int],
        positions: PositionsArg,
        directions: Mapping[int, torch.Tensor],
    ) -> Any:
        """The intervention spec of this condition on ``layers`` at ``positions`` (``directions``:
        the massive direction of each layer, for the direction projection)."""
        if self.kind == "wemask":
            return WeMask.build(model, layers, self.rate, self.variant, positions, seed=self.seed)
        if self.kind == "dim_projection":
            return dim_projection(
                model, self.alpha, layers, variant=self.variant, rate=self.rate, positions=positions
            )
        return DirectionProjection.build(model, self.alpha, directions, layers, positions=positions)


def mask_conditions(
    rates: Sequence[float],
    variants: Sequence[str],
    alphas: Sequence[float],
    soft_rate: float,
    seed: int = 0,
    seeds_at: float | None = None,
    n_seeds: int = 1,
) -> list[MaskCondition]:
    """Every masked condition of a mask-rate study, one forward each, without duplicates: the
    WeMask ``variants`` at each rate ``r > 0`` (one ``r = 1`` forward for all: every selection masks
    every dim), ``n_seeds`` seeds of ``random`` at ``seeds_at`` (one elsewhere), the dim projection
    of the ``weight`` dims at ``soft_rate`` for each ``α > 0`` (at ``α = 1`` it *is* WeMask
    ``weight`` at ``soft_rate``, so it is run only when that WeMask is not) and the direction
    projection for each ``α > 0``. :func:`same_forward` lists what each one also stands for."""
    rates = sorted({float(r) for r in rates if r > 0})
    out: list[MaskCondition] = []
    for r in rates:
        if r == 1.0:
            out.append(MaskCondition("wemask", variants[0], 1.0, 1.0, seed))
            continue
        for v in variants:
            n = n_seeds if (v == "random" and r == seeds_at) else 1
            out += [MaskCondition("wemask", v, r, 1.0, seed + i) for i in range(n)]
    have_weight = "weight" in variants and soft_rate in rates
    for a in alphas:
        if a > 0 and not (a == 1.0 and have_weight):
            out.append(MaskCondition("dim_projection", "weight", soft_rate, a, seed))
    out += [
        MaskCondition("direction_projection", "mean_direction", 0.0, a, seed)
        for a in alphas
        if a > 0
    ]
    return out


def same_forward(
    cond: MaskCondition,
    variants: Sequence[str],
    alphas: Sequence[float],
    soft_rate: float,
    seed: int = 0,
) -> list[MaskCondition]:
    """The conditions that the forward of ``cond`` (one of :func:`mask_conditions`) also measures:
    every other selection at ``r = 1``, and the dim projection at ``α = 1`` for WeMask ``weight``
    (or ``r = 1``) at ``soft_rate``."""
    if cond.kind != "wemask":
        return []
    out = []
    if cond.rate == 1.0:
        out += [MaskCondition("wemask", v, 1.0, 1.0, seed) for v in variants[1:]]
    is_weight = cond.variant == "weight" or cond.rate == 1.0  # r = 1: every selection
    if is_weight and cond.rate == soft_rate and 1.0 in alphas:
        out.append(MaskCondition("dim_projection", "weight", soft_rate, 1.0, seed))
    return out
