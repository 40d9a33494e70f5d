"""The one restore mechanism every weight edit is built on, and the map from *parts* to parameters.

:func:`edited_parameters` takes ``{parameter: new value}``, saves a clone of each parameter, writes the
new values in place (``param.data.copy_``: the live tensors the TransformerBridge and the HF model share)
and restores the clones in ``finally`` — after a normal exit *and* after an exception — so the state
dict is bit-identical afterwards. Every edit in :mod:`me_interp.edits` is a thin context manager that
computes new values and delegates here; restoration logic exists once.

Parts of a decoder layer, resolved through :class:`~me_interp.models.LoadedModel` accessors and the
model's :class:`~me_interp.architecture.Architecture`, so no architecture-specific module name appears
here:

* ``"attn_norm"`` — the pre-attention RMSNorm (its gain ``w``);
* ``"ffn_norm"`` — the pre-FFN RMSNorm (its gain ``w``);
* ``"ffn"`` — the gated FFN (``W_gate``, ``W_up``, ``W_down`` and any biases);
* ``"attn"`` — the attention module (Q/K/V/O and, in Qwen3 / Gemma 3, ``q_norm``/``k_norm``);
* ``"post_attn_norm"``, ``"post_ffn_norm"`` — only on *sandwich-norm* blocks (Gemma 2/3): the norms
  applied to the attention / FFN output before it joins the residual stream (:data:`POST_NORM_PARTS`;
  asking for one on a model without it raises a ``ValueError`` naming the architecture);
* ``"block"`` — every parameter of the decoder layer;

and two *composite* parts, which move a sub-layer together with its norms — the whole path from the
residual stream back into it (the paper's RMSNorm–FFN pair, paper.md §2.3):

* ``"ffn_path"`` = ``ffn_norm`` + ``ffn`` (+ ``post_ffn_norm`` where the model has one):
  ``x' ↦ PostNorm_ffn(FFN(RMSNorm_ffn(x')))``, the FFN's residual contribution (site ``ffn_out``),
  travels whole;
* ``"attn_path"`` = ``attn_norm`` + ``attn`` (+ ``post_attn_norm``): ``x ↦ PostNorm_attn(Attn(RMSNorm_attn(x)))``.

On a sandwich-norm model the post-FFN norm belongs to the path because it can make the massive
activation: on Gemma-3-270m layer 0's FFN output at ``<bos>`` is only 1.2–1.6× the other tokens', and
the 17× ratio of its residual contribution comes from the post-FFN norm's gain (docs/results_gemma.md).
:func:`part_members` says which single parts a part moves on a given model and :func:`moved_modules`
the HF modules (names within the decoder layer), so results can record what was moved.

A composite's parameter names carry the single part as a prefix (``ffn_norm.weight``,
``ffn.gate_proj.weight``, …), so they are unique and the same in every layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from me_interp.loading.errors import PlacementError
from me_interp.loading.loaded import LoadedModel

SINGLE_PARTS: tuple[str, ...] = ("attn_norm", "ffn_norm", "ffn", "attn")
"""The parts that are one module each and that every supported model has."""
POST_NORM_PARTS: tuple[str, ...] = ("post_attn_norm", "post_ffn_norm")
"""The single parts of sandwich-norm blocks only (Gemma 2/3): the norms on the sub-layer outputs."""
COMPOSITE_PARTS: dict[str, tuple[str, ...]] = {
    "ffn_path": ("ffn_norm", "ffn", "post_ffn_norm"),
    "attn_path": ("attn_norm", "attn", "post_attn_norm"),
}
"""Composite part → the single parts it can be made of, in the order the forward applies them; a
post-norm the model lacks is left out (:func:`part_members`)."""
PARTS: tuple[str, ...] = (*SINGLE_PARTS, "block", *COMPOSITE_PARTS)
"""The parts every supported model has (the weight experiments' claims are made for these)."""
ALL_PARTS: tuple[str, ...] = (*PARTS, *POST_NORM_PARTS)
"""Every part name :func:`check_part` accepts; :func:`model_parts` says which a model has."""
_POST_NORM_OF = {"post_attn_norm": "attention", "post_ffn_norm": "FFN"}


def check_part(part: str) -> str:
    """Return ``part`` if it is one of :data:`ALL_PARTS`, else raise ``ValueError``."""
    if part not in ALL_PARTS:
        raise ValueError(f"unknown component {part!r}; choose one of {', '.join(ALL_PARTS)}")
    return part


def _has_single(model: LoadedModel, single: str) -> bool:
    if single == "post_ffn_norm":
        return model.arch.post_ffn_norm is not None
    if single == "post_attn_norm":
        return model.arch.post_attn_norm is not None
    return True


def model_parts(model: LoadedModel) -> tuple[str, ...]:
    """The parts ``model`` has: :data:`PARTS`, then the post-norms of a sandwich-norm model."""
    return (*PARTS, *(p for p in POST_NORM_PARTS if _has_single(model, p)))


def check_model_part(model: LoadedModel, part: str) -> str:
    """Return ``part`` if ``model`` has it, else raise ``ValueError`` naming the architecture."""
    check_part(part)
    if not _has_single(model, part):
        raise ValueError(
            f"part {part!r} is the norm a sandwich-norm block (Gemma 2/3) applies to the "
            f"{_POST_NORM_OF[part]} output, and {model.arch.family} ({model.name}) has no such norm: "
            f"its {_POST_NORM_OF[part]} output joins the residual stream directly; choose one of "
            f"{', '.join(model_parts(model))}"
        )
    return part


def part_members(model: LoadedModel, part: str) -> tuple[str, ...]:
    """The single parts that ``part`` moves on ``model``, in forward order.

    A single part is itself; a composite is its :data:`COMPOSITE_PARTS` entry without the post-norms
    the model lacks (so on a Llama-style model ``ffn_path`` is ``("ffn_norm", "ffn")`` and on Gemma 2/3
    ``("ffn_norm", "ffn", "post_ffn_norm")``); ``block`` is every single part the model has.

    Raises:
        ValueError: an unknown part, or a post-norm part on a model without post-norms.
    """
    check_model_part(model, part)
    if part == "block":
        return tuple(p for p in (*SINGLE_PARTS, *POST_NORM_PARTS) if _has_single(model, p))
    if part in COMPOSITE_PARTS:
        return tuple(p for p in COMPOSITE_PARTS[part] if _has_single(model, p))
    return (part,)


def _hf_name(model: LoadedModel, single: str) -> str:
    """The HF module name (within a decoder layer) of a single part."""
    arch, blk = model.arch, model.bridge.blocks[0]
    name = {
        "attn_norm": arch.attn_norm,
        "ffn_norm": arch.ffn_norm,
        "post_attn_norm": arch.post_attn_norm,
        "post_ffn_norm": arch.post_ffn_norm,
        "ffn": blk.mlp.name,
        "attn": blk.attn.name,
    }[single]
    assert name is not None  # part_members only lists the parts the model has
    return name


def moved_modules(model: LoadedModel, part: str) -> list[str]:
    """The HF modules (names within a decoder layer) whose parameters ``part`` moves on ``model``,
    in forward order — e.g. ``["pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"]``
    for ``ffn_path`` on Gemma 3, ``["post_attention_layernorm", "mlp"]`` on Llama.

    Raises:
        ValueError: as :func:`part_members`.
    """
    return [_hf_name(model, p) for p in part_members(model, part)]


def part_module(model: LoadedModel, layer: int, part: str) -> torch.nn.Module:
    """The HF module holding ``part`` of decoder layer ``layer``.

    For a composite part, a ``ModuleDict`` ``{single part: module}`` over :func:`part_members` that
    only *refers* to the layer's modules (it does not re-parent them), so its parameter names are
    ``<single part>.<name>``.

    Raises:
        ValueError: an unknown part, a layer out of range, or a post-norm part on a model without
            post-norms (the message names the architecture).
    """
    members = part_members(model, part)
    model.check_layer(layer)
    if part in COMPOSITE_PARTS:
        return torch.nn.ModuleDict({p: part_module(model, layer, p) for p in members})
    if part == "attn_norm":
        return model.attn_norm_module(layer)
    if part == "ffn_norm":
        return model.ffn_norm_module(layer)
    if part == "post_ffn_norm":
        return model.post_ffn_norm_module(layer)
    if part == "post_attn_norm":
        return model.post_attn_norm_module(layer)
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


EDITED_ATTR = "_me_interp_edited"
"""The attribute :func:`edited_parameters` sets on a parameter while it is edited (how many edits
hold it); ``me_interp.probes.batching`` reads the same name to refuse reusing an unedited prefix."""


@contextlib.contextmanager
def edited_parameters(edits: Mapping[torch.nn.Parameter, torch.Tensor]) -> Iterator[None]:
    """Write ``edits`` (``{live parameter: new value}``) in place; restore the originals on exit.

    All values are validated (shape, finiteness) before anything is written, the originals are
    cloned, and the clones are copied back in ``finally`` — also when the body raises — so the model's
    state dict is bit-identical after the block.

    Raises:
        ValueError: a shape mismatch or a non-finite value (nothing is written).
        TypeError: a value that is not a tensor.
        PlacementError: a parameter (or value) is an offloaded ``meta`` placeholder.
    """
    items = list(edits.items())
    for param, value in items:
        if param.device.type == "meta" or value.device.type == "meta":
            raise PlacementError(
                "a weight edit needs the weights on a device, but this one is offloaded (a meta "
                "placeholder; accelerate loads it only inside the forward), so an in-place edit "
                "would not reach the forward: load the model without --max-memory/--offload-folder, "
                "or with a --device-map whose every entry is a device"
            )
        _check_value(param, value)
    # computed before any write: values may alias parameters that are edited too (swaps)
    new_values = [value.detach().to(param.device, param.dtype).clone() for param, value in items]
    saved = [param.detach().clone() for param, _ in items]
    for (
        param,
        _,
    ) in items:  # marked while edited: a run from a later block refuses it (probes.batching)
        setattr(param, EDITED_ATTR, getattr(param, EDITED_ATTR, 0) + 1)
    try:
        with torch.no_grad():
            for (param, _), value in zip(items, new_values):
                param.data.copy_(value)
        yield
    finally:
        with torch.no_grad():
            for (param, _), original in zip(items, saved):
                param.data.copy_(original)
        for param, _ in items:
            setattr(param, EDITED_ATTR, getattr(param, EDITED_ATTR) - 1)
