"""One description of a loaded model's architecture, so no other module branches on a model family.

Everything me_interp needs to know that differs between the supported families is read once, when a
model is loaded, from the TransformerBridge's own config and component tree (never from a list of
model names) and kept in a frozen :class:`Architecture`:

* **the norm gain convention** — an RMSNorm computes ``RMSNorm(h) = h / sqrt(mean(h²) + eps) ⊙ g``
  with the *effective gain* ``g``. Llama, Qwen, Mistral and Phi-3 store ``g`` itself (``offset = 0``);
  Gemma 1/2/3 store ``w = g − 1`` and compute ``h / rms(h) ⊙ (1 + w)`` (``offset = 1``; TransformerLens
  records it as ``cfg.rmsnorm_uses_offset``, its norm bridges as ``uses_weight_offset``). The offset is
  also *measured* on the HF norm module (:func:`measure_norm_offset`) and the two must agree, so a
  model whose bridge and HF code disagree is refused instead of computing wrong numbers. Probes read
  ``g`` (:meth:`Architecture.gain`); edits that set an effective gain ``g`` write ``g − offset``
  (:meth:`Architecture.weight`).
* **which norm feeds which sub-layer** — the HF names of the pre-attention and pre-FFN norms
  (``input_layernorm``; ``post_attention_layernorm`` in Llama-style blocks, ``pre_feedforward_layernorm``
  in Gemma 2/3) and of the *sandwich* post-norms (Gemma 2/3: ``post_attention_layernorm`` normalises
  the attention output, ``post_feedforward_layernorm`` the FFN output, before they join the residual).
* **where the FFN's own output is read** — on a sandwich block ``blocks.L.hook_mlp_out`` (site
  ``ffn_out``) is the FFN's *residual contribution*, after the post-FFN norm; the FFN's *own output*
  ``W_down(σ(W_gate ĥ) ⊙ W_up ĥ)`` is ``blocks.L.mlp.hook_out`` (site ``ffn_own``). On other blocks
  the two are one tensor. FFN magnification, ΔC at ``W_down`` and neuron shares are measured on the
  FFN's own output (:attr:`Architecture.ffn_own_site`).
* **fused projections** — Phi-3 stores ``qkv_proj`` and ``gate_up_proj``; the bridge splits them into
  views that share the fused parameter's storage, so :meth:`LoadedModel.ffn_weights` edits write the
  fused HF weight too.
* the embedding scale (Gemma multiplies token embeddings by ``sqrt(d_model)``), measured on the HF
  embedding module, and whether attention has q/k norms or q/k/v biases (reported, not branched on).

Refused, with the reason (:class:`ArchitectureError`): post-norm blocks without a pre-FFN norm
(OLMo-2), LayerNorm (GPT-2), mixture-of-experts FFNs, and FFNs that are not gated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

#: Site (``me_interp.names``) of the FFN's own output ``W_down(σ(W_gate ĥ) ⊙ W_up ĥ)``.
FFN_OWN_SITE = "ffn_own"
#: Site of the FFN's contribution to the residual stream (after a post-FFN norm, if any).
FFN_RESIDUAL_SITE = "ffn_out"
#: Site of the attention's own output (before a post-attention norm, if any).
ATTN_OWN_SITE = "attn_own"
#: Site of the attention's contribution to the residual stream.
ATTN_RESIDUAL_SITE = "attn_out"

NORM_OFFSETS = (0.0, 1.0)
"""The stored-weight conventions met so far: ``g = w`` and ``g = 1 + w``."""


class ArchitectureError(ValueError):
    """The model is not a pre-norm decoder with RMSNorm and a gated FFN; ``problems`` says why."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class Architecture:
    """What differs between model families, for one loaded model (see the module docstring).

    Attributes:
        family: the HF model class (for display only; nothing branches on it).
        norm_offset: ``0.0`` (the gain is the stored weight) or ``1.0`` (the gain is ``1 + w``).
        attn_norm: HF name (within a decoder layer) of the pre-attention RMSNorm.
        ffn_norm: HF name of the pre-FFN RMSNorm.
        post_attn_norm: HF name of the norm applied to the attention output, or ``None``.
        post_ffn_norm: HF name of the norm applied to the FFN output, or ``None``.
        fused_qkv: Q, K and V are one HF projection (``qkv_proj``).
        fused_gate_up: gate and up are one HF projection (``gate_up_proj``).
        qkv_bias: the Q/K/V projections have biases (Qwen2).
        qk_norm: attention has per-head q/k RMSNorms (Qwen3, Gemma 3).
        embed_scale: what the embedding module multiplies the embedding rows by (``sqrt(d_model)`` on
            Gemma, 1 elsewhere), measured.
        act_fn: the FFN activation named by the bridge config (``silu``, ``gelu_pytorch_tanh``, …).
    """

    family: str
    norm_offset: float
    attn_norm: str
    ffn_norm: str
    post_attn_norm: str | None
    post_ffn_norm: str | None
    fused_qkv: bool
    fused_gate_up: bool
    qkv_bias: bool
    qk_norm: bool
    embed_scale: float
    act_fn: str

    def __post_init__(self) -> None:
        if self.norm_offset not in NORM_OFFSETS:
            raise ValueError(f"norm_offset must be one of {NORM_OFFSETS}, got {self.norm_offset}")

    # -- gains ---------------------------------------------------------------------------------
    def gain(self, weight: torch.Tensor) -> torch.Tensor:
        """The effective gain ``g = w + offset`` of a stored norm weight ``w``: a new detached
        tensor on every family (never a view of the parameter), so a gain read before an edit is
        the gain before it whatever the offset."""
        return weight.detach() + self.norm_offset

    def weight(self, gain: torch.Tensor) -> torch.Tensor:
        """The stored weight ``w = g − offset`` that makes the effective gain ``gain`` (a new tensor)."""
        return gain.detach() - self.norm_offset

    # -- sites ---------------------------------------------------------------------------------
    @property
    def sandwich(self) -> bool:
        """Whether the FFN or the attention output is normalised before it joins the residual."""
        return self.post_ffn_norm is not None or self.post_attn_norm is not None

    @property
    def ffn_own_site(self) -> str:
        """Site of the FFN's own output (before any post-FFN norm): magnification, ΔC, neurons."""
        return FFN_OWN_SITE

    @property
    def ffn_residual_site(self) -> str:
        """Site of the FFN's residual contribution (after any post-FFN norm)."""
        return FFN_RESIDUAL_SITE

    def own_sites(self) -> tuple[str, ...]:
        """The extra sites that differ from their residual-contribution site on this model:
        ``ffn_own`` with a post-FFN norm, ``attn_own`` with a post-attention norm."""
        out = []
        if self.post_attn_norm is not None:
            out.append(ATTN_OWN_SITE)
        if self.post_ffn_norm is not None:
            out.append(FFN_OWN_SITE)
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["sandwich"] = self.sandwich
        d["ffn_own_site"] = self.ffn_own_site
        d["ffn_residual_site"] = self.ffn_residual_site
        return d


