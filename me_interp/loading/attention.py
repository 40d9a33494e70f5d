"""Which attention runs: the bridge's eager reconstruction (patterns exist) or the fused kernel.

TransformerLens 4.3 forces ``attn_implementation="eager"`` on the HF model, and its
``PositionEmbeddingsAttentionBridge.forward`` does not call the HF attention at all: it recomputes
``softmax(q kᵀ · scaling + mask) v`` itself with two ``matmul``s, so that ``hook_attn_scores`` and
``hook_pattern`` exist. Setting HF's ``attn_implementation`` to ``"sdpa"`` therefore changes nothing
that runs. :func:`kernel` does what does change it: for the duration of a block, each attention
bridge's forward becomes the HF module's own forward with ``config._attn_implementation = "sdpa"``
(``torch.nn.functional.scaled_dot_product_attention``, one fused call); the HF module's
projections are the bridge's ``LinearBridge``s, so ``hook_q`` / ``hook_k`` / ``hook_v`` / ``hook_z``
and the attention's ``hook_in`` / ``hook_out`` (``blocks.L.hook_attn_out``) still fire. What does not
fire is what only the reconstruction computes: ``hook_attn_scores``, ``hook_pattern``,
``hook_rot_q`` / ``hook_rot_k``, the q/k-norm output hooks. A hook on one of those under the fused
kernel raises :class:`FusedAttentionError` instead of being silently skipped.

The fused kernel is used only for the plain rotary attention bridge without logit softcapping
(Llama, Mistral, Qwen2/3, Gemma 1/3, SmolLM); elsewhere (Phi-3's fused qkv, Gemma 2's softcap) the
block runs eager and says so (``LoadedModel.attention``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

ATTENTIONS = ("eager", "sdpa")
"""``eager``: the bridge's own reconstruction (patterns, scores); ``sdpa``: the fused kernel."""

_FIRES = ("hook_in", "hook_out")
"""The attention bridge's own hook points that fire under the fused kernel."""


class FusedAttentionError(RuntimeError):
    """A hook was attached to an attention hook point that the fused kernel does not compute."""


def _bridge_class() -> type:
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    return PositionEmbeddingsAttentionBridge


def fusable(model: Any) -> bool:
    """Whether every attention of ``model`` (a ``LoadedModel``) can run the fused kernel."""
    cls = _bridge_class()
    for blk in model.bridge.blocks:
        attn = blk.attn
        if type(attn) is not cls:
            return False
        if getattr(attn.original_component, "attn_logit_softcapping", None) is not None:
            return False
    return True


def _unfired_hooks(attn: Any) -> list[str]:
    from transformer_lens.hook_points import HookPoint

    return [
        name
        for name, child in attn.named_children()
        if isinstance(child, HookPoint)
        and name not in _FIRES
        and (child._forward_hooks or child._backward_hooks)
    ]


def _fused_forward(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, None]:
    """The attention bridge's forward through the HF module's own (sdpa) forward."""
    hooked = _unfired_hooks(self)
    if hooked:
        raise FusedAttentionError(
            f"{self.name}: hooks on {hooked} need the eager attention (the fused kernel computes no "
            "scores or pattern); run outside me_interp.loading.attention.kernel(model, 'sdpa')"
        )
    if "hidden_states" in kwargs:
        hidden = kwargs.pop("hidden_states")
    else:
        hidden, args = args[0], args[1:]
    hidden = self.hook_in(hidden)
    out, _ = self.original_component.forward(hidden, *args, **kwargs)
    return self.hook_out(out), None


@contextlib.contextmanager
def kernel(model: Any, attention: str = "eager") -> Iterator[str]:
    """Run the block with ``attention`` (:data:`ATTENTIONS`) where the model allows it; yields (and
    sets ``model.attention`` to) the attention that actually runs, restored afterwards.

    Raises:
        ValueError: ``attention`` is not one of :data:`ATTENTIONS`.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if not hasattr(model, "bridge"):  # another backend's model chooses its own attention
        yield getattr(model, "attention", "eager")
        return
    before = model.attention
    if attention == "eager" or before == "sdpa" or not fusable(model):
        model.attention = before if attention == "eager" or before == "sdpa" else "eager"
        try:
            yield model.attention
        finally:
            model.attention = before
        return
    config = model.hf.config
    impl = config._attn_implementation
    attns = [blk.attn for blk in model.bridge.blocks]
    configs = {id(a.original_component.config): a.original_component.config for a in attns}
    configs[id(config)] = config
    try:
        for a in attns:  # in __dict__: the bridge's __setattr__ would pass it to the HF module
            a.__dict__["forward"] = types.MethodType(_fused_forward, a)
        for c in configs.values():
            c._attn_implementation = "sdpa"
        model.attention = "sdpa"
        yield "sdpa"
    finally:
        for a in attns:
            a.__dict__.pop("forward", None)
        for c in configs.values():
            c._attn_implementation = impl
        model.attention = before


__all__ = ["ATTENTIONS", "FusedAttentionError", "fusable", "kernel"]
