"""Hook factories for the causal tests of massive activations: remove, ablate, transplant, cap, rescale.

Every factory returns TransformerLens hooks ``list[(hook_name, fn)]`` built with ``functools.partial``;
none mutates the model. Every hook *sets* absolute values (``x[:, p, D] = v``), so it is idempotent
(some bridge hooks fire twice per forward). Where the value depends on the input, the factory measures
it first on the unmodified run of the same ``batch`` (an :class:`~me_interp.probes.activations.Activations`
recorder run by :func:`~me_interp.probes.batching.record`, a forward that stops after the last block
it reads; pass ``acts=`` from one shared recorder to skip it), so the hooks are tied
to that batch (``per_prompt=True``): they also accept a batch of ``n·B`` rows laid out as ``n`` copies
of the ``B`` prompts (row ``c·B + b`` = prompt ``b``, the layout of
:func:`me_interp.patching.patch_sweep`). With ``per_prompt=False`` the value is averaged over the
prompts and the hooks work on any batch.

Where to intervene is measured, never written down (:func:`me_interp.probes.site.locate`).
:func:`prompt_batch` builds the (truncated, subsampled) batch the causal experiments run on. What they
measure lives elsewhere: the removal statistic in :func:`me_interp.claims.excess_fraction`, the other
tokens' mean in :func:`me_interp.probes.alignment.others_mean`, the FFN share in
:func:`me_interp.probes.ffn.ffn_share`.

Notation: ``h_t`` the activation of token ``t`` at the hooked site, ``p`` a massive position, ``D`` the
massive dims, ``h̄ = mean_{t≠p} h_t`` over the other real tokens of the prompt.

* :func:`set_values` — ``x[:, P, D] = v`` (the primitive).
* :func:`remove_massive` — ``h_p[D] ← h̄[D]`` (``fill="others_mean"``) or ``0`` (``fill="zero"``).
* :func:`patch_across_prompts` — ``h_{b,p} ← h_{b+1,p}`` (another prompt's massive token: a control).
* :func:`ablate_dims` — Sun et al.'s mean-ablation ``h_p[D] ← mean_prompts h_p[D]`` or Owen et al.'s
  zero-ablation ``h_p[D] ← 0``.
* :func:`transplant` — ``h_dst ← h_dst + c`` with ``c = P_D(h_src − h̄)`` (``mode="difference"``) or
  ``c = ‖P_D(h_src − h̄)‖ · u`` with ``u`` the prompt-mean unit direction (``mode="direction"``, matched
  norm); optionally ``h_src ← h_src − c_src`` (the component removed from the source).
* :func:`cap_ffn_output` — ``FFN_p ← FFN_p · min(1, median_{t≠p}‖FFN_t‖ / ‖FFN_p‖)``.
* :func:`scale_ffn_product` — ``a_p ← α a_p`` with ``a = act(W_gate x) ⊙ W_up x`` (``mlp.hook_post``).
* :func:`normalize_ffn_product` — ``a_p ← a_p · mean_{t≠p}‖a_t‖ / ‖a_p‖``.
* :func:`flatten_ffn_norm_gain` — RMSNorm-only: the pre-FFN norm output of ``p`` becomes
  ``ĥ_p ⊙ mean(w)`` (the gain flattened for the massive token only).
* :func:`set_ffn_own_at` — ``y_{b, t_b, r} ← v_b`` in the FFN's own output ``y = W_down a``
  (``mlp.hook_out``) at one position ``t_b`` per prompt (Yu et al.'s super activation restored).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from jaxtyping import Float

from me_interp import claims, names
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.alignment import others_mean
from me_interp.probes.batching import record
from me_interp.prompts import spread

HookList = list[tuple[str, object]]


# ------------------------------------------------------------------------------------------
# primitives
# ------------------------------------------------------------------------------------------


def _set(
    x: torch.Tensor, hook, *, pos: torch.Tensor, dims: torch.Tensor | None, values: torch.Tensor
):
    x = x.clone()
    v = values.to(device=x.device, dtype=x.dtype)
    if v.dim() == 3 and v.shape[0] != x.shape[0]:
        if x.shape[0] % v.shape[0]:
            raise ValueError(
                f"per-prompt values for {v.shape[0]} prompts cannot fill a batch of {x.shape[0]} rows"
            )
        v = v.repeat(x.shape[0] // v.shape[0], 1, 1)  # row c*B + b = prompt b
    if dims is None:
        x[:, pos] = v  # v: [P, d] or [B, P, d]
    else:
        sub = x[:, pos]  # [B P d] (a copy)
        sub[..., dims] = v
        x[:, pos] = sub
    return x


def set_values(
    hook_name: str,
    positions: Sequence[int],
    values: Float[torch.Tensor, ...],
    dims: Sequence[int] | None = None,
) -> HookList:
    """``x[:, positions, dims] = values`` at ``hook_name``.

    Args:
        hook_name: a TransformerLens hook name (build it with :mod:`me_interp.names`).
        positions: token positions ``P``.
        values: ``[P, k]`` (same for every row) or ``[B, P, k]`` (per prompt; a batch of ``n·B`` rows
            is taken as ``n`` copies of the ``B`` prompts); ``k`` = ``len(dims)`` or the full width
            when ``dims`` is None.
        dims: the dims to set (None: all).

    Raises:
        ValueError: empty positions/dims or a shape mismatch.
    """
    positions = [int(p) for p in positions]
    if not positions:
        raise ValueError("positions must not be empty")
    if dims is not None:
        dims = [int(d) for d in dims]
        if not dims:
            raise ValueError("dims must not be empty (pass None for all dims)")
        if len(set(dims)) != len(dims):
            raise ValueError(f"dims must be distinct, got {dims}")
    if values.dim() not in (2, 3) or values.shape[-2] != len(positions):
        raise ValueError(
            f"values must be [P, k] or [batch, P, k] with P = {len(positions)}, got {tuple(values.shape)}"
        )
    if dims is not None and values.shape[-1] != len(dims):
        raise ValueError(f"values have {values.shape[-1]} columns for {len(dims)} dims")
    fn = partial(
        _set,
        pos=torch.tensor(positions),
        dims=None if dims is None else torch.tensor(dims),
        values=values.detach().clone(),
    )
    return [(hook_name, fn)]


def _read(
    model: LoadedModel, batch: Batch, name: str, acts: Mapping[str, torch.Tensor] | None
) -> torch.Tensor:
    """The unmodified activation ``name`` of ``batch``: from ``acts`` when it has it, else recorded
    (one forward of the batch as it is, stopped after the block of ``name``)."""
    if acts is not None and name in acts:
        x = acts[name]
        if x.shape[0] != len(batch):
            raise ValueError(f"acts[{name!r}] has {x.shape[0]} rows for a batch of {len(batch)}")
        return x
    fresh = Activations(model, batch, [name])
    record(model, batch, [fresh], last_layer=fresh.last_layer, max_tokens=None)
    return fresh[name]


def _check_positions(batch: Batch, positions: Sequence[int]) -> list[int]:
    positions = [int(p) for p in positions]
    if not positions:
        raise ValueError("positions must not be empty")
    shortest = min(batch.lengths)
    for p in positions:
        if not 0 <= p < shortest:
            raise ValueError(f"position {p} is outside the shortest prompt ({shortest} tokens)")
    return positions


def _check_dims(model: LoadedModel, dims: Sequence[int] | None, width: int | None = None):
    if dims is None:
        return None
    dims = [int(d) for d in dims]
    width = model.d_model if width is None else width
    if not dims:
        raise ValueError("dims must not be empty (pass None for all dims)")
    for d in dims:
        if not 0 <= d < width:
            raise ValueError(f"dim {d} out of range for width {width}")
    return dims


def _others_norm(x, mask, positions, how: Literal["mean", "median"]):
    keep = mask.bool().clone()
    keep[:, list(positions)] = False
    n = x.float().norm(dim=-1).masked_fill(~keep, float("nan"))  # [batch pos]
    return n.nanmedian(-1).values if how == "median" else n.nanmean(-1)


def _finish(values: torch.Tensor, per_prompt: bool) -> torch.Tensor:
    """``[batch, P, k]`` → itself, or its prompt mean ``[P, k]``."""
    return values if per_prompt else values.mean(0)


# ------------------------------------------------------------------------------------------
# residual-stream edits
# ------------------------------------------------------------------------------------------


def remove_massive(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Sequence[int],
    dims: Sequence[int] | None = None,
    site: str = "resid_post",
    fill: str = "others_mean",
    per_prompt: bool = True,
    acts: Mapping[str, torch.Tensor] | None = None,
) -> HookList:
    """Remove the massive activation at ``site`` of ``layer``: ``h_p[D] ← h̄[D]`` (or 0).

    Args:
        dims: massive dims ``D`` (None: the whole vector, i.e. ``h_p ← h̄``).
        site: any of :data:`me_interp.names.SITES` (e.g. ``resid_post`` = layer output,
            ``ffn_out`` = the FFN's contribution, ``resid_pre`` = the layer's input).
        fill: ``others_mean`` (the other tokens' mean) or ``zero``.
        per_prompt: values per prompt (tied to ``batch``) or averaged (any batch).
        acts: the unmodified run's activations of ``batch`` (an :class:`~me_interp.probes.activations.Activations` recorder) to reuse instead of
            a forward; must hold the hook this factory reads.
    """
    model.check_layer(layer)
    positions = _check_positions(batch, positions)
    dims = _check_dims(model, dims)
    if fill not in ("others_mean", "zero"):
        raise ValueError(f"fill must be 'others_mean' or 'zero', got {fill!r}")
    if site not in names.SITES:
        raise ValueError(f"site must be one of {', '.join(names.SITES)}, got {site!r}")
    name = names.site(site, layer)
    sel = slice(None) if dims is None else dims
    if fill == "zero":
        vals = torch.zeros(len(batch), len(positions), model.d_model)[..., sel]
    else:
        x = _read(model, batch, name, acts).float()  # [B T d]
        mean = others_mean(x, batch.attention_mask.to(x.device), positions)  # [B d]
        vals = mean[:, None, :].expand(-1, len(positions), -1)[..., sel].cpu()
    return set_values(name, positions, _finish(vals, per_prompt), dims)


def ablate_dims(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Sequence[int],
    dims: Sequence[int],
    mode: str = "zero",
    acts: Mapping[str, torch.Tensor] | None = None,
) -> HookList:
    """Ablate the massive dims of the layer output at the massive positions.

    ``mode="mean"`` (Sun et al.): ``h_p[D] ← mean over the prompts of h_p[D]`` — the massive value kept
    at its typical size; ``mode="zero"`` (Owen et al.): ``h_p[D] ← 0``. ``acts`` as in
    :func:`remove_massive`.
    """
    model.check_layer(layer)
    positions = _check_positions(batch, positions)
    dims = _check_dims(model, dims)
    if dims is None:
        raise ValueError("ablate_dims needs the massive dims")
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    name = names.resid_post(layer)
    if mode == "zero":
        vals = torch.zeros(len(positions), len(dims))
    else:
        x = _read(model, batch, name, acts).float().cpu()
        vals = x[:, positions][..., dims].mean(0)  # [P k]
    return set_values(name, positions, vals, dims)


def patch_across_prompts(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Sequence[int],
    site: str = "resid_post",
    shift: int = 1,
    acts: Mapping[str, torch.Tensor] | None = None,
) -> HookList:
    """``h_{b,p} ← h_{(b+shift) mod B, p}``: each prompt gets another prompt's activation at ``p``.

    A control for removal: the massive token stays massive but comes from a different input.
    ``acts`` as in :func:`remove_massive`.

    Raises:
        ValueError: fewer than 2 prompts, or ``shift`` a multiple of the number of prompts.
    """
    model.check_layer(layer)
    positions = _check_positions(batch, positions)
    B = len(batch)
    if B < 2 or shift % B == 0:
        raise ValueError(
            f"patching across prompts needs >= 2 prompts and a shift that moves them (B={B}, shift={shift})"
        )
    name = names.site(site, layer)
    x = _read(model, batch, name, acts).float().cpu()
    src = torch.roll(x[:, positions], shifts=-shift, dims=0)  # row b <- row b+shift
    return set_values(name, positions, src)


@dataclass(frozen=True)
class Transplant:
    """What :func:`transplant` moved: per prompt, the component added to ``dst`` and its norm."""

    hooks: HookList
    component: Float[torch.Tensor, "batch d_model"]
    norm: Float[torch.Tensor, " batch"]


def transplant(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    src: int,
    dst: int,
    dims: Sequence[int] | None = None,
    mode: str = "difference",
    remove_source: bool = False,
    acts: Mapping[str, torch.Tensor] | None = None,
) -> Transplant:
    """Write the massive component of token ``src`` into token ``dst`` at the output of ``layer``.

    ``c_b = P_D(h_src − h̄)`` (``h̄`` = mean of the tokens other than ``src``; ``P_D`` keeps dims ``D``,
    all dims when None). ``mode="difference"`` adds ``c_b``; ``mode="direction"`` adds
    ``‖c_b‖ · u`` with ``u = mean_b c_b / ‖mean_b c_b‖`` (one direction for every prompt, at matched
    norm). ``remove_source=True`` also subtracts ``c_b`` from ``src``: ``h_src ← h_src − c_b``.
    ``acts`` as in :func:`remove_massive`.

    Raises:
        ValueError: ``src == dst`` or a position outside a prompt.
    """
    model.check_layer(layer)
    _check_positions(batch, [src, dst])
    if src == dst:
        raise ValueError("src and dst positions must differ")
    dims = _check_dims(model, dims)
    if mode not in ("difference", "direction"):
        raise ValueError(f"mode must be 'difference' or 'direction', got {mode!r}")
    name = names.resid_post(layer)
    x = _read(model, batch, name, acts).float().cpu()  # [B T d]
    diff = x[:, src] - others_mean(x, batch.attention_mask.cpu(), [src])  # [B d]
    if dims is not None:
        proj = torch.zeros_like(diff)
        proj[:, dims] = diff[:, dims]
        diff = proj
    norm = diff.norm(dim=-1)
    if mode == "direction":
        u = diff.mean(0)
        u = u / u.norm()
        comp = norm[:, None] * u[None]
    else:
        comp = diff
    new_dst = x[:, dst] + comp
    if remove_source:
        new_src = x[:, src] - comp
        vals = torch.stack([new_src, new_dst], dim=1)  # [B 2 d]
        hooks = set_values(name, [src, dst], vals)
    else:
        hooks = set_values(name, [dst], new_dst[:, None])
    return Transplant(hooks=hooks, component=comp, norm=norm)


# ------------------------------------------------------------------------------------------
# FFN-only and RMSNorm-only edits at one layer
# ------------------------------------------------------------------------------------------


def cap_ffn_output(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Sequence[int],
    acts: Mapping[str, torch.Tensor] | None = None,
) -> HookList:
    """``FFN_p ← FFN_p · min(1, median_{t∉P}‖FFN_t‖ / ‖FFN_p‖)`` at ``blocks.L.hook_mlp_out``.

    ``acts`` as in :func:`remove_massive`.
    """
    model.check_layer(layer)
    positions = _check_positions(batch, positions)
    name = names.ffn_out(layer)
    x = _read(model, batch, name, acts).float().cpu()
    cap = _others_norm(x, batch.attention_mask.cpu(), positions, "median")  # [B]
    sub = x[:, positions]  # [B P d]
    scale = (cap[:, None] / sub.norm(dim=-1)).clamp(max=1.0)
    return set_values(name, positions, sub * scale[..., None])


def scale_ffn_product(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Sequence[int],
    alpha: float,
    acts: Mapping[str, torch.Tensor] | None = None,
) -> HookList:
    """``a_p ← α a_p`` for the FFN intermediate product ``a = act(W_gate x) ⊙ W_up x``.

    ``acts`` as in :func:`remove_massive`.
    """
    model.check_layer(layer)
    positions = _check_positions(batch, positions)
    name = names.site("ffn_act", layer)
    x = _read(model, batch, name, acts).float().cpu()
    return set_values(name, positions, float(alpha) * x[:, positions])


def normalize_ffn_product(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Sequence[int],
    acts: Mapping[str, torch.Tensor] | None = None,
) -> HookList:
    """``a_p ← a_p · mean_{t∉P}‖a_t‖ / ‖a_p‖``: the massive token's FFN product at the others' norm.

    ``acts`` as in :func:`remove_massive`.
    """
    model.check_layer(layer)
    positions = _check_positions(batch, positions)
    name = names.site("ffn_act", layer)
    x = _read(model, batch, name, acts).float().cpu()
    target = _others_norm(x, batch.attention_mask.cpu(), positions, "mean")  # [B]
    sub = x[:, positions]
    return set_values(name, positions, sub * (target[:, None] / sub.norm(dim=-1))[..., None])


def flatten_ffn_norm_gain(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Sequence[int],
    acts: Mapping[str, torch.Tensor] | None = None,
) -> HookList:
    """RMSNorm-only: the pre-FFN norm output of the massive token becomes ``ĥ_p ⊙ mean(w)``
    (``w`` the effective gain, ``1 + weight`` on Gemma).

    ``ĥ_p = h_p / rms(h_p)`` is read at ``ln2.hook_normalized``; the hook sets ``ln2.hook_out`` at
    ``p``, so the FFN sees the token standardised but without the gain's per-dim emphasis. ``acts``
    as in :func:`remove_massive` (it must hold ``ln2.hook_normalized``).
    """
    model.check_layer(layer)
    positions = _check_positions(batch, positions)
    norm_name, out_name = names.site("ffn_normalized", layer), names.ffn_in(layer)
    hat = _read(model, batch, norm_name, acts).float().cpu()
    w_mean = float(model.ffn_norm_gain(layer).detach().float().mean())
    return set_values(out_name, positions, hat[:, positions] * w_mean)


def _set_at(y, hook, *, row: int, pos: torch.Tensor, values: torch.Tensor):
    y = y.clone()
    y[torch.arange(y.shape[0], device=y.device), pos.to(y.device), row] = values.to(y)
    return y


def set_ffn_own_at(
    layer: int, row: int, positions: Sequence[int], values: Float[torch.Tensor, " batch"]
) -> HookList:
    """The hook that writes ``values[b]`` into ``down_proj``'s output ``y_row`` at ``positions[b]`` of
    prompt ``b`` in ``layer`` (``mlp.hook_out``, the FFN's own output before any post-FFN norm;
    idempotent: it sets absolute values)."""
    pos = torch.as_tensor([int(p) for p in positions], dtype=torch.long)
    fn = partial(_set_at, row=int(row), pos=pos, values=values.detach().clone().float())
    return [(names.ffn_own(layer), fn)]


# ------------------------------------------------------------------------------------------
# inputs and where to intervene (measured, never hard-coded)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptsUsed:
    """The prompts a causal experiment ran on, as its Result records them.

    Attributes:
        indices: their indices in the prompt list; ``lengths``: their token counts after the cut.
        n_given: prompts given; ``n_short``: prompts skipped as too short; ``max_tokens``: the cut.
    """

    indices: tuple[int, ...]
    lengths: tuple[int, ...]
    n_given: int
    n_short: int
    max_tokens: int


@dataclass(frozen=True)
class PromptBatch:
    """The prompts a causal experiment runs on (see :func:`prompt_batch`).

    Attributes:
        batch: the kept prompts, cut to at most ``max_tokens`` tokens, right-padded.
        indices: their indices in the prompt list.
        n_given: prompts given.
        n_short: prompts skipped because they have fewer than ``min_tokens`` tokens.
        max_tokens: the cut.
    """

    batch: Batch
    indices: tuple[int, ...]
    n_given: int
    n_short: int
    max_tokens: int

    def at_least(self, n_tokens: int) -> PromptBatch:
        """The same selection without the prompts shorter than ``n_tokens`` (counted as short).

        Raises:
            claims.NotApplicable: no prompt has ``n_tokens`` tokens (the claims need longer inputs).
        """
        keep = [i for i, n in enumerate(self.batch.lengths) if n >= n_tokens]
        if len(keep) == len(self.indices):
            return self
        if not keep:
            raise claims.NotApplicable(
                f"no prompt has the {n_tokens} tokens this experiment needs "
                f"(longest after the cut: {max(self.batch.lengths)})"
            )
        width = max(self.batch.lengths[i] for i in keep)
        b = self.batch
        batch = Batch(b.tokens[keep, :width], b.attention_mask[keep, :width], None)
        n_short = self.n_short + len(self.indices) - len(keep)
        idx = tuple(self.indices[i] for i in keep)
        return PromptBatch(batch, idx, self.n_given, n_short, self.max_tokens)

    def used(self) -> PromptsUsed:
        """What a Result records of this selection (:class:`PromptsUsed`)."""
        return PromptsUsed(self.indices, tuple(self.batch.lengths), self.n_given, self.n_short,
                           self.max_tokens)  # fmt: skip

    def same_prefix(self, p: int) -> bool:
        """Whether every prompt has the same tokens up to position ``p`` (then a swap of token
        ``p``'s state between prompts, or its mean over prompts, is the identity)."""
        prefix = self.batch.tokens[:, : p + 1]
        return bool((prefix == prefix[:1]).all())

    def to_dict(self) -> dict:
        return {
            "n_prompts": len(self.indices),
            "n_given": self.n_given,
            "n_skipped_short": self.n_short,
            "max_tokens": self.max_tokens,
            "lengths": self.batch.lengths,
            "indices": list(self.indices),
        }


def prompt_batch(
    model: LoadedModel,
    prompts: Sequence[str],
    max_tokens: int,
    max_prompts: int | None = None,
    min_tokens: int = 2,
) -> PromptBatch:
    """Tokenise ``prompts``, skip those shorter than ``min_tokens``, keep ``max_prompts`` of the rest
    spread evenly over the list (all when ``None``), and cut each to its first ``max_tokens`` tokens.

    The causal claims are about the first tokens (the massive token and the sink it draws), so the
    cut loses nothing they need and makes every forward cheap; subsampling evenly keeps the mix of
    genres of an ordered prompt file.

    Raises:
        ValueError: ``max_tokens < min_tokens``.
        claims.NotApplicable: no prompt has ``min_tokens`` tokens (the claims need longer inputs).
    """
    if max_tokens < min_tokens or min_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= min_tokens ({min_tokens}) >= 1")
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
    full = model.tokenize(list(prompts))
    rows = [full.tokens[i, :n].tolist() for i, n in enumerate(full.lengths)]
    ok = [i for i, r in enumerate(rows) if len(r) >= min_tokens]
    if not ok:
        raise claims.NotApplicable(
            f"no prompt has the {min_tokens} tokens this experiment needs "
            f"(longest: {max(len(r) for r in rows)})"
        )
    keep = spread(ok, max_prompts or 0)
    batch = model.batch_from_ids([rows[i][:max_tokens] for i in keep])
    return PromptBatch(batch, tuple(keep), len(rows), len(rows) - len(ok), max_tokens)


__all__ = [
    "PromptBatch",
    "Transplant",
    "ablate_dims",
    "cap_ffn_output",
    "flatten_ffn_norm_gain",
    "normalize_ffn_product",
    "patch_across_prompts",
    "prompt_batch",
    "remove_massive",
    "scale_ffn_product",
    "set_ffn_own_at",
    "set_values",
    "transplant",
]
