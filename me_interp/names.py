"""The one place TransformerLens hook-name strings are built.

Sites of a pre-norm decoder block L (0-based), in forward order::

    resid_pre  = blocks.L.hook_resid_pre            x
    attn_in    = blocks.L.ln1.hook_out              RMSNorm_attn(x)  (after the gain)
    attn_out   = blocks.L.hook_attn_out             Attn(RMSNorm_attn(x))
    resid_mid  = blocks.L.hook_resid_mid            x' = x + attn_out
    ffn_in     = blocks.L.ln2.hook_out              RMSNorm_ffn(x')  (after the gain)
    ffn_out    = blocks.L.hook_mlp_out              FFN(RMSNorm_ffn(x'))
    resid_post = blocks.L.hook_resid_post           x' + ffn_out

Sandwich-norm blocks (Gemma 2/3) normalise each sub-layer's output before it joins the residual
stream; there ``attn_out`` / ``ffn_out`` are the *residual contributions* (after the post-norm, where
TransformerLens puts ``hook_attn_out`` / ``hook_mlp_out``), and the sub-layers' *own outputs* are::

    attn_own   = blocks.L.attn.hook_out             Attn(RMSNorm_attn(x))        (before the post-norm)
    ffn_own    = blocks.L.mlp.hook_out              FFN(RMSNorm_ffn(x'))         (before the post-norm)

On every other block ``attn_own`` is ``attn_out`` and ``ffn_own`` is ``ffn_out`` (the same tensor).
FFN magnification, ΔC at ``W_down`` and neuron shares read ``ffn_own``; interventions on what reaches
the residual stream edit ``ffn_out`` (:mod:`me_interp.architecture`).

``*.hook_normalized`` is the standardised vector ``h / rms(h)`` *before* the gain; ``*.hook_out`` is
after it. Inside the gated FFN: ``mlp.hook_pre`` = gate projection (pre-activation),
``mlp.hook_pre_linear`` = up projection, ``mlp.hook_post`` = act(gate) * up (input of W_down).

Aliases fire under their canonical name (``hook.name`` of ``hook_resid_post`` is ``blocks.L.hook_out``)
and some fire twice per forward, so hooks must not key on ``hook.name`` and must be idempotent.
"""

from __future__ import annotations

import functools

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
    "ffn_own": "mlp.hook_out",
    "attn_own": "attn.hook_out",
    "resid_post": "hook_resid_post",
    "pattern": "attn.hook_pattern",
    "attn_scores": "attn.hook_attn_scores",
    "q": "attn.hook_q",
    "k": "attn.hook_k",
    "v": "attn.hook_v",
    "z": "attn.hook_z",
}

ALL_SITES: tuple[str, ...] = tuple(_SITE_HOOKS)

OWN_SITES: tuple[str, ...] = ("attn_own", "ffn_own")
"""The sub-layers' own outputs; they differ from ``attn_out`` / ``ffn_out`` only on sandwich blocks."""
NORM_SITES: tuple[str, ...] = (*SITES, *OWN_SITES)
"""Every ``[batch, pos, d_model]`` site whose token norms a scan can record."""


@functools.lru_cache(maxsize=8192)
def site(name: str, layer: int) -> str:
    """Hook name of ``name`` (one of :data:`ALL_SITES`) in block ``layer`` (cached: every recorder
    asks for the same names on every forward)."""
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


def ffn_own(layer: int) -> str:
    """The FFN's own output, before any post-FFN norm (``mlp.hook_out``)."""
    return site("ffn_own", layer)


def pattern(layer: int) -> str:
    """Attention probabilities ``[batch, head, query_pos, key_pos]``."""
    return site("pattern", layer)
