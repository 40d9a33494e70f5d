"""Moving a component's weights between layers (or models): swaps and patches.

* :func:`swapped_layers` exchanges ``part`` of layers ``a`` and ``b``: afterwards
  ``θ_a^part ← θ_b^part`` and ``θ_b^part ← θ_a^part``; everything else is untouched.
* :func:`patched_weights` copies ``part`` of ``source_layer`` (of ``source_model``, default the same
  model) over ``part`` of ``target_layer``: ``θ_target^part ← θ_source^part``.

``part`` is any part the model has (:func:`me_interp.edits.core.model_parts`), including the
composites ``ffn_path`` (pre-FFN RMSNorm + FFN, + the post-FFN norm on a sandwich-norm model) and
``attn_path`` (pre-attention RMSNorm + attention, + the post-attention norm), which move a sub-layer
and its norms together, and on sandwich-norm models the single parts ``post_ffn_norm`` /
``post_attn_norm``; :func:`me_interp.edits.core.moved_modules` names the HF modules a part moves.
Both are context managers built on
:func:`me_interp.edits.core.edited_parameters`, so the weights are restored bit-identically on exit,
also after an exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from me_interp.edits.core import check_model_part, edited_parameters, part_members, part_parameters
from me_interp.loading.loaded import LoadedModel


@contextlib.contextmanager
def swapped_layers(model: LoadedModel, a: int, b: int, part: str = "block") -> Iterator[None]:
    """Exchange ``part`` (see :func:`me_interp.edits.core.model_parts`) between layers ``a`` and ``b``.

    Raises:
        ValueError: an unknown part or one the model does not have (a post-norm on a model without
            sandwich norms), a layer out of range, or ``a == b`` (a swap with itself).
    """
    check_model_part(model, part)
    model.check_layer(a)
    model.check_layer(b)
    if a == b:
        raise ValueError(f"cannot swap layer {a} with itself: choose two different layers")
    pa, pb = part_parameters(model, a, part), part_parameters(model, b, part)
    _check_same_shapes(pa, pb, f"layer {a}", f"layer {b}", part)
    edits = {pa[n]: pb[n] for n in pa} | {pb[n]: pa[n] for n in pb}
    with edited_parameters(edits):
        yield


@contextlib.contextmanager
def patched_weights(
    model: LoadedModel,
    source_layer: int,
    target_layer: int,
    part: str = "block",
    source_model: LoadedModel | None = None,
) -> Iterator[None]:
    """Copy ``part`` of ``source_layer`` (of ``source_model``, default ``model``) into ``target_layer``.

    Raises:
        ValueError: an unknown part or one a model does not have, a layer out of range (in either
            model), a patch of a layer onto itself within one model (a no-op), or parameters whose
            shapes differ between the models, or models whose norm gains are stored differently
            (``w`` vs ``1 + w``) when the part moves a norm gain.
    """
    src = model if source_model is None else source_model
    check_model_part(src, part)
    check_model_part(model, part)
    src.check_layer(source_layer)
    model.check_layer(target_layer)
    if src is model and source_layer == target_layer:
        raise ValueError(
            f"patching layer {source_layer} onto itself changes nothing: choose another source layer "
            "or a source model"
        )
    ps, pt = part_parameters(src, source_layer, part), part_parameters(model, target_layer, part)
    _check_same_shapes(ps, pt, f"source layer {source_layer}", f"target layer {target_layer}", part)
    moves_a_gain = any(m.endswith("norm") for m in part_members(model, part))
    if moves_a_gain and src.arch.norm_offset != model.arch.norm_offset:
        stored = {0.0: "w = g", 1.0: "w = g - 1"}
        raise ValueError(
            f"the source model stores its norm gains g as {stored[src.arch.norm_offset]} and the "
            f"target as {stored[model.arch.norm_offset]}: copying the stored weights would change "
            "the effective gains; patch between models of one norm convention"
        )
    with edited_parameters({pt[n]: ps[n] for n in pt}):
        yield


def _check_same_shapes(pa: dict, pb: dict, what_a: str, what_b: str, part: str) -> None:
    if list(pa) != list(pb):
        raise ValueError(
            f"part {part!r} has different parameters in {what_a} ({sorted(pa)}) and {what_b} ({sorted(pb)})"
        )
    for n in pa:
        if pa[n].shape != pb[n].shape:
            raise ValueError(
                f"part {part!r}: {n} has shape {tuple(pa[n].shape)} in {what_a} but "
                f"{tuple(pb[n].shape)} in {what_b}; the models must have the same shape"
            )
