"""What the TransformerLens hooks and the HF hooks share, so the two cannot drift.

An intervention here is a frozen *spec* (``WeMask``, ``DimProjection``, ``DirectionProjection``) that
edits one site of some layers for some *target tokens* only:

* ``site = "attn_in"``: the pre-attention RMSNorm output ``RMSNorm_attn(x) = x / rms(x) ⊙ w``
  (``blocks.L.ln1.hook_out`` in TransformerLens, the output of HF ``input_layernorm``); the residual
  stream is untouched.
* ``site = "resid_post"``: the layer output (``blocks.L.hook_resid_post``, the HF decoder layer's output);
  the edit is carried downstream by the residual stream.

Target tokens are given by *absolute* positions (``positions``: one list for every prompt, or one list
per prompt; default ``(0,)``). In a TransformerLens forward (no KV cache, right padding) the absolute
position of index ``t`` is ``t``. The HF hooks read it from the decoder layer's ``position_ids`` (or the
cache length), so a decode step with a KV cache, whose only query token sits at position ``n``, is never
mistaken for position 0 — the KV-cache bug of the released WeMask code (``paper.md`` §4).

Every spec implements ``edit(h, layer, target, resid) -> h'`` on ``h [batch, pos, d_model]`` with
``target [batch, pos]`` (bool) and ``resid`` the norm's input (needed only by the ``magnitude`` variant).
Backends call it through :func:`apply_edit`, which clones, edits and returns the tensor.

Hooks are idempotent: :class:`OncePerTensor` returns a tensor unchanged when it is the very output the
hook produced on the previous call (some TransformerBridge hook points fire twice per forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from jaxtyping import Bool, Float, Int

from me_interp.selection import (  # noqa: F401  (re-exported: the interventions' selection rules)
    COUNT_RULES,
    check_fraction,
    n_selected,
    top_abs_dims,
)

#: Where the masking interventions edit (a subset of :data:`me_interp.names.SITES`): ``attn_in``
#: (the pre-attention norm's output) or ``resid_post`` (the layer output).
MASK_SITES = ("attn_in", "resid_post")

PositionsArg = Sequence[int] | Sequence[Sequence[int]]


class Edit(Protocol):
    """An intervention spec usable by both backends."""

    site: str
    layers: tuple[int, ...]
    needs_resid: bool

    def edit(
        self, h: torch.Tensor, layer: int, target: torch.Tensor, resid: torch.Tensor | None
    ) -> torch.Tensor: ...


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


def check_site(site: str) -> str:
    if site not in MASK_SITES:
        raise ValueError(f"unknown site {site!r}; choose one of {MASK_SITES}")
    return site


def check_layers(
    layers: Sequence[int], n_layers: int, what: str | None = None, *, sort: bool = True
) -> tuple[int, ...]:
    """Validate 0-based layer indices against ``n_layers``; return them unique.

    Args:
        layers: the indices to check.
        n_layers: the model's layer count.
        what: named in the error messages (e.g. a CLI flag, ``"--partners"``).
        sort: sorted (default), or unique in the given order.

    Raises:
        TypeError: an index that is not an int.
        ValueError: an index out of range, or no index at all.
    """
    pre = f"{what}: " if what else ""
    out = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"{pre}layers must be ints, got {layer!r}")
        if not 0 <= layer < n_layers:
            raise ValueError(
                f"{pre}layer {layer} is out of range: the model has {n_layers} layers "
                f"(0..{n_layers - 1})"
            )
        out.append(layer)
    if not out:
        raise ValueError(f"{pre}no layers to intervene on: give at least one layer")
    return tuple(sorted(set(out))) if sort else tuple(dict.fromkeys(out))


def normalize_positions(positions: PositionsArg) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
    """``(0,)``-style (every prompt) or ``((0,), (0, 5))``-style (per prompt) absolute positions."""
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Sequence):
        raise TypeError(
            "positions must be a list of ints (all prompts) or a list of lists (one per prompt)"
        )
    if len(positions) == 0:
        raise ValueError("positions is empty: give at least one position (e.g. (0,))")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in positions):
        flat = tuple(int(p) for p in positions)  # type: ignore[arg-type]
        if any(p < 0 for p in flat):
            raise ValueError(f"positions must be >= 0 (absolute positions), got {flat}")
        return flat
    rows = []
    for row in positions:
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise TypeError("positions must be all ints or all lists of ints")
        r = tuple(int(p) for p in row)
        if any(p < 0 for p in r):
            raise ValueError(f"positions must be >= 0 (absolute positions), got {r}")
        rows.append(r)
    return tuple(rows)


def target_mask(
    abs_pos: Int[torch.Tensor, "rows pos"], positions: tuple, batch: int
) -> Bool[torch.Tensor, "batch pos"]:
    """Which tokens of a ``[batch, pos]`` activation sit at one of the target absolute positions.

    Args:
        abs_pos: absolute positions, ``[batch, pos]`` or ``[1, pos]`` (broadcast over the batch).
        positions: from :func:`normalize_positions`; per-prompt rows must match ``batch``.
        batch: the activation's batch size.
    """
    abs_pos = abs_pos.expand(batch, abs_pos.shape[-1])
    if positions and isinstance(positions[0], tuple):
        if len(positions) != batch:
            raise ValueError(
                f"positions has {len(positions)} rows (one per prompt) but the batch has {batch} prompts"
            )
        out = torch.zeros(abs_pos.shape, dtype=torch.bool, device=abs_pos.device)
        for b, row in enumerate(positions):
            if row:
                out[b] = torch.isin(abs_pos[b], torch.tensor(row, device=abs_pos.device))
        return out
    return torch.isin(abs_pos, torch.tensor(positions, device=abs_pos.device))


# ------------------------------------------------------------------------------------------
# the edits themselves (pure tensor functions)
# ------------------------------------------------------------------------------------------


def zero_dims(
    h: Float[torch.Tensor, "batch pos d"],
    target: Bool[torch.Tensor, "batch pos"],
    dims: Int[torch.Tensor, "*n k"],
) -> Float[torch.Tensor, "batch pos d"]:
    """``h`` with ``h[b, t, i] = 0`` for every target token ``(b, t)`` and ``i ∈ dims``.

    ``dims`` is ``[k]`` (same dims for every target token) or ``[n_targets, k]`` (one row per target
    token, in ``target.nonzero()`` order).
    """
    return scale_dims(h, target, dims, 0.0)


def scale_dims(
    h: Float[torch.Tensor, "batch pos d"],
    target: Bool[torch.Tensor, "batch pos"],
    dims: Int[torch.Tensor, "*n k"],
    keep: float,
) -> Float[torch.Tensor, "batch pos d"]:
    """``h − (1 − keep) P_S h`` on the target tokens, ``P_S`` the projection on the coordinate dims S."""
    out = h.clone()
    if dims.numel() == 0 or not bool(target.any()):
        return out
    sel = out[target]  # [n d]
    dims = dims.to(sel.device)
    idx = dims.expand(sel.shape[0], dims.shape[-1]) if dims.dim() == 1 else dims
    factor = torch.full(idx.shape, keep, dtype=sel.dtype, device=sel.device)
    sel = sel.scatter(-1, idx, sel.gather(-1, idx) * factor)
    out[target] = sel
    return out


def remove_direction(
    h: Float[torch.Tensor, "batch pos d"],
    target: Bool[torch.Tensor, "batch pos"],
    v: Float[torch.Tensor, " d"],
    alpha: float | int,
) -> Float[torch.Tensor, "batch pos d"]:
    """``h − α (⟨h, v⟩ / ‖v‖²) v`` on the target tokens; other tokens unchanged."""
    out = h.clone()
    if alpha == 0.0 or not bool(target.any()):
        return out
    v = v.to(device=h.device, dtype=h.dtype)
    sel = out[target]  # [n d]
    coef = (sel @ v) / (v @ v)  # [n]
    out[target] = sel - alpha * coef[:, None] * v
    return out


# ------------------------------------------------------------------------------------------
# idempotent hook wrapper
# ------------------------------------------------------------------------------------------


class OncePerTensor:
    """Remembers the last tensor a hook returned; a second call on that same output is a no-op.

    A hook point that fires twice per forward hands the hook its own output the second time; editing
    it again would compound soft edits and re-select ``activation`` dims. Identity or exact equality
    with the last output is the test (an unchanged input is returned unchanged either way).
    """

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None

    def seen(self, x: torch.Tensor) -> bool:
        last = self.last
        if last is None:
            return False
        return (
            x.shape == last.shape
            and x.dtype == last.dtype
            and x.device == last.device
            and bool(torch.equal(x, last))
        )

    def remember(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x.detach()
        return x


def apply_edit(
    spec: Any,
    h: torch.Tensor,
    layer: int,
    abs_pos: torch.Tensor,
    resid: torch.Tensor | None,
    once: OncePerTensor | None = None,
) -> torch.Tensor:
    """Run ``spec.edit`` on ``h`` for the tokens at the spec's target absolute positions."""
    if once is not None and once.seen(h):
        return h
    target = target_mask(abs_pos, spec.positions, h.shape[0])
    out = spec.edit(h, layer, target, resid)
    return once.remember(out) if once is not None else out