# ------------------------------------------------------------------------------------------
# measurements on HF modules (usable without a bridge)
# ------------------------------------------------------------------------------------------


def norm_eps(module: torch.nn.Module) -> float:
    """The ``eps`` of an HF RMSNorm module (``variance_epsilon`` in Llama-style code, ``eps`` in Gemma)."""
    for attr in ("variance_epsilon", "eps"):
        v = getattr(module, attr, None)
        if v is not None:
            return float(v)
    raise ArchitectureError([f"{type(module).__name__} has no eps / variance_epsilon"])


def measure_norm_offset(module: torch.nn.Module) -> float:
    """Whether the HF RMSNorm ``module`` scales by ``w`` (0.0) or by ``1 + w`` (1.0), measured.

    Runs the module on a fixed vector ``x`` and compares its output with ``x / rms(x) ⊙ (w + c)`` for
    each ``c`` in :data:`NORM_OFFSETS` (computed in float64); returns the ``c`` that reproduces it.

    Raises:
        ArchitectureError: neither convention reproduces the module's output (not an RMSNorm).
    """
    w = getattr(module, "weight", None)
    if w is None or w.dim() != 1:
        raise ArchitectureError([f"{type(module).__name__} has no 1-d gain weight"])
    if w.device.type == "meta":
        raise ArchitectureError([f"{type(module).__name__} has its weights on the meta device"])
    d = w.shape[0]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 1, d, generator=gen, dtype=torch.float64) + 0.5).to(w.device, w.dtype)
    with torch.no_grad():
        y = module(x).double().flatten()
    xd = x.double().flatten()
    hat = xd / torch.sqrt((xd**2).mean() + norm_eps(module))
    wd = w.detach().double()
    errs = {c: float((y - hat * (wd + c)).abs().max()) for c in NORM_OFFSETS}
    best = min(errs, key=errs.get)
    scale = float(y.abs().max()) or 1.0
    tol = 1e-4 if w.dtype == torch.float32 else 5e-2
    if errs[best] > tol * scale:
        raise ArchitectureError(
            [
                f"{type(module).__name__} is not an RMSNorm with gain w or 1 + w "
                f"(max error {errs[best]:.3g} relative to output {scale:.3g})"
            ]
        )
    return best


