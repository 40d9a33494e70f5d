"""Tiny models built from configs, and *planted-mechanism* models whose answer is known by construction.

These are for tests, teaching and sanity checks: they need no network and build in milliseconds.

``planted_llama()`` writes the weights of a tiny Llama so that layer ``P`` creates a massive activation
exactly as the paper describes (``paper.md`` §2): the sink token (the BOS token ``<s>``) carries a
marker on the *gain dims* ``G``; the pre-FFN RMSNorm of layer ``P`` has large gains on ``G``; one FFN
neuron ``n`` of layer ``P`` reads ``G`` through gate and up and writes ``c * silu(a s) * b s`` into the
*massive dim* ``D`` (``s = Σ_{i∈G} ĥ_i``), which the residual stream then carries unchanged (no later
component writes to ``D``). In every layer, attention head 0 has a query that reads a constant dim and
a key that reads ``D``, so an attention sink on the massive token appears downstream of ``P`` — caused
by the massive activation — and not before. The *unplanted twin* (``plant=False``) has the same weights
except the boosted gains and the planted neuron, and has no massive activation anywhere.

:func:`planted` does the same in every supported architecture (:data:`ARCHS`: Llama, Mistral, Qwen2 with
q/k/v biases, Qwen3 with q/k norms, Phi-3 with fused ``qkv_proj`` / ``gate_up_proj``, Gemma 1 with
``1 + w`` gains, ``sqrt(d_model)`` embedding scale and a GeGLU FFN (``gelu_pytorch_tanh`` gate) in a
Llama-style block, Gemma 2 and Gemma 3 with all of that plus sandwich norms). What it writes is stated
as *effective* values: a gain ``g`` is stored as ``g − offset`` with the offset measured on the norm module
(:func:`me_interp.architecture.measure_norm_offset`), embedding rows are divided by the measured
embedding scale (so the residual stream is the Llama one), fused projections are written through their
row blocks, and q/k norm gains are left at 1. On sandwich blocks the post-FFN norm would normalise the
planted neuron's write away, so its gain on the massive dim is ``post_gain`` (in every layer, planted
and twin alike: an architectural property, not the mechanism); the twin still has no massive
activation, because nothing but the planted neuron writes that dim.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

VOCAB_WORDS = 60
SPECIAL = ("<unk>", "<s>", "</s>", "<pad>")
BOS_ID, EOS_ID, PAD_ID = 1, 2, 3


def word_tokenizer(add_bos: bool = True):
    """A whitespace word-level tokenizer over ``<unk> <s> </s> <pad> w0 … w59`` (64 ids).

    ``add_bos=True`` makes it prepend ``<s>`` like Llama tokenizers; ``False`` like Qwen/SmolLM.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"w{i}": len(SPECIAL) + i for i in range(VOCAB_WORDS)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="right",
    )
    return tok


def vocab_size() -> int:
    return len(SPECIAL) + VOCAB_WORDS


def _llama_config(n_layers: int = 4, d_model: int = 32, d_mlp: int = 64, seed: int = 0):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size(),
        hidden_size=d_model,
        intermediate_size=d_mlp,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=d_model // 4,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attn_implementation="eager",
    )


ARCHS: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
)
"""The architectures :func:`tiny` and :func:`planted` build (HF config classes of that family)."""

#: Whether each family's tokenizer adds a BOS (Llama, Mistral, Phi-3, Gemma do; Qwen does not).
ARCH_ADDS_BOS = {a: not a.startswith("qwen") for a in ARCHS}


