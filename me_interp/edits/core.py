"""The one restore mechanism every weight edit is built on, and the map from *parts* to parameters.

:func:`edited_parameters` takes ``{parameter: new value}``, saves a clone of each parameter, writes the
new values in place (``param.data.copy_``: the live tensors the TransformerBridge and the HF model share)
and restores the clones in ``finally`` — after a normal exit *and* after an exception — so the state
dict is bit-identical afterwards. Every edit in :mod:`me_interp.edits` is a thin context manager that
computes new values and delegates here; restoration logic exists once.

Parts of a decoder layer, resolved through :class:`~me_interp.models.LoadedModel` accessors, so no
architecture-specific module name appears here:

* ``"attn_norm"`` — the pre-attention RMSNorm (its gain ``w``);
* ``"ffn_norm"`` — the pre-FFN RMSNorm (its gain ``w``);
* ``"ffn"`` — the gated FFN (``W_gate``, ``W_up``, ``W_down`` and any biases);
* ``"attn"`` — the attention module (Q/K/V/O and, in Qwen3, ``q_norm``/``k_norm``);
* ``"block"`` — every parameter of the decoder layer;

and two *composite* parts, which move a norm together with the sub-layer it feeds (the paper's
RMSNorm–FFN pair, paper.md §2.3):

* ``"ffn_path"`` = ``ffn_norm`` + ``ffn``: ``x' ↦ FFN(RMSNorm_ffn(x'))`` travels whole;
* ``"attn_path"`` = ``attn_norm`` + ``attn``: ``x ↦ Attn(RMSNorm_attn(x))`` travels whole.

A composite's parameter names carry the single part as a prefix (``ffn_norm.weight``,
``ffn.gate_proj.weight``, …), so they are unique and the same in every layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from me_interp.models import LoadedModel

SINGLE_PARTS: tuple[str, ...] = ("attn_norm", "ffn_norm", "ffn", "attn")
"""The parts that are one module each and tile the decoder layer."""
COMPOSITE_PARTS: dict[str, tuple[str, ...]] = {
    "ffn_path": ("ffn_norm", "ffn"),
    "attn_path": ("attn_norm", "attn"),
}
"""Composite part → the single parts it is made of."""
PARTS: tuple[str, ...] = (*SINGLE_PARTS, "block", *COMPOSITE_PARTS)


def check_part(part: str) -> str:
    """Return ``part`` if it is one of :data:`PARTS`, else raise ``ValueError``."""
    if part not in PARTS:
        raise ValueError(f"unknown component {part!r}; choose one of {', '.join(PARTS)}")
    return part


def part_module(model: LoadedModel, layer: int, part: str) -> torch.nn.Module:
    """The HF module holding ``part`` of decoder layer ``layer``.

    For a composite part, a ``ModuleDict`` ``{single part: module}`` that only *refers* to the
    layer's modules (it does not re-parent them), so its parameter names are ``<single part>.<name>``.
    """
    check_part(part)
    model.check_layer(layer)
    if part in COMPOSITE_PARTS:
        return torch.nn.ModuleDict({p: part_module(model, layer, p) for p in COMPOSITE_PARTS[part]})
    if part == "attn_norm":
        return model.attn_norm_module(layer)
    if part == "ffn_norm":
        return model.ffn_norm_module(layer)
    if part == "ffn":
        return model.bridge.blocks[layer].mlp.original_component
    if part == "attn":
        return model.bridge.blocks[layer].attn.original_component
    return model.block_module(layer)


def part_parameters(model: LoadedModel, layer: int, part: str) -> dict[str, torch.nn.Parameter]:
    """``{name relative to the part: live parameter}`` of ``part`` in ``layer``.

    Names are relative to the part's module, so the same part of two layers (or of two models of the
    same architecture) has the same names, in the same order.
    """
    params = dict(part_module(model, layer, part).named_parameters())
    if not params:
        raise ValueError(f"part {part!r} of layer {layer} has no parameters in {model.name}")
    return params


def _check_value(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"new values must be tensors, got {type(value).__name__}")
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"shape mismatch: parameter has shape {tuple(param.shape)}, new value {tuple(value.shape)}"
        )
    if not torch.isfinite(value).all():
        raise ValueError("new parameter values must be finite (no inf/NaN)")


@contextlib.contextmanager
def edited_parameters(edits: Mapping[torch.nn.Parameter, torch.Tensor]) -> Iterator[None]:
    """Write ``edits`` (``{live parameter: new value}``) in place; restore the originals on exit.

    All values are validated (shape, finiteness) before anything is written, the originals are
    cloned, and the clones are copied back in ``finally`` — also when the body raises — so the model's
    state dict is bit-identical after the block.

    Raises:
        ValueError: a shape mismatch or a non-finite value (nothing is written).
        TypeError: a value that is not a tensor.
    """
    items = list(edits.items())
    for param, value in items:
        _check_value(param, value)
    # computed before any write: values may alias parameters that are edited too (swaps)
    new_values = [value.detach().to(param.device, param.dtype).clone() for param, value in items]
    saved = [param.detach().clone() for param, _ in items]
    try:
        with torch.no_grad():
            for (param, _), value in zip(items, new_values):
                param.data.copy_(value)
        yield
    finally:
        with torch.no_grad():
            for (param, _), original in zip(items, saved):
                param.data.copy_(original)