def measure_embed_scale(embedding: torch.nn.Module) -> float:
    """What the HF embedding module multiplies its weight rows by (``sqrt(d_model)`` on Gemma)."""
    w = embedding.weight
    ids = torch.arange(min(8, w.shape[0]), device=w.device)
    with torch.no_grad():
        out = embedding(ids).double()
    rows = w.detach()[ids].double()
    keep = rows.abs() > 1e-6
    if not bool(keep.any()):
        return 1.0
    return float((out[keep] / rows[keep]).median())


#: The HF name of the pre-attention RMSNorm in the decoder layer of every supported family (Llama,
#: Mistral, Qwen2/3, Phi-3, Gemma 1/2/3); what the bridge's ``ln1`` wraps (``Architecture.attn_norm``).
HF_ATTN_NORM = "input_layernorm"


def hf_attn_norm(layer: torch.nn.Module) -> torch.nn.Module:
    """The pre-attention RMSNorm of a *plain* HF decoder layer (no bridge to ask; for a
    ``LoadedModel`` use ``model.attn_norm_module(L)``).

    Raises:
        ArchitectureError: the layer has no :data:`HF_ATTN_NORM` module (not a supported pre-norm
            decoder layer).
    """
    norm = getattr(layer, HF_ATTN_NORM, None)
    if not isinstance(norm, torch.nn.Module):
        raise ArchitectureError(
            [f"{type(layer).__name__} has no pre-attention norm ({HF_ATTN_NORM})"]
        )
    return norm


# ------------------------------------------------------------------------------------------
# the description, from a bridge
# ------------------------------------------------------------------------------------------


def _param_ids(module: torch.nn.Module) -> set[int]:
    return {id(p) for p in module.parameters()}


