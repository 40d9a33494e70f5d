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

import math
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
        layers: HF path of the list of decoder layers (``model.layers``).
        attn: HF name (within a decoder layer) of the attention (``self_attn``).
        ffn: HF name of the FFN (``mlp``).
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
    layers: str
    attn: str
    ffn: str

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
# the description: of a booted bridge, or of a plain HF model through the bridge's mapping
# ------------------------------------------------------------------------------------------


def _param_ids(module: torch.nn.Module | None) -> set[int]:
    return set() if module is None else {id(p) for p in module.parameters()}


class _Blocks:
    """What :func:`_describe` reads of the decoder blocks, whichever way they were reached.

    ``block(i)`` is TransformerLens's component of decoder block ``i`` (its parts ``ln1``, ``ln2``,
    ``ln1_post``, ``ln2_post``, ``attn``, ``mlp`` and theirs, each with the HF ``name`` it stands
    for); ``module(comp, hf_parent)`` the HF module a part stands for. A booted bridge's components
    wrap their HF modules (``original_component``); the adapter's template of a block only names
    them, so they are looked up by name in the plain HF decoder layers."""

    def __init__(self, blocks: list, hf_layers: list | None, path: str) -> None:
        self.blocks, self.hf_layers, self.path = blocks, hf_layers, path

    def __len__(self) -> int:
        return len(self.hf_layers) if self.hf_layers is not None else len(self.blocks)

    def block(self, i: int) -> Any:
        return self.blocks[0] if self.hf_layers is not None else self.blocks[i]

    def part(self, comp: Any, name: str) -> Any:
        if comp is None:
            return None
        if self.hf_layers is not None:  # a template: its parts are in ``submodules`` only
            return (getattr(comp, "submodules", None) or {}).get(name)
        return getattr(comp, name, None)

    def module(self, comp: Any, hf_parent: Any) -> torch.nn.Module | None:
        if comp is None:
            return None
        if self.hf_layers is None:
            return comp.original_component
        return None if hf_parent is None else getattr(hf_parent, comp.name, None)

    def layer(self, i: int) -> Any:
        """The HF decoder layer ``i`` (``None`` for a booted bridge: its parts hold the modules)."""
        return None if self.hf_layers is None else self.hf_layers[i]


