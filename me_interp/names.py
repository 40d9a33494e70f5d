"""The one place TransformerLens hook-name strings are built.

Sites of a pre-norm decoder block L (0-based), in forward order::

    resid_pre  = blocks.L.hook_resid_pre            x
    attn_in    = blocks.L.ln1.hook_out              RMSNorm_attn(x)  (after the gain)
    attn_out   = blocks.L.hook_attn_out             Attn(RMSNorm_attn(x))
    resid_mid  = blocks.L.hook_resid_mid            x' = x + attn_out
    ffn_in     = blocks.L.ln2.hook_out              RMSNorm_ffn(x')  (after the gain)
    ffn_out    = blocks.L.hook_mlp_out              FFN(RMSNorm_ffn(x'))
    resid_post = blocks.L.hook_resid_post           x' + ffn_out

``*.hook_normalized`` is the standardised vector ``h / rms(h)`` *before* the gain; ``*.hook_out`` is
after it. Inside the gated FFN: ``mlp.hook_pre`` = gate projection (pre-activation),
``mlp.hook_pre_linear`` = up projection, ``mlp.hook_post`` = act(gate) * up (input of W_down).

Aliases fire under their canonical name (``hook.name`` of ``hook_resid_post`` is ``blocks.L.hook_out``)
and some fire twice per forward, so hooks must not key on ``hook.name`` and must be idempotent.
"""

from __future__ import annotations

SITES: tuple[str, ...] = (
    "resid_pre",
    "attn_in",
    "attn_out",
    "resid_mid",
    "ffn_in",
    "ffn_out",
    "resid_post",
)

_SITE_HOOKS = {
    "resid_pre": "hook_resid_pre",
    "attn_in": "ln1.hook_out",
    "attn_normalized": "ln1.hook_normalized",
    "attn_out": "hook_attn_out",
    "resid_mid": "hook_resid_mid",
    "ffn_in": "ln2.hook_out",
    "ffn_normalized": "ln2.hook_normalized",
    "ffn_gate": "mlp.hook_pre",
    "ffn_up": "mlp.hook_pre_linear",
    "ffn_act": "mlp.hook_post",
    "ffn_out": "hook_mlp_out",
    "resid_post": "hook_resid_post",
    "pattern": "attn.hook_pattern",
    "attn_scores": "attn.hook_attn_scores",
    "q": "attn.hook_q",
    "k": "attn.hook_k",
    "v": "attn.hook_v",
    "z": "attn.hook_z",
}

ALL_SITES: tuple[str, ...] = tuple(_SITE_HOOKS)


def site(name: str, layer: int) -> str:
    """Hook name of ``name`` (one of :data:`ALL_SITES`) in block ``layer``."""
    try:
        return f"blocks.{layer}.{_SITE_HOOKS[name]}"
    except KeyError:
        raise ValueError(f"unknown site {name!r}; known sites: {', '.join(ALL_SITES)}") from None


def resid_pre(layer: int) -> str:
    return site("resid_pre", layer)


def resid_mid(layer: int) -> str:
    return site("resid_mid", layer)


def resid_post(layer: int) -> str:
    return site("resid_post", layer)


def attn_in(layer: int) -> str:
    """Pre-attention RMSNorm output (after the gain): the WeMask site."""
    return site("attn_in", layer)


def attn_out(layer: int) -> str:
    return site("attn_out", layer)


def ffn_in(layer: int) -> str:
    """Pre-FFN RMSNorm output (after the gain)."""
    return site("ffn_in", layer)


def ffn_out(layer: int) -> str:
    return site("ffn_out", layer)


def pattern(layer: int) -> str:
    """Attention probabilities ``[batch, head, query_pos, key_pos]``."""
    return site("pattern", layer)