# ------------------------------------------------------------------------------------------
# model adapter: a LoadedModel or a plain HF causal LM
# ------------------------------------------------------------------------------------------


def hf_of(model: Any) -> torch.nn.Module:
    """The HF model behind ``model`` (a :class:`~me_interp.models.LoadedModel` or an HF model)."""
    from me_interp.loading.loaded import LoadedModel

    return model.hf if isinstance(model, LoadedModel) else model


def decoder_layers(model: Any) -> Any:
    """The HF decoder layers (``model.model.layers`` for a Llama/Qwen causal LM)."""
    hf = hf_of(model)
    dec = hf.get_decoder() if hasattr(hf, "get_decoder") else hf
    layers = getattr(dec, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(hf).__name__} has no decoder layers (.model.layers): not a Llama/Qwen-style model"
        )
    return layers


def attn_norm(model: Any, layer: int) -> torch.nn.Module:
    """The pre-attention RMSNorm module of ``layer``: ``model.attn_norm_module(layer)`` for a
    :class:`~me_interp.models.LoadedModel`, :func:`me_interp.architecture.hf_attn_norm` of the
    decoder layer for a plain HF model."""
    from me_interp.architecture import hf_attn_norm
    from me_interp.loading.loaded import LoadedModel

    if isinstance(model, LoadedModel):
        return model.attn_norm_module(layer)
    layers = decoder_layers(model)
    check_layers([layer], len(layers))
    return hf_attn_norm(layers[layer])


