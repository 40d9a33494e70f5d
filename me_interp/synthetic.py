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


def tiny_llama(n_layers: int = 4, seed: int = 0, add_bos: bool = True):
    """A randomly initialised (seeded) tiny Llama and its word tokenizer."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(_llama_config(n_layers)).eval()
    return hf, word_tokenizer(add_bos)


def tiny_qwen3(n_layers: int = 4, seed: int = 0, add_bos: bool = False):
    """A randomly initialised (seeded) tiny Qwen3 (q/k norms) and its word tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM(cfg).eval(), word_tokenizer(add_bos)


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


def planted_llama(
    layer: int = 2,
    n_layers: int = 5,
    plant: bool = True,
    seed: int = 0,
    gain: float = 8.0,
    down_scale: float = 10.0,
    add_bos: bool = True,
):
    """A tiny Llama with a massive activation planted at ``layer`` (see module docstring).

    Returns:
        ``(hf_model, tokenizer, plant)``; with ``plant=False`` the unplanted twin.
    """
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range for {n_layers} layers")
    from transformers import LlamaForCausalLM

    d_model, d_mlp = 32, 64
    cfg = _llama_config(n_layers, d_model, d_mlp)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    bias_dim, gain_dims, massive_dim, neuron, head = 0, (3, 11), 7, 5, 0
    protected = [bias_dim, *gain_dims, massive_dim]
    head_dim = cfg.head_dim
    slow = head_dim // 2 - 1  # the rotary pair with the lowest frequency: almost no rotation
    with torch.no_grad():
        emb = torch.randn(cfg.vocab_size, d_model, generator=gen)
        emb[:, protected] = 0.0
        emb[:, bias_dim] = 1.0
        emb[BOS_ID, list(gain_dims)] = 1.0
        hf.model.embed_tokens.weight.copy_(emb)
        for L, blk in enumerate(hf.model.layers):
            for norm in (blk.input_layernorm, blk.post_attention_layernorm):
                norm.weight.copy_(1.0 + 0.05 * torch.randn(d_model, generator=gen).abs())
            blk.self_attn.o_proj.weight[protected, :] = 0.0
            blk.mlp.down_proj.weight[protected, :] = 0.0
            # sink head: constant query, key reads the massive dim
            q, k = blk.self_attn.q_proj.weight, blk.self_attn.k_proj.weight
            q[head * head_dim : (head + 1) * head_dim, :] = 0.0
            k[head * head_dim : (head + 1) * head_dim, :] = 0.0
            q[head * head_dim + slow, bias_dim] = 2.0
            k[head * head_dim + slow, massive_dim] = 2.0
            if plant and L == layer:
                blk.post_attention_layernorm.weight[list(gain_dims)] = gain
                mlp = blk.mlp
                mlp.gate_proj.weight[neuron, :] = 0.0
                mlp.up_proj.weight[neuron, :] = 0.0
                mlp.down_proj.weight[:, neuron] = 0.0
                mlp.gate_proj.weight[neuron, list(gain_dims)] = 1.0
                mlp.up_proj.weight[neuron, list(gain_dims)] = 1.0
                mlp.down_proj.weight[massive_dim, neuron] = down_scale
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


def words(n: int, start: int = 0) -> str:
    """A prompt of ``n`` distinct words for the word tokenizer (``w{start} … ``)."""
    return " ".join(f"w{(start + i) % VOCAB_WORDS}" for i in range(n))


def planted_prompts(n: int = 6, length: int = 8) -> list[str]:
    """Prompts for the planted models, with different first words (and lengths)."""
    return [words(length - (i % 3), start=7 * i) for i in range(n)]