def describe(bridge: Any, hf: Any) -> Architecture:
    """The :class:`Architecture` of a booted TransformerBridge (``hf``: the HF model behind it).

    Raises:
        ArchitectureError: the model is not supported; ``problems`` lists every reason.
    """
    from transformer_lens.model_bridge.generalized_components import MoEBridge

    family = type(hf).__name__
    blocks = getattr(bridge, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ArchitectureError(["no decoder blocks"])
    b0 = blocks[0]
    problems: list[str] = []
    if not hasattr(b0, "ln2"):
        what = "it normalises the sub-layer outputs only (post-norm, OLMo-2 style)"
        problems.append(
            f"no pre-FFN norm: {what}" if hasattr(b0, "ln2_post") else "no pre-FFN norm"
        )
    if not hasattr(b0, "ln1"):
        problems.append("no pre-attention norm")
    for part in ("attn", "mlp"):
        if not hasattr(b0, part):
            problems.append(f"no {part}")
    for part in ("ln1", "ln2"):
        if hasattr(b0, part):
            norm = getattr(b0, part).original_component
            if not type(norm).__name__.lower().endswith("rmsnorm"):
                problems.append(f"{part} is {type(norm).__name__}, not RMSNorm")
    mlp = getattr(b0, "mlp", None)
    if isinstance(mlp, MoEBridge):
        problems.append("the FFN is a mixture of experts (MoE), not one gated FFN")
    elif mlp is not None and not (
        hasattr(mlp, "gate") and hasattr(mlp, "in") and hasattr(mlp, "out")
    ):
        problems.append("FFN is not gated (no separate gate / up / down projections)")
    if problems:
        raise ArchitectureError(problems)

    offsets = set()
    names = ("ln1", "ln2", "ln1_post", "ln2_post")
    for blk in blocks:
        for n in names:
            if hasattr(blk, n):
                comp = getattr(blk, n)
                declared = float(bool(getattr(comp, "uses_weight_offset", False)))
                if comp.original_component.weight.device.type == "meta":  # offloaded: trust TL
                    offsets.add(declared)
                    continue
                measured = measure_norm_offset(comp.original_component)
                if declared != measured:
                    raise ArchitectureError(
                        [
                            f"the bridge scales {comp.name} by {'1 + w' if declared else 'w'} but "
                            f"the HF module scales by {'1 + w' if measured else 'w'}"
                        ]
                    )
                offsets.add(measured)
    if len(offsets) != 1:
        raise ArchitectureError([f"the norms mix gain conventions (offsets {sorted(offsets)})"])

    attn = b0.attn
    hf_attn, hf_mlp = attn.original_component, mlp.original_component
    q = getattr(attn, "q", None)
    q_lin = getattr(q, "original_component", None) if q is not None else None
    fused_qkv = hasattr(attn, "qkv") or (
        q_lin is not None and not (_param_ids(q_lin) <= _param_ids(hf_attn))
    )
    gate_w = mlp.gate.original_component.weight
    fused_gate_up = id(gate_w) not in _param_ids(hf_mlp)
    qkv_lin = getattr(getattr(attn, "qkv", None), "original_component", None) or q_lin
    qkv_bias = qkv_lin is not None and getattr(qkv_lin, "bias", None) is not None
    emb = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    return Architecture(
        family=family,
        norm_offset=offsets.pop(),
        attn_norm=b0.ln1.name,
        ffn_norm=b0.ln2.name,
        post_attn_norm=b0.ln1_post.name if hasattr(b0, "ln1_post") else None,
        post_ffn_norm=b0.ln2_post.name if hasattr(b0, "ln2_post") else None,
        fused_qkv=bool(fused_qkv),
        fused_gate_up=bool(fused_gate_up),
        qkv_bias=bool(qkv_bias),
        qk_norm=hasattr(attn, "q_norm") and hasattr(attn, "k_norm"),
        embed_scale=measure_embed_scale(emb) if emb is not None else 1.0,
        act_fn=str(getattr(bridge.cfg, "act_fn", "") or ""),
    )


__all__ = [
    "ATTN_OWN_SITE",
    "ATTN_RESIDUAL_SITE",
    "Architecture",
    "ArchitectureError",
    "FFN_OWN_SITE",
    "FFN_RESIDUAL_SITE",
    "HF_ATTN_NORM",
    "NORM_OFFSETS",
    "describe",
    "hf_attn_norm",
    "measure_embed_scale",
    "measure_norm_offset",
    "norm_eps",
]
