"""Fixtures for the intervention tests: a hand-written Llama forward and plain HF copies."""

from __future__ import annotations

import math

import pytest
import torch


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    # x [B H T hd], HF "rotate_half" convention
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos[:, None].float() * inv[None, :]  # [T hd/2]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    rot = torch.cat([-x2, x1], -1)
    return x * cos + rot * sin


def reference_forward(hf, tokens, attn_gain_override=None):
    """Llama forward written by hand (no padding). ``attn_gain_override[layer] = (positions, gain)``
    replaces the pre-attention RMSNorm gain of ``layer`` for the tokens at ``positions`` only."""
    cfg = hf.config
    attn_gain_override = attn_gain_override or {}
    B, T = tokens.shape
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.head_dim
    eps = cfg.rms_norm_eps
    theta = (
        cfg.rope_parameters["rope_theta"]
        if hasattr(cfg, "rope_parameters") and cfg.rope_parameters
        else cfg.rope_theta
    )
    pos = torch.arange(T)
    with torch.no_grad():
        x = hf.model.embed_tokens.weight[tokens]
        causal = torch.full((T, T), float("-inf")).triu(1)
        for L, blk in enumerate(hf.model.layers):
            w = blk.input_layernorm.weight
            a_in = _rms(x, w, eps)
            if L in attn_gain_override:
                ps, g = attn_gain_override[L]
                for p in ps:
                    a_in[:, p] = _rms(x[:, p], g, eps)
            at = blk.self_attn
            q = (a_in @ at.q_proj.weight.T).view(B, T, H, hd).transpose(1, 2)
            k = (a_in @ at.k_proj.weight.T).view(B, T, KV, hd).transpose(1, 2)
            v = (a_in @ at.v_proj.weight.T).view(B, T, KV, hd).transpose(1, 2)
            q, k = _rope(q, pos, theta), _rope(k, pos, theta)
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            s = q @ k.transpose(-1, -2) / math.sqrt(hd) + causal
            o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * hd)
            x = x + o @ at.o_proj.weight.T
            f_in = _rms(x, blk.post_attention_layernorm.weight, eps)
            mlp = blk.mlp
            act = torch.nn.functional.silu(f_in @ mlp.gate_proj.weight.T) * (
                f_in @ mlp.up_proj.weight.T
            )
            x = x + act @ mlp.down_proj.weight.T
        x = _rms(x, hf.model.norm.weight, eps)
        return x @ hf.lm_head.weight.T


@pytest.fixture(scope="session")
def ref_forward():
    return reference_forward


@pytest.fixture(scope="session")
def plain_planted():
    """A plain (not bridge-wrapped) HF copy of the planted model and its tokenizer."""
    from me_interp import synthetic

    hf, tok, plant = synthetic.planted_llama()
    return hf.eval(), tok, plant


@pytest.fixture(scope="session")
def plain_tiny():
    from me_interp import synthetic

    hf, tok = synthetic.tiny_llama()
    return hf.eval(), tok


@pytest.fixture(scope="session")
def plain_bundled():
    from me_interp.interventions import load_hf

    return load_hf()