def attn_norm_gain(model: Any, layer: int) -> torch.Tensor:
    """The *effective* gain ``g`` of the pre-attention RMSNorm of ``layer`` (detached):
    ``RMSNorm_attn(x) = x / rms(x) ⊙ g`` — the stored weight, or ``1 + weight`` on Gemma. For a
    :class:`~me_interp.models.LoadedModel` from its :class:`~me_interp.architecture.Architecture`;
    for a plain HF model the offset is measured on the norm module itself."""
    from me_interp.architecture import measure_norm_offset
    from me_interp.loading.loaded import LoadedModel

    if isinstance(model, LoadedModel):
        return model.attn_norm_gain(layer)
    module = attn_norm(model, layer)
    offset = measure_norm_offset(module)
    w = module.weight.detach()
    return w + offset if offset else w


def n_layers_of(model: Any) -> int:
    from me_interp.loading.loaded import LoadedModel

    return model.n_layers if isinstance(model, LoadedModel) else len(decoder_layers(model))


def d_model_of(model: Any) -> int:
    return int(attn_norm(model, 0).weight.shape[-1])


# ------------------------------------------------------------------------------------------
# TransformerLens backend
# ------------------------------------------------------------------------------------------


def _stash_resid(x: torch.Tensor, hook: Any, *, store: dict, layer: int) -> torch.Tensor:
    store[layer] = x.detach()
    return x


def _tl_edit(
    x: torch.Tensor,
    hook: Any,
    *,
    spec: Any,
    layer: int,
    store: dict,
    once: OncePerTensor,
) -> torch.Tensor:
    T = x.shape[1]
    abs_pos = torch.arange(T, device=x.device)[None, :]  # no KV cache in a TL forward
    resid = store.get(layer) if spec.needs_resid else None
    if spec.needs_resid and (resid is None or resid.shape != x.shape):
        raise RuntimeError(f"the residual input of layer {layer} was not recorded before its norm")
    return apply_edit(spec, x, layer, abs_pos, resid, once)


def tl_hooks(spec: Any) -> list[tuple[str, Any]]:
    """TransformerLens ``fwd_hooks`` applying ``spec`` (positions are absolute = index, no cache)."""
    from functools import partial

    from me_interp import names

    store: dict[int, torch.Tensor] = {}
    hooks: list[tuple[str, Any]] = []
    for layer in spec.layers:
        if spec.needs_resid:
            hooks.append((names.resid_pre(layer), partial(_stash_resid, store=store, layer=layer)))
        hooks.append(
            (
                names.site(spec.site, layer),
                partial(_tl_edit, spec=spec, layer=layer, store=store, once=OncePerTensor()),
            )
        )
    return hooks