def tiny_config(arch: str, n_layers: int = 4, d_model: int = 32, d_mlp: int = 64):
    """A tiny HF config of ``arch`` (one of :data:`ARCHS`): 4 heads of 8 dims, 2 KV heads, eager."""
    import transformers as T

    if arch == "llama":
        return _llama_config(n_layers, d_model, d_mlp)
    classes = {
        "mistral": T.MistralConfig,
        "qwen2": T.Qwen2Config,
        "qwen3": T.Qwen3Config,
        "phi3": T.Phi3Config,
        "gemma": T.GemmaConfig,
        "gemma2": T.Gemma2Config,
        "gemma3": T.Gemma3TextConfig,
    }
    if arch not in classes:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    kw = dict(
        vocab_size=vocab_size(),
        hidden_size=d_model,
        intermediate_size=d_mlp,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch not in ("qwen2", "phi3"):  # those two derive head_dim = d_model / heads
        kw["head_dim"] = d_model // 4
    cfg = classes[arch](**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _model_class(cfg):
    import transformers as T

    name = {
        "LlamaConfig": "LlamaForCausalLM",
        "MistralConfig": "MistralForCausalLM",
        "Qwen2Config": "Qwen2ForCausalLM",
        "Qwen3Config": "Qwen3ForCausalLM",
        "Phi3Config": "Phi3ForCausalLM",
        "GemmaConfig": "GemmaForCausalLM",
        "Gemma2Config": "Gemma2ForCausalLM",
        "Gemma3TextConfig": "Gemma3ForCausalLM",
    }[type(cfg).__name__]
    return getattr(T, name)


def tiny(arch: str, n_layers: int = 4, seed: int = 0, add_bos: bool | None = None):
    """A randomly initialised (seeded) tiny model of ``arch`` (:data:`ARCHS`) and its word tokenizer
    (``add_bos`` defaults to the family's habit, :data:`ARCH_ADDS_BOS`)."""
    cfg = tiny_config(arch, n_layers)
    torch.manual_seed(seed)
    hf = _model_class(cfg)(cfg).eval()
    hf.config.architectures = [type(hf).__name__]
    return hf, word_tokenizer(ARCH_ADDS_BOS[arch] if add_bos is None else add_bos)


def tiny_llama(n_layers: int = 4, seed: int = 0, add_bos: bool = True):
    """A randomly initialised (seeded) tiny Llama and its word tokenizer."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(_llama_config(n_layers)).eval()
    return hf, word_tokenizer(add_bos)


def tiny_qwen3(n_layers: int = 4, seed: int = 0, add_bos: bool = False):
    """A randomly initialised (seeded) tiny Qwen3 (q/k norms) and its word tokenizer."""
    return tiny("qwen3", n_layers, seed, add_bos)


@dataclass(frozen=True)
class Plant:
    """What was planted, i.e. the right answer (0-based indices)."""

    layer: int
    gain_dims: tuple[int, ...]
    neuron: int
    massive_dim: int
    sink_token: int
    bias_dim: int
    sink_head: int
    gain: float
    gate_scale: float
    up_scale: float
    down_scale: float
    planted: bool

    def to_dict(self) -> dict:
        return asdict(self)


class _Layer:
    """Effective-value views of one HF decoder layer's weights, whatever the family stores."""

    def __init__(self, blk, cfg) -> None:
        from me_interp.architecture import measure_norm_offset

        self.blk, self.cfg = blk, cfg
        sandwich = hasattr(blk, "pre_feedforward_layernorm")
        self.attn_norm = blk.input_layernorm
        self.ffn_norm = blk.pre_feedforward_layernorm if sandwich else blk.post_attention_layernorm
        self.post_norms = (
            (blk.post_attention_layernorm, blk.post_feedforward_layernorm) if sandwich else ()
        )
        self.post_ffn_norm = blk.post_feedforward_layernorm if sandwich else None
        self.offset = measure_norm_offset(self.attn_norm)
        attn, mlp = blk.self_attn, blk.mlp
        hd = (
            cfg.hidden_size // cfg.num_attention_heads
            if not getattr(cfg, "head_dim", None)
            else cfg.head_dim
        )
        nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        if hasattr(attn, "qkv_proj"):
            w = attn.qkv_proj.weight
            self.q, self.k = w[:nq], w[nq : nq + nkv]
        else:
            self.q, self.k = attn.q_proj.weight, attn.k_proj.weight
        self.o = attn.o_proj.weight
        self.qk_norms = tuple(getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n))
        if hasattr(mlp, "gate_up_proj"):
            w = mlp.gate_up_proj.weight
            n = w.shape[0] // 2
            self.gate, self.up = w[:n], w[n:]
        else:
            self.gate, self.up = mlp.gate_proj.weight, mlp.up_proj.weight
        self.down = mlp.down_proj.weight
        self.head_dim = hd

    def set_gain(self, norm, value) -> None:
        """Make ``norm``'s effective gain ``value`` (stored as ``value − offset``)."""
        norm.weight.copy_(torch.as_tensor(value, dtype=norm.weight.dtype) - self.offset)

    def set_gain_dims(self, norm, dims, value: float) -> None:
        norm.weight[list(dims)] = value - self.offset


def planted(
    arch: str = "llama",
    layer: int = 2,
    n_layers: int = 5,
    plant: bool = True,
    seed: int = 0,
    gain: float = 8.0,
    down_scale: float = 10.0,
    add_bos: bool = True,
    post_gain: float = 400.0,
):
    """A tiny ``arch`` model with a massive activation planted at ``layer`` (see module docstring).

    Args:
        post_gain: the effective gain of every post-FFN norm on the massive dim (sandwich
            architectures only; ignored elsewhere).

    Returns:
        ``(hf_model, tokenizer, plant)``; with ``plant=False`` the unplanted twin.
    """
    from me_interp.architecture import measure_embed_scale

    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range for {n_layers} layers")
    d_model, d_mlp = 32, 64
    cfg = tiny_config(arch, n_layers, d_model, d_mlp)
    torch.manual_seed(seed)
    hf = _model_class(cfg)(cfg).eval()
    if arch != "llama":
        hf.config.architectures = [type(hf).__name__]
    gen = torch.Generator().manual_seed(seed + 1)
    bias_dim, gain_dims, massive_dim, neuron, head = 0, (3, 11), 7, 5, 0
    protected = [bias_dim, *gain_dims, massive_dim]
    with torch.no_grad():
        emb = torch.randn(cfg.vocab_size, d_model, generator=gen)
        emb[:, protected] = 0.0
        emb[:, bias_dim] = 1.0
        emb[BOS_ID, list(gain_dims)] = 1.0
        embedding = hf.get_input_embeddings()
        embedding.weight.copy_(emb / measure_embed_scale(embedding))
        for L, blk in enumerate(hf.model.layers):
            lay = _Layer(blk, cfg)
            head_dim = lay.head_dim
            slow = head_dim // 2 - 1  # the lowest-frequency rotary pair: almost no rotation
            for norm in (lay.attn_norm, lay.ffn_norm):
                lay.set_gain(norm, 1.0 + 0.05 * torch.randn(d_model, generator=gen).abs())
            for norm in lay.post_norms:
                lay.set_gain(norm, 1.0 + 0.05 * torch.randn(d_model, generator=gen).abs())
            if lay.post_ffn_norm is not None:
                lay.set_gain_dims(lay.post_ffn_norm, [massive_dim], post_gain)
            lay.o[protected, :] = 0.0
            lay.down[protected, :] = 0.0
            # sink head: constant query, key reads the massive dim
            q, k = lay.q, lay.k
            q[head * head_dim : (head + 1) * head_dim, :] = 0.0
            k[head * head_dim : (head + 1) * head_dim, :] = 0.0
            # the same sink score as in Llama (scale head_dim^-1/2) under the family's own attention
            # scale (Gemma: query_pre_attn_scalar^-1/2) and q/k norms (whose slow-dim gain is set so
            # that the normalised q·k equals Llama's 2 · 2 · sqrt(d_model) on the massive token)
            scaling = getattr(cfg, "query_pre_attn_scalar", None) or head_dim
            q[head * head_dim + slow, bias_dim] = 2.0 * (scaling / head_dim) ** 0.5
            k[head * head_dim + slow, massive_dim] = 2.0
            for qk_norm in lay.qk_norms:
                g = torch.ones(head_dim)
                g[slow] = (4.0 * d_model**0.5 * scaling**0.5 / head_dim**1.5) ** 0.5
                lay.set_gain(qk_norm, g)
            if plant and L == layer:
                lay.set_gain_dims(lay.ffn_norm, gain_dims, gain)
                lay.gate[neuron, :] = 0.0
                lay.up[neuron, :] = 0.0
                lay.down[:, neuron] = 0.0
                lay.gate[neuron, list(gain_dims)] = 1.0
                lay.up[neuron, list(gain_dims)] = 1.0
                lay.down[massive_dim, neuron] = down_scale
    info = Plant(
        layer=layer,
        gain_dims=gain_dims,
        neuron=neuron,
        massive_dim=massive_dim,
        sink_token=BOS_ID,
        bias_dim=bias_dim,
        sink_head=head,
        gain=gain,
        gate_scale=1.0,
        up_scale=1.0,
        down_scale=down_scale,
        planted=plant,
    )
    return hf, word_tokenizer(add_bos), info


def planted_llama(
    layer: int = 2,
    n_layers: int = 5,
    plant: bool = True,
    seed: int = 0,
    gain: float = 8.0,
    down_scale: float = 10.0,
    add_bos: bool = True,
):
    """:func:`planted` in a tiny Llama: ``(hf_model, tokenizer, plant)``."""
    return planted("llama", layer, n_layers, plant, seed, gain, down_scale, add_bos)


def words(n: int, start: int = 0) -> str:
    """A prompt of ``n`` distinct words for the word tokenizer (``w{start} … ``)."""
    return " ".join(f"w{(start + i) % VOCAB_WORDS}" for i in range(n))


def planted_prompts(n: int = 6, length: int = 8) -> list[str]:
    """Prompts for the planted models, with different first words (and lengths)."""
    return [words(length - (i % 3), start=7 * i) for i in range(n)]