def describe(bridge: Any, hf: Any) -> Architecture:
    """The :class:`Architecture` of a booted TransformerBridge (``hf``: the HF model behind it).

    Raises:
        ArchitectureError: the model is not supported; ``problems`` lists every reason.
    """
    blocks = getattr(bridge, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ArchitectureError(["no decoder blocks"])
    path = str(blocks[0].name).rsplit(".", 1)[0]  # "model.layers.0" -> "model.layers"
    act_fn = str(getattr(bridge.cfg, "act_fn", "") or "")
    return _describe(_Blocks(list(blocks), None, path), hf, act_fn)


def describe_hf(hf: Any) -> Architecture:
    """The :class:`Architecture` of a *plain* HF causal LM, without booting a bridge: the same
    description from the same per-family facts, the component mapping of the TransformerLens
    architecture adapter that :func:`describe`'s bridge is booted with (chosen from ``hf.config``),
    its parts looked up by name in ``hf``'s decoder layers. Works on a meta model (weights not
    loaded, as nnsight's remote models): the norms' gain convention is then the adapter's declared
    one and ``embed_scale`` is NaN (not measured).

    Raises:
        ArchitectureError: TransformerLens has no adapter for the model, or the model is not
            supported; ``problems`` lists every reason.
    """
    import copy

    from transformer_lens.factories.architecture_adapter_factory import (
        ArchitectureAdapterFactory,
    )
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_config_from_hf
    from transformer_lens.model_bridge.sources.transformers import (
        determine_architecture_from_hf_config,
    )

    family = type(hf).__name__
    config = copy.deepcopy(hf.config)
    if not getattr(config, "architectures", None):
        config.architectures = [family]
    try:
        kind = determine_architecture_from_hf_config(config)
        name = str(getattr(config, "_name_or_path", "") or family)
        dtype = getattr(hf, "dtype", None) or torch.float32
        bridge_cfg = build_bridge_config_from_hf(config, kind, name, dtype)
        adapter = ArchitectureAdapterFactory.select_architecture_adapter(bridge_cfg)
        template = adapter.get_component_mapping()["blocks"]
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ArchitectureError(
            [f"TransformerLens has no mapping of {family} ({str(e).splitlines()[0][:200]})"]
        ) from None
    path = str(template.name)
    layers = hf.get_submodule(path) if path else None
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ArchitectureError([f"no decoder layers at {path!r}"])
    act_fn = str(getattr(bridge_cfg, "act_fn", "") or "")
    return _describe(_Blocks([template], list(layers), path), hf, act_fn)


def _describe(blocks: _Blocks, hf: Any, act_fn: str) -> Architecture:
    """The :class:`Architecture` from the decoder blocks (see :class:`_Blocks`): every check and
    every fact, once for both ways of reaching them."""
    from transformer_lens.model_bridge.generalized_components import MoEBridge

    family = type(hf).__name__
    b0, layer0 = blocks.block(0), blocks.layer(0)
    part = blocks.part
    problems: list[str] = []
    if part(b0, "ln2") is None:
        what = "it normalises the sub-layer outputs only (post-norm, OLMo-2 style)"
        problems.append(
            f"no pre-FFN norm: {what}" if part(b0, "ln2_post") is not None else "no pre-FFN norm"
        )
    if part(b0, "ln1") is None:
        problems.append("no pre-attention norm")
    for p in ("attn", "mlp"):
        if part(b0, p) is None:
            problems.append(f"no {p}")
        elif blocks.module(part(b0, p), layer0) is None:
            problems.append(f"no HF module {part(b0, p).name!r} ({p})")
    for p in ("ln1", "ln2"):
        if part(b0, p) is not None:
            norm = blocks.module(part(b0, p), layer0)
            if norm is None:
                problems.append(f"no HF module {part(b0, p).name!r} ({p})")
            elif not type(norm).__name__.lower().endswith("rmsnorm"):
                problems.append(f"{p} is {type(norm).__name__}, not RMSNorm")
    mlp = part(b0, "mlp")
    if isinstance(mlp, MoEBridge):
        problems.append("the FFN is a mixture of experts (MoE), not one gated FFN")
    elif mlp is not None and not all(part(mlp, p) is not None for p in ("gate", "in", "out")):
        problems.append("FFN is not gated (no separate gate / up / down projections)")
    if problems:
        raise ArchitectureError(problems)

    offsets = set()
    for i in range(len(blocks)):
        blk, layer = blocks.block(i), blocks.layer(i)
        for n in ("ln1", "ln2", "ln1_post", "ln2_post"):
            comp = part(blk, n)
            if comp is None:
                continue
            declared = float(bool(getattr(comp, "uses_weight_offset", False)))
            module = blocks.module(comp, layer)
            if module is None:
                raise ArchitectureError([f"layer {i} has no HF module {comp.name!r} ({n})"])
            if module.weight.device.type == "meta":  # offloaded or not loaded: trust TL
                offsets.add(declared)
                continue
            measured = measure_norm_offset(module)
            if declared != measured:
                where = comp.name if blocks.hf_layers is None else f"{blocks.path}.{i}.{comp.name}"
                raise ArchitectureError(
                    [
                        f"the bridge scales {where} by {'1 + w' if declared else 'w'} but "
                        f"the HF module scales by {'1 + w' if measured else 'w'}"
                    ]
                )
            offsets.add(measured)
    if len(offsets) != 1:
        raise ArchitectureError([f"the norms mix gain conventions (offsets {sorted(offsets)})"])

    attn = part(b0, "attn")
    hf_attn, hf_mlp = blocks.module(attn, layer0), blocks.module(mlp, layer0)
    qkv = part(attn, "qkv")
    q_lin = blocks.module(part(attn, "q"), hf_attn)
    fused_qkv = qkv is not None or (
        part(attn, "q") is not None
        and not (q_lin is not None and _param_ids(q_lin) <= _param_ids(hf_attn))
    )
    gate = blocks.module(part(mlp, "gate"), hf_mlp)
    fused_gate_up = gate is None or id(gate.weight) not in _param_ids(hf_mlp)
    qkv_lin = blocks.module(qkv, hf_attn) or q_lin
    qkv_bias = qkv_lin is not None and getattr(qkv_lin, "bias", None) is not None
    emb = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    if emb is None:
        embed_scale = 1.0
    elif emb.weight.device.type == "meta":
        embed_scale = math.nan
    else:
        embed_scale = measure_embed_scale(emb)
    post_attn, post_ffn = part(b0, "ln1_post"), part(b0, "ln2_post")
    return Architecture(
        family=family,
        norm_offset=offsets.pop(),
        attn_norm=part(b0, "ln1").name,
        ffn_norm=part(b0, "ln2").name,
        post_attn_norm=post_attn.name if post_attn is not None else None,
        post_ffn_norm=post_ffn.name if post_ffn is not None else None,
        fused_qkv=bool(fused_qkv),
        fused_gate_up=bool(fused_gate_up),
        qkv_bias=bool(qkv_bias),
        qk_norm=part(attn, "q_norm") is not None and part(attn, "k_norm") is not None,
        embed_scale=embed_scale,
        act_fn=act_fn,
        layers=blocks.path,
        attn=attn.name,
        ffn=mlp.name,
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
    "describe_hf",
    "hf_attn_norm",
    "measure_embed_scale",
    "measure_norm_offset",
    "norm_eps",
]
