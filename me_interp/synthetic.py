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

**Deep models.** :func:`planted_deep` (:data:`DEEP`: ``synthetic:planted-deep``, ``twin-deep``,
``planted-deep-late``) are 8-layer planted Llamas (BOS, like ``synthetic:planted``), planted at layer
2 or 6, so claims judged k of n over partner layers (weight swaps, weight patching, the weights ×
input cross) have at least 6 partners and can be decided.

**No shared BOS.** With ``<s>`` at position 0, token 0's state is the same in every prompt (a causal
model), so any token-0 statistic is one measurement. :func:`planted` takes ``marked`` (the token ids
that carry the marker) and ``marker_dims``: :func:`planted_nobos` (``synthetic:planted-nobos``) has
a tokenizer without BOS and the marker on the *starter* words :data:`STARTER_IDS`, and
:func:`distinct_first_prompts` opens every prompt with a different starter (and puts the delimiter
word :data:`DELIMITER_ID` at position 2), so token 0 differs in every prompt.

**Decoys.** :func:`decoy` (``synthetic:decoy-<kind>``, :data:`DECOYS`) builds, on the twin of
:func:`planted_nobos`, a massive activation made *the wrong way*, for claims to fail on: written by an
attention head's OV circuit (``attention``), present from the embedding (``embedding``), grown ×3
per layer over six layers (``gradual``), made by the FFN from dims the pre-FFN gain does not boost
(``offgain``), an attention sink with no massive activation (``sinkonly``), a massive activation
at the delimiter, position 2 (``later``), or one made as planted and erased two layers later by an FFN
that writes minus it (``erased``). Each returns a :class:`Decoy` record of what was built.

**Deep decoys.** :func:`decoy_deep` (``synthetic:decoy-<kind>-deep``, :data:`DEEP_DECOYS`) are
8-layer decoys without BOS, made at layer 6, for the weight claims judged k of n over partner
layers: written by attention (``attention-deep``); by the FFN alone, from dims of ordinary gain
(``offgain-deep``); by the pre-FFN gain alone, with the same neuron in every FFN (``gainonly-deep``);
by the pre-attention gain alone, with the same head in every layer (``attngain-deep``); as planted,
but with the marker written by layer 5's FFN, so earlier inputs lack it (``depthinput-deep``).

**Decoys for the causal and sink claims.** :func:`causal_decoy` (:data:`CAUSAL_DECOYS`, also
through :func:`decoy`) changes one part of :func:`planted_nobos`: a later FFN rewrites the massive
activation (``rewritten``, :func:`add_late_writer`); the sink head copies one large vector into every
other token, which collapse (``collapse``); the massive value's sign depends on the first word
(``varying``); the sink heads' key reads the marker, not the massive dim (``sinkapart``); token 0
starts at −7 % of the massive value, so the ME layer's FFN output is 107 % of the state, not the
state itself, and removing it removes the activation (``primed``; with the sink apart:
``primedapart``).

**Beyond the first token.** ``synthetic:planted`` and ``synthetic:decoy-later`` carry a chat template
(:data:`CHAT_TEMPLATE`, opening with ``<s>``: massive in the first, ordinary in the second);
:func:`planted_washout` (``synthetic:planted-washout``) is planted with a head whose writes on the
other tokens grow as BOS's share of its attention falls with length, so that BOS is no longer
massive at 1,024 tokens (its own state unchanged: the other tokens rise to it).

**A language model that needs its sink.** The planted model's language model is random, so no
WeMask changes its perplexity. :func:`planted_needsink` (:data:`NEEDSINK`:
``synthetic:planted-needsink``, ``planted-needsink-wide``, ``planted-needsink-mild``) gives it a
bigram unembedding and a sink head that scrambles the prediction when it loses the sink, with the
massive dim's pre-attention gain below (``needsink``) or above (``wide``, ``mild``) the others, so the
weight-guided WeMask misses or takes the dim the sink needs; :func:`word_texts` and
:func:`word_mc_items` are texts and MC items in the word vocabulary that it predicts.
"""

from __future__ import annotations

import inspect
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
        max_position_embeddings=1024,
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
        max_position_embeddings=1024,
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
    marked_tokens: tuple[int, ...] = (BOS_ID,)

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
            self.q, self.k, self.v = w[:nq], w[nq : nq + nkv], w[nq + nkv :]
        else:
            self.q, self.k, self.v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
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
    *,
    marked: tuple[int, ...] = (BOS_ID,),
    marker_dims: tuple[int, ...] | None = None,
):
    """A tiny ``arch`` model with a massive activation planted at ``layer`` (see module docstring).

    Args:
        post_gain: the effective gain of every post-FFN norm on the massive dim (sandwich
            architectures only; ignored elsewhere).
        marked: the token ids whose embedding carries the marker (``<s>``; :data:`STARTER_IDS`
            for a model without BOS, :data:`DELIMITER_ID` for a later position).
        marker_dims: the dims the marker is on (default: the gain dims); like them, zero in every
            other token's embedding and written by no component.

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
    marker_dims = gain_dims if marker_dims is None else tuple(marker_dims)
    protected = list(dict.fromkeys([bias_dim, *gain_dims, *marker_dims, massive_dim]))
    with torch.no_grad():
        emb = torch.randn(cfg.vocab_size, d_model, generator=gen)
        emb[:, protected] = 0.0
        emb[:, bias_dim] = 1.0
        emb[torch.tensor(marked)[:, None], torch.tensor(marker_dims)] = 1.0
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
        sink_token=marked[0],
        bias_dim=bias_dim,
        sink_head=head,
        gain=gain,
        gate_scale=1.0,
        up_scale=1.0,
        down_scale=down_scale,
        planted=plant,
        marked_tokens=tuple(marked),
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


DEEP_LAYERS = 8
DEEP: dict[str, tuple[int, bool]] = {
    "planted-deep": (2, True),
    "twin-deep": (2, False),
    "planted-deep-late": (6, True),
}
"""The deep planted models (:data:`DEEP_LAYERS` layers, BOS as :func:`planted_llama`): name:
(planted layer, planted). A claim judged k of n over partner layers needs n >= 6 to be decided
(Clopper–Pearson: 4 of 4 gives [0.40, 1]): ``planted-deep`` has 7 weight-swap partners (every
other layer), ``planted-deep-late`` 6 layers before its ME layer (weight patching's target layers,
the weights × input cross's earlier inputs). ``twin-deep`` is the twin of both (the weights drawn
do not depend on the planted layer)."""


def planted_deep(name: str = "planted-deep", seed: int = 0):
    """The deep planted model ``name`` of :data:`DEEP` (a tiny Llama with BOS; prompts:
    :func:`planted_prompts`): ``(hf_model, tokenizer, plant)``."""
    if name not in DEEP:
        raise ValueError(f"unknown deep model {name!r}; choose one of {', '.join(DEEP)}")
    layer, plant = DEEP[name]
    return planted_llama(layer=layer, n_layers=DEEP_LAYERS, plant=plant, seed=seed)


def words(n: int, start: int = 0) -> str:
    """A prompt of ``n`` distinct words for the word tokenizer (``w{start} … ``)."""
    return " ".join(f"w{(start + i) % VOCAB_WORDS}" for i in range(n))


def planted_prompts(n: int = 6, length: int = 8) -> list[str]:
    """Prompts for the planted models, with different first words (and lengths)."""
    return [words(length - (i % 3), start=7 * i) for i in range(n)]


# --- no shared BOS: starter words, a delimiter, and prompts with distinct first tokens -----------

N_STARTERS = 20
#: Token ids of the *starter* words ``w0 … w19``: without BOS, they carry the marker that ``<s>``
#: carries in :func:`planted`, and :func:`distinct_first_prompts` opens every prompt with a different one.
STARTER_IDS: tuple[int, ...] = tuple(len(SPECIAL) + i for i in range(N_STARTERS))
#: The delimiter word ``w20``: position 2 of every :func:`distinct_first_prompts` prompt (where
#: ``decoy-later`` makes its massive activation).
DELIMITER_ID = len(SPECIAL) + N_STARTERS
DELIMITER_POSITION = 2


def distinct_first_prompts(n: int = 16, length: int = 10) -> list[str]:
    """``n`` prompts (``n`` ≤ :data:`N_STARTERS`) of ``length``, ``length − 1`` or ``length − 2``
    words, each opening with a different starter word, with the delimiter ``w20`` at position 2 and
    body words ``w21 … w59`` elsewhere (no starter or delimiter later in a prompt), so that token 0
    is a distinct measurement in every prompt (no shared BOS)."""
    if not 1 <= n <= N_STARTERS:
        raise ValueError(f"n must be in [1, {N_STARTERS}] (one starter word per prompt), got {n}")
    if length < DELIMITER_POSITION + 3:
        raise ValueError(f"length must be >= {DELIMITER_POSITION + 3}, got {length}")
    body = [f"w{i}" for i in range(N_STARTERS + 1, VOCAB_WORDS)]
    out = []
    for i in range(n):
        rest = [body[(5 * i + j) % len(body)] for j in range(length - (i % 3) - 2)]
        rest.insert(DELIMITER_POSITION - 1, f"w{N_STARTERS}")
        out.append(" ".join([f"w{i}", *rest]))
    return out


def planted_nobos(plant: bool = True, layer: int = 2, n_layers: int = 5, seed: int = 0):
    """:func:`planted` in a tiny Llama whose tokenizer adds no BOS: the starter words carry the
    marker, so with :func:`distinct_first_prompts` token 0 is massive and distinct in every prompt."""
    return planted("llama", layer, n_layers, plant, seed, add_bos=False, marked=STARTER_IDS)


# --- decoys: a massive activation (or a sink) made the wrong way ---------------------------------


@dataclass(frozen=True)
class Decoy:
    """What a decoy built (0-based indices; the counterpart of :class:`Plant`).

    Attributes:
        kind: one of :data:`DECOYS`.
        made_by: ``"attention"`` (an OV circuit), ``"embedding"``, ``"ffn"`` (one neuron, one
            layer), ``"ffn-gradual"`` (one neuron per layer, a modest factor each) or ``"none"``.
        layers: the layers whose sub-layer writes the massive dim (empty: none does).
        massive_dim: the dim that carries the massive value (``None``: no massive activation).
        position: the token position of the massive activation with :func:`distinct_first_prompts`
            (or of the sink, ``sinkonly``).
        reads: the residual dims the writer reads (the head's value / the neuron's gate and up).
        gain_dims: the dims with a large pre-FFN gain at ``layers[0]`` (empty: none is boosted).
        neuron: the FFN neuron that writes (in each of ``layers``), if any.
        head: the attention head that writes the massive dim (``attention``) or makes the sink.
        marked_tokens: the token ids whose embedding carries the marker (on ``reads``).
        factor: the per-layer growth factor targeted (``gradual``; 1 otherwise).
        sink_head: head 0, whose key reads ``massive_dim`` in every layer (the marker,
            ``sinkonly``).
        erased_at: the layer whose FFN erases the massive activation (``erased``; else ``None``).
        eraser_neurons: the neurons of that FFN that write minus the massive value.
        gain_norm: the norm whose gain ``gain_dims`` are large: ``"ffn_norm"`` (pre-FFN) or
            ``"attn_norm"`` (pre-attention, ``attngain-deep``).
        marker_written_at: the layer whose FFN writes the marker on ``reads`` (``depthinput-deep``;
            ``None``: the marker is in the embedding).
    """

    kind: str
    made_by: str
    layers: tuple[int, ...]
    massive_dim: int | None
    position: int
    reads: tuple[int, ...]
    gain_dims: tuple[int, ...]
    neuron: int | None
    head: int | None
    marked_tokens: tuple[int, ...]
    factor: float = 1.0
    sink_head: int = 0
    erased_at: int | None = None
    eraser_neurons: tuple[int, ...] = ()
    gain_norm: str = "ffn_norm"
    marker_written_at: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _planted_fields(
    kind: str, p: Plant, layer: int, position: int = 0, marked: tuple[int, ...] = STARTER_IDS
) -> dict[str, object]:
    """The record fields of a decoy that keeps the planted mechanism (``p``, one FFN neuron at
    ``layer`` reading the boosted gain dims) and changes something around it."""
    return dict(
        kind=kind,
        made_by="ffn",
        layers=(layer,),
        massive_dim=p.massive_dim,
        position=position,
        reads=p.gain_dims,
        gain_dims=p.gain_dims,
        neuron=p.neuron,
        head=None,
        marked_tokens=marked,
    )


DECOYS: dict[str, str] = {
    "attention": "made by an attention head's OV circuit, not the FFN",
    "embedding": "present from the embedding: no layer makes it",
    "gradual": "grown ×3 per layer over six layers: no sudden birth",
    "offgain": "made by the FFN from dims the pre-FFN gain does not emphasise",
    "sinkonly": "an attention sink without a massive activation",
    "later": "made at position 2 (a delimiter), not at token 0",
    "erased": "made at layer 2 as planted, erased by layer 4's FFN (cosine −1): not carried",
    "attention-deep": "8 layers: written by layer 6's attention head (OV), ordinary gains",
    "offgain-deep": "8 layers: layer 6's FFN makes it from dims of ordinary gain",
    "gainonly-deep": "8 layers: the same neuron in every FFN; only layer 6's pre-FFN gain is large",
    "attngain-deep": "8 layers: the same head in every layer; only layer 6's pre-attention gain",
    "depthinput-deep": "8 layers: planted at layer 6, its marker written by layer 5's FFN",
    # decoys for the causal and sink claims (causal_decoy)
    "rewritten": "planted, and layer 3's FFN writes more along the massive direction: rewritten",
    "collapse": "planted, and layer 3's sink head copies one large vector into the other tokens",
    "varying": "planted, but the sign of the massive value depends on the first word",
    "sinkapart": "planted, but the sink heads' key reads the marker, not the massive dim",
    "primed": "token 0 starts at −7 % of it; the ME FFN writes 107 %: its output is not the state",
    "primedapart": "primed, with the sink heads' key on the marker, not the massive dim",
    "sinkspread": "planted, and after the ME layer every head is a sink head: the sink's effect is "
    "spread over all heads",
    # decoys for the conditions experiment (beyond the first token)
    "secondary": "planted at token 0 and again at the delimiter (position 2): a secondary massive "
    "token, born at the same layer on the same dims",
    "secondary-apart": "planted at token 0; the delimiter (position 2) carries another large dim "
    "from its embedding: a secondary massive token born elsewhere, on other dims",
    "fading": "made at layer 2 as planted, then shrunk ×0.6 by each of layers 3–6's FFNs: no "
    "single-layer eraser, not carried",
    # two-layer births (twostep_decoy)
    "twostep": "born over two layers: the norm ratio jumps ×16 at layer 2, then ×60 at layer 3",
    "twostep-even": "born over two nearly balanced layers: ×20 at layer 2, then ×25 at layer 3",
    "precursor": "layer 1's FFN writes a precursor (60) into the massive dim; two neurons of the "
    "ME layer amplify it: zeroing the precursor weight removes more than the ME layer's top one",
}
"""The kinds :func:`decoy` builds (loadable as ``synthetic:decoy-<kind>``): kind: what it is."""


def secondary_decoy(kind: str, layer: int = 2, seed: int = 0):
    """``secondary``: :func:`planted_nobos` with the marker also on the delimiter word, so that
    position 2 of every :func:`distinct_first_prompts` prompt is massive too, made by the same neuron
    at ``layer`` on the same dim; ``secondary-apart``: :func:`planted_nobos`, and the delimiter's
    embedding carries :data:`MASSIVE_VALUE` on another dim (massive from layer 0, not on the
    planted dim, so the sink head's key does not read it)."""
    from me_interp.architecture import measure_embed_scale

    marked = STARTER_IDS + ((DELIMITER_ID,) if kind == "secondary" else ())
    hf, tok, p = planted("llama", layer, 5, True, seed, add_bos=False, marked=marked)
    dim = p.massive_dim
    if kind == "secondary-apart":
        dim = next(
            d
            for d in range(hf.config.hidden_size)
            if d not in (p.massive_dim, *p.gain_dims, p.bias_dim)
        )
        emb = hf.get_input_embeddings()
        with torch.no_grad():
            emb.weight[DELIMITER_ID, dim] = MASSIVE_VALUE / measure_embed_scale(emb)
    rec = Decoy(
        kind=kind,
        made_by="ffn" if kind == "secondary" else "embedding",
        layers=(layer,) if kind == "secondary" else (),
        massive_dim=dim,
        position=DELIMITER_POSITION,
        reads=p.gain_dims,
        gain_dims=p.gain_dims,
        neuron=p.neuron,
        head=None,
        marked_tokens=marked,
    )
    return hf, tok, rec


#: The magnitude of the decoys' massive value (about the planted one's, 2.3e3).
MASSIVE_VALUE = 2500.0
_OFF_DIMS = (5, 13)  # decoy-offgain: the marker dims its neuron reads (ordinary gain)


def _set_neuron(lay: _Layer, neuron: int, reads, write: int, scale: float, down: float) -> None:
    """Make FFN ``neuron`` read ``reads`` (gate and up, weight ``scale``) and write ``down`` into
    dim ``write``, and nothing else."""
    lay.gate[neuron, :] = 0.0
    lay.up[neuron, :] = 0.0
    lay.down[:, neuron] = 0.0
    lay.gate[neuron, list(reads)] = scale
    lay.up[neuron, list(reads)] = scale
    lay.down[write, neuron] = down


def _ffn_input_at(hf, tok, layer: int, pos: int, dim: int) -> tuple[float, float]:
    """Mean over :func:`distinct_first_prompts` of token ``pos``'s residual value on ``dim`` at the
    input of ``layer`` and of its pre-FFN-norm output there (one HF forward)."""
    got = {}
    norm = _Layer(hf.model.layers[layer], hf.config).ffn_norm
    handle = norm.register_forward_hook(lambda m, i, o: got.setdefault("x", o))
    try:
        batch = tok(distinct_first_prompts(), return_tensors="pt", padding=True)
        with torch.no_grad():
            hs = hf(**batch, output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return float(hs[layer][:, pos, dim].mean()), float(got["x"][:, pos, dim].mean())


ERASED_LAYERS = 6
"""``decoy-erased``: its layers (planted at ``layer``, erased at ``layer + 2``)."""
_ERASER_FIRST = 40  # decoy-erased: the eraser's neurons are 40, 41, ... of its FFN


def _token0_ffn_io(hf, tok, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token 0's pre-FFN-norm input and output ``[starter, d]`` at ``layer``, for every starter
    word (one HF forward of :func:`distinct_first_prompts` with all :data:`N_STARTERS`)."""
    got = {}
    norm = _Layer(hf.model.layers[layer], hf.config).ffn_norm
    handle = norm.register_forward_hook(lambda m, i, o: got.update(x=i[0], y=o))
    try:
        batch = tok(distinct_first_prompts(N_STARTERS), return_tensors="pt", padding=True)
        with torch.no_grad():
            hf(**batch)
    finally:
        handle.remove()
    return got["x"][:, 0].double(), got["y"][:, 0].double()


def _plant_eraser(
    hf, tok, plant: Plant, layer: int, sharpness: float = 3.0, fraction: float = 1.0
) -> tuple[int, ...]:
    """Make FFN neurons of ``layer`` write minus token 0's massive value ``h_D`` (times
    ``fraction``) into the massive dim ``D`` (and nothing else), for every starter word; returns
    the neurons.

    The FFN sees only the normalised state ``ĥ = g ⊙ h / rms(h)``, so it cannot write something
    proportional to ``h_D`` directly; but the bias dim ``b`` is 1 in every state, so
    ``h_D = (g_b / g_D) · ĥ_D / ĥ_b`` is a function of ``t = ĥ_b / ĥ_D``. The neurons compute a
    piecewise-linear function of ``t``: a constant, a linear term and one silu hinge
    ``silu(κ ĥ_D (t − t_k)) · ĥ_D`` at each interior calibration point ``t_k``, whose down weights
    are solved (least squares, a forward pass) so that the sum is ``−h_D`` at token 0 of every
    starter (a causal model: token 0's state depends on its word only). Every neuron's up weight
    reads ``D`` or is gated by ``ĥ_D``, so on tokens without a massive value (``h_D = 0``) the
    eraser writes exactly 0.
    """
    lay = _Layer(hf.model.layers[layer], hf.config)
    D, b = plant.massive_dim, plant.bias_dim
    x, y = _token0_ffn_io(hf, tok, layer)
    t = torch.unique(y[:, b] / y[:, D])  # sorted
    knots = t[1:-1].tolist()
    kappa = sharpness / float(t[0])
    neurons = tuple(range(_ERASER_FIRST, _ERASER_FIRST + 2 + len(knots)))
    if neurons[-1] >= lay.down.shape[1]:
        raise ValueError(f"the eraser needs {len(neurons)} neurons from {_ERASER_FIRST}")
    const, linear, *hinges = neurons
    with torch.no_grad():
        for n in neurons:
            _set_neuron(lay, n, [], D, 0.0, 0.0)
        lay.gate[const, D] = lay.up[const, D] = 1.0
        lay.gate[linear, D] = 1.0
        lay.up[linear, b] = 1.0 / float(t[0])
        for n, k in zip(hinges, knots, strict=True):
            lay.gate[n, b], lay.gate[n, D], lay.up[n, D] = kappa, -kappa * k, 1.0
        rows = list(neurons)
        yf = y.to(lay.gate.dtype)
        act = (torch.nn.functional.silu(yf @ lay.gate[rows].T) * (yf @ lay.up[rows].T)).double()
        scale = act.abs().amax(0).clamp(min=1e-12)  # every neuron's activation of order 1
        lay.up[rows] /= scale[:, None].to(lay.up.dtype)
        sol = torch.linalg.lstsq(act / scale, -fraction * x[:, D : D + 1]).solution[:, 0]
        lay.down[D, rows] = sol.to(lay.down.dtype)
    return neurons


def decoy(kind: str, layer: int = 2, seed: int = 0):
    """A tiny Llama (no BOS; prompts: :func:`distinct_first_prompts`) with a massive activation made
    the wrong way, or an attention sink without one; built on the unplanted twin of
    :func:`planted_nobos` (same sink head, protected dims and marker on the starter words):

    * ``attention``: head 2 of ``layer`` writes the massive dim at token 0 through its OV circuit
      (value reads the marker; its key reads the marker negatively, so no later token attends to
      token 0 and only token 0 gets the write);
    * ``embedding``: the starter words' embedding rows carry the massive value; no layer makes it;
    * ``gradual``: 7 layers; the starters carry 4 on the massive dim, and one neuron in each of
      layers 1…6 reads it and multiplies it by about 3 (its down weight calibrated by a forward
      pass), so no layer jumps by 10 but the whole grows > 100;
    * ``offgain``: ``layer``'s FFN makes it as in :func:`planted`, but from the marker dims
      ``(5, 13)``, whose pre-FFN gain is ordinary (the neuron's weights are 8 instead); the large
      gain (8) is on the gain dims ``(3, 11)``, which every token has at 0;
    * ``sinkonly``: head 0's key reads the marker (ordinary-sized) instead of the massive dim in
      every layer, so every query attends to token 0, and nothing is massive;
    * ``later``: :func:`planted`'s mechanism with the marker on the delimiter word instead of the
      starters: the massive activation is at position 2;
    * ``erased``: :data:`ERASED_LAYERS` layers, :func:`planted_nobos`'s mechanism at ``layer``,
      and neurons of layer ``layer + 2``'s FFN that write minus token 0's massive value into the
      massive dim (cosine −1 with the massive direction; calibrated by a forward pass, see
      :func:`_plant_eraser`), so token 0 is massive at layers ``layer … layer + 1`` only;
    * ``<kind>-deep`` (:data:`DEEP_DECOYS`): :func:`decoy_deep` (8 layers, made at layer 6;
      ``layer`` does not apply);
    * ``fading``: :func:`fading_decoy`;
    * ``twostep``, ``twostep-even`` (:data:`TWOSTEP`): :func:`twostep_decoy` (born over layers 2
      and 3; ``layer`` does not apply).

    Returns:
        ``(hf_model, tokenizer, Decoy)``.
    """
    from me_interp.architecture import measure_embed_scale

    if kind not in DECOYS:
        raise ValueError(f"unknown decoy {kind!r}; choose one of {', '.join(DECOYS)}")
    if kind in DEEP_DECOYS:
        return decoy_deep(kind, seed)
    if kind in CAUSAL_DECOYS:
        return causal_decoy(kind, layer, seed)
    if kind in ("secondary", "secondary-apart"):
        return secondary_decoy(kind, layer, seed)
    if kind in TWOSTEP:
        return twostep_decoy(kind, seed)
    if kind == "fading":
        return fading_decoy(layer, seed)
    if kind == "later":
        hf, tok, p = planted("llama", layer, 5, True, seed, add_bos=False, marked=(DELIMITER_ID,))
        with_chat_template(tok)  # its first token <s> is ordinary; the delimiter is massive
        return (
            hf,
            tok,
            Decoy(**_planted_fields(kind, p, layer, DELIMITER_POSITION, (DELIMITER_ID,))),
        )
    if kind == "erased":
        at = layer + 2
        if at >= ERASED_LAYERS:
            raise ValueError(f"decoy-erased: layer {layer} leaves no layer to erase it")
        hf, tok, p = planted(
            "llama", layer, ERASED_LAYERS, True, seed, add_bos=False, marked=STARTER_IDS
        )
        rec = Decoy(
            **_planted_fields(kind, p, layer),
            erased_at=at,
            eraser_neurons=_plant_eraser(hf, tok, p, at),
        )
        return hf, tok, rec
    n_layers = 7 if kind == "gradual" else 5
    marker = _OFF_DIMS if kind == "offgain" else None
    hf, tok, p = planted(
        "llama",
        layer,
        n_layers,
        False,
        seed,
        add_bos=False,
        marked=STARTER_IDS,
        marker_dims=marker,
    )
    cfg, D, G, n = hf.config, p.massive_dim, p.gain_dims, p.neuron
    lays = [_Layer(b, cfg) for b in hf.model.layers]
    hd = lays[0].head_dim
    slow = hd // 2 - 1
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    what = dict(
        kind=kind, position=0, marked_tokens=STARTER_IDS, neuron=None, head=None, gain_dims=()
    )
    with torch.no_grad():
        if kind == "attention":
            lay, head = lays[layer], 2  # a head outside the sink head's KV group
            q, kv = head * hd, (head // group) * hd
            for w, start in ((lay.q, q), (lay.k, kv), (lay.v, kv)):
                w[start : start + hd] = 0.0
            lay.q[q + slow, p.bias_dim] = 4.0
            lay.k[kv + slow, list(G)] = -4.0  # later queries avoid token 0
            lay.v[kv, list(G)] = 1.0
            lay.o[D, q] = MASSIVE_VALUE / len(G)
            rec = Decoy(
                **{**what, "head": head},
                made_by="attention",
                layers=(layer,),
                massive_dim=D,
                reads=G,
            )
        elif kind == "embedding":
            emb = hf.get_input_embeddings()
            emb.weight[list(STARTER_IDS), D] = MASSIVE_VALUE / measure_embed_scale(emb)
            rec = Decoy(**what, made_by="embedding", layers=(), massive_dim=D, reads=())
        elif kind == "gradual":
            factor, start = 3.0, 4.0
            emb = hf.get_input_embeddings()
            emb.weight[list(STARTER_IDS), D] = start / measure_embed_scale(emb)
            for L in range(1, n_layers):
                _set_neuron(lays[L], n, [D], D, 1.0, 0.0)
                h, x = _ffn_input_at(hf, tok, L, 0, D)
                act = torch.nn.functional.silu(torch.tensor(x)) * x
                lays[L].down[D, n] = (factor - 1.0) * h / float(act)
            rec = Decoy(
                **{**what, "neuron": n},
                made_by="ffn-gradual",
                layers=tuple(range(1, n_layers)),
                massive_dim=D,
                reads=(D,),
                factor=factor,
            )
        elif kind == "offgain":
            lay = lays[layer]
            lay.set_gain_dims(lay.ffn_norm, G, 8.0)
            _set_neuron(lay, n, _OFF_DIMS, D, 8.0, 10.0)
            rec = Decoy(
                **{**what, "neuron": n, "gain_dims": G},
                made_by="ffn",
                layers=(layer,),
                massive_dim=D,
                reads=_OFF_DIMS,
            )
        else:  # sinkonly
            for lay in lays:
                lay.k[slow, :] = 0.0  # head 0 (KV head 0): its key reads the marker
                lay.k[slow, list(G)] = 4.0
            rec = Decoy(**{**what, "head": 0}, made_by="none", layers=(), massive_dim=None, reads=G)
    return hf, tok, rec


# --- deep decoys for the weight claims -----------------------------------------------------------

DEEP_DECOY_LAYER = 6
"""The layer (of :data:`DEEP_LAYERS`) at which every deep decoy makes its massive activation: 7
weight-swap partners, 6 earlier weight-patching targets and weights × input cross inputs."""
DEEP_DECOYS: tuple[str, ...] = tuple(k for k in DECOYS if k.endswith("-deep"))
"""The kinds of :data:`DECOYS` that :func:`decoy_deep` builds."""
_CANCEL_DIM = 19  # gainonly-/attngain-deep: a third marker dim, read with weight −2
_WRITER_HEAD = 2  # the writing heads: outside the sink head's KV group
_WRITER_NEURON = 9  # depthinput-deep: the neuron of layer 5 that writes the marker
_MARKER_VALUE = 6.0  # depthinput-deep: what layer 5 writes on each gain dim (most of token 0's rms)
_DILUTE_DIM, _DILUTE_OUT = 1, 15.0  # depthinput-deep: layer 7's head writes ~100 on dim 1


def _writing_head(lay: _Layer, cfg, reads: dict[int, float], write: int, out: float) -> None:
    """Make head :data:`_WRITER_HEAD` of ``lay`` write ``out · Σ_i w_i ĥ_i`` (``reads``: dim →
    ``w_i``) into dim ``write`` at token 0 only: its value reads ``reads``, its output writes
    ``write``, its query reads the bias dim and its key the gain dims (3, 11) negatively, so no
    later query attends to a marked token 0 (it attends to tokens whose value is 0)."""
    hd = lay.head_dim
    slow, group = hd // 2 - 1, cfg.num_attention_heads // cfg.num_key_value_heads
    q, kv = _WRITER_HEAD * hd, (_WRITER_HEAD // group) * hd
    for w, start in ((lay.q, q), (lay.k, kv), (lay.v, kv)):
        w[start : start + hd] = 0.0
    lay.o[:, q : q + hd] = 0.0
    lay.q[q + slow, 0] = 4.0
    lay.k[kv + slow, [3, 11]] = -4.0
    for d, wd in reads.items():
        lay.v[kv, d] = wd
    lay.o[write, q] = out


def decoy_deep(kind: str, seed: int = 0):
    """A deep decoy (``kind`` of :data:`DEEP_DECOYS`): :data:`DEEP_LAYERS` layers, no BOS (prompts:
    :func:`distinct_first_prompts`), a massive activation at token 0 made at layer
    :data:`DEEP_DECOY_LAYER` ``m`` = 6, on the twin of :func:`planted_nobos` (marker on the
    starter words), each made so that a weight claim can fail or hold:

    * ``attention-deep``: head 2 of ``m`` writes it through its OV circuit (as ``attention``);
      every gain is ordinary. Swapping / copying ``attn`` moves it, the FFN path does not;
    * ``offgain-deep``: ``m``'s FFN makes it from the marker dims ``(5, 13)`` of ordinary gain (as
      ``offgain``): the FFN alone carries it, the pre-FFN gain (8 on the unused ``(3, 11)``) not;
    * ``gainonly-deep``: every layer's FFN has the same neuron, gate ``Σ_G ĥ``, up
      ``Σ_G ĥ − 2 ĥ_E`` (``E`` = dim 19, marked like ``G``; the pre-FFN gains on ``G`` and ``E`` are
      exactly 1), which is exactly 0 unless the gain on ``G`` is boosted; only ``m``'s is (8): the
      gain alone moves it, the FFN not;
    * ``attngain-deep``: every layer has the same writing head, value ``Σ_G ĥ − 2 ĥ_E`` (as
      above, on the pre-attention norm); only ``m``'s pre-attention gain on ``G`` is boosted;
    * ``depthinput-deep``: :func:`planted`'s mechanism at ``m``, but the marker on ``G`` is not in
      the embedding (the starters carry it on ``(5, 13)``): a neuron of layer ``m − 1``'s FFN reads
      that and writes about 6 on each of ``G`` (most of token 0's rms then, so ``ĥ_G`` hardly
      depends on the prompt; the writer's and the planted neuron's down weights are calibrated by
      forward passes), so only inputs from depth ``≥ m`` carry it; and a head of layer ``m + 1``
      writes about 100 on dim 1 where ``G`` is marked (almost nothing once ``D`` is massive), which
      dilutes ``ĥ_G`` below what the mechanism needs, so the mechanism swapped into layer
      ``m + 1`` makes nothing either (without it, that one partner of 7 would move, and 1 of 7 is
      inconclusive against 0.5).

    Returns:
        ``(hf_model, tokenizer, Decoy)``.
    """
    if kind not in DEEP_DECOYS:
        raise ValueError(f"unknown deep decoy {kind!r}; choose one of {', '.join(DEEP_DECOYS)}")
    m, base = DEEP_DECOY_LAYER, kind.removesuffix("-deep")
    cancel_marker = (3, 11, _CANCEL_DIM)  # planted()'s gain dims and E
    marker = {"offgain": _OFF_DIMS, "depthinput": _OFF_DIMS}.get(base)
    if base in ("gainonly", "attngain"):
        marker = cancel_marker
    hf, tok, p = planted(
        "llama", m, DEEP_LAYERS, base == "depthinput", seed, add_bos=False, marked=STARTER_IDS,
        marker_dims=marker,
    )  # fmt: skip
    cfg, D, G, n = hf.config, p.massive_dim, p.gain_dims, p.neuron
    assert G == cancel_marker[:2]
    lays = [_Layer(b, cfg) for b in hf.model.layers]
    cancel = {**dict.fromkeys(G, 1.0), _CANCEL_DIM: -2.0}  # 0 on the marker unless G is boosted
    boosted = len(G) * (p.gain - 1.0)  # Σ_G ĥ − 2 ĥ_E with gain p.gain on G, times rms
    what = dict(kind=kind, layers=(m,), massive_dim=D, position=0, marked_tokens=STARTER_IDS)
    with torch.no_grad():
        if base == "attention":
            _writing_head(lays[m], cfg, dict.fromkeys(G, 1.0), D, MASSIVE_VALUE / len(G))
            rec = Decoy(
                **what, made_by="attention", reads=G, gain_dims=(), neuron=None, head=_WRITER_HEAD
            )
        elif base == "offgain":
            lays[m].set_gain_dims(lays[m].ffn_norm, G, 8.0)
            _set_neuron(lays[m], n, _OFF_DIMS, D, 8.0, 10.0)
            rec = Decoy(**what, made_by="ffn", reads=_OFF_DIMS, gain_dims=G, neuron=n, head=None)
        elif base == "gainonly":
            for lay in lays:
                lay.set_gain_dims(lay.ffn_norm, list(cancel), 1.0)
                _set_neuron(lay, n, G, D, 1.0, MASSIVE_VALUE / (len(G) * p.gain * boosted))
                lay.up[n, _CANCEL_DIM] = -2.0
            lays[m].set_gain_dims(lays[m].ffn_norm, G, p.gain)
            rec = Decoy(
                **what, made_by="ffn", reads=tuple(cancel), gain_dims=G, neuron=n, head=None
            )
        elif base == "attngain":
            for lay in lays:
                lay.set_gain_dims(lay.attn_norm, list(cancel), 1.0)
                _writing_head(lay, cfg, cancel, D, MASSIVE_VALUE / boosted)
            lays[m].set_gain_dims(lays[m].attn_norm, G, p.gain)
            rec = Decoy(
                **what, made_by="attention", reads=tuple(cancel), gain_dims=G, neuron=None,
                head=_WRITER_HEAD, gain_norm="attn_norm",
            )  # fmt: skip
        else:  # depthinput
            w = lays[m - 1]
            _set_neuron(w, _WRITER_NEURON, _OFF_DIMS, G[0], 1.0, 0.0)
            s = torch.tensor(sum(_ffn_input_at(hf, tok, m - 1, 0, d)[1] for d in _OFF_DIMS))
            w.down[list(G), _WRITER_NEURON] = _MARKER_VALUE / float(torch.nn.functional.silu(s) * s)
            s = torch.tensor(sum(_ffn_input_at(hf, tok, m, 0, d)[1] for d in G))
            lays[m].down[D, n] = MASSIVE_VALUE / float(torch.nn.functional.silu(s) * s)
            _writing_head(lays[m + 1], cfg, dict.fromkeys(G, 1.0), _DILUTE_DIM, _DILUTE_OUT)
            rec = Decoy(
                **what, made_by="ffn", reads=G, gain_dims=G, neuron=n, head=None,
                marker_written_at=m - 1,
            )  # fmt: skip
    return hf, tok, rec


# --- decoys for the causal and sink claims --------------------------------------------------------
#
# Decoys for the claims of activation_patching, attention_sinks, invariance, sink_causality and
# transplant that no other constructed model can make hold (or fail): each is :func:`planted_nobos`
# (no BOS; prompts: :func:`distinct_first_prompts`) with one part changed. :func:`decoy` builds them
# through :func:`causal_decoy`.

CAUSAL_DECOYS: tuple[str, ...] = (
    "rewritten",
    "collapse",
    "varying",
    "sinkapart",
    "primed",
    "primedapart",
    "sinkspread",
    "precursor",
)
"""The kinds of :data:`DECOYS` that :func:`causal_decoy` builds."""

LATE_NEURON = 7
"""The FFN neuron :func:`add_late_writer` uses (one the planted construction leaves random)."""
REWRITE_SCALE = 200.0
"""``decoy-rewritten``: the down weight of the late writer (its output at token 0 is about 6e3
along the massive dim, more than the ME layer wrote)."""
COLLAPSE_DIM, COLLAPSE_VALUE = 20, 80.0
"""``decoy-collapse``: the residual dim the sink head writes into every token that attends to the
massive token, and about how much (below the Sun criterion's 100, so nothing new is massive)."""
SIGN_DIM = 5
"""``decoy-varying``: the dim whose sign in the starter's embedding (+1 on even starters ``w0, w2,
…``, −1 on odd ones) sets the sign of the massive value."""
PRIME_FRACTION = 0.07
"""``decoy-primed``: the starters' embedding carries ``−PRIME_FRACTION × MASSIVE_VALUE`` on the
massive dim, so the ME layer's FFN writes ``(1 + PRIME_FRACTION) ×`` the massive value."""
APART_KEY = 2500.0
"""The sink head's key weight on each marker dim after the ME layer (``sinkapart``,
``primedapart``): about the planted sink score (``q · k / sqrt(head_dim) ≈ 8``) when token 0 is
massive (its normalised marker is then ``≈ sqrt(d_model) / MASSIVE_VALUE``), far more without it."""


@dataclass(frozen=True)
class CausalDecoy(Decoy):
    """What :func:`causal_decoy` built: a :class:`Decoy` and what was changed.

    Attributes:
        sink_reads: the dims the sink head's key reads in the layers after the ME layer (the massive
            dim; the marker dims for ``sinkapart`` and ``primedapart``).
        late_writer: ``(layer, neuron)`` of the later FFN neuron that writes more along the massive
            dim (``rewritten``; else ``None``).
        collapse_dim: the dim the sink head's OV circuit writes ``collapse_value`` into, in the
            layer after the ME layer (``collapse``; else ``None``).
        collapse_value: about how much it writes into a token that attends only to token 0.
        sign_dim: the dim whose sign in the starter's embedding is the sign of the massive value
            (``varying``; else ``None``).
        prime: the value on the massive dim of the starters' embedding (``primed``,
            ``primedapart``; 0 otherwise).
        spread_layers: the layers whose every head is a sink head (``sinkspread``; else empty: only
            head 0 is).
    """

    sink_reads: tuple[int, ...] = ()
    late_writer: tuple[int, int] | None = None
    collapse_dim: int | None = None
    collapse_value: float = 0.0
    sign_dim: int | None = None
    prime: float = 0.0
    spread_layers: tuple[int, ...] = ()


def add_late_writer(
    hf, plant: Plant, scale: float, layer: int | None = None, neuron: int = LATE_NEURON
) -> int:
    """Make FFN ``neuron`` of ``layer`` (default: the layer after ``plant.layer``) read the massive
    dim (gate and up weights 1) and write ``scale`` times ``silu(ĥ_D) ĥ_D`` into it, and nothing
    else (in place): ``scale > 0`` writes more along the massive direction (it *rewrites* it),
    ``scale < 0`` against it. Tokens without a massive value (``ĥ_D = 0``) get nothing. Returns the
    layer."""
    layer = plant.layer + 1 if layer is None else layer
    lay = _Layer(hf.model.layers[layer], hf.config)
    with torch.no_grad():
        _set_neuron(lay, neuron, [plant.massive_dim], plant.massive_dim, 1.0, scale)
    return layer


def _sink_on_marker(hf, plant: Plant, layers, key: float = APART_KEY) -> tuple[int, ...]:
    """Make the sink head's key read the marker dims (the gain dims of :func:`planted_nobos` and
    :func:`planted_llama`; weight ``key``) instead of the massive dim in ``layers`` (in place);
    returns those dims."""
    dims = plant.gain_dims  # the marker is on the gain dims
    for L in layers:
        lay = _Layer(hf.model.layers[L], hf.config)
        row = plant.sink_head * lay.head_dim + lay.head_dim // 2 - 1  # the slow rotary pair
        with torch.no_grad():
            lay.k[row, :] = 0.0
            lay.k[row, list(dims)] = key
    return dims


def _collapse_head(hf, plant: Plant, layer: int, dim: int, value: float) -> None:
    """Make value slot 0 of the sink head at ``layer`` read only the massive dim and its output
    write ``value / sqrt(d_model)`` times it into ``dim`` (in place): a token that attends to the
    massive token (whose normalised massive value is about ``sqrt(d_model)``) gets about ``value``
    on ``dim``; the other head of the same KV group does not write that slot."""
    cfg = hf.config
    lay = _Layer(hf.model.layers[layer], cfg)
    hd, group = lay.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    kv = plant.sink_head // group
    with torch.no_grad():
        lay.v[kv * hd, :] = 0.0
        lay.v[kv * hd, plant.massive_dim] = 1.0
        for head in range(kv * group, (kv + 1) * group):
            lay.o[:, head * hd] = 0.0
        lay.o[dim, plant.sink_head * hd] = value / cfg.hidden_size**0.5


def _sink_every_head(hf, plant: Plant, layers) -> None:
    """Make every head of ``layers`` a sink head like head 0 (in place): each query reads only the
    bias dim and each key only the massive dim, on the slow rotary pair, with the planted weights, so
    every head attends to the massive token as head 0 does; values and outputs stay random, so each
    head writes its own part of what the sink changes."""
    cfg = hf.config
    for L in layers:
        lay = _Layer(hf.model.layers[L], cfg)
        hd = lay.head_dim
        slow = hd // 2 - 1
        q0 = float(lay.q[plant.sink_head * hd + slow, plant.bias_dim])
        k0 = float(lay.k[plant.sink_head * hd + slow, plant.massive_dim])
        with torch.no_grad():
            for h in range(cfg.num_attention_heads):
                lay.q[h * hd : (h + 1) * hd, :] = 0.0
                lay.q[h * hd + slow, plant.bias_dim] = q0
            for h in range(cfg.num_key_value_heads):
                lay.k[h * hd : (h + 1) * hd, :] = 0.0
                lay.k[h * hd + slow, plant.massive_dim] = k0


def _protect(hf, dim: int) -> None:
    """Make ``dim`` written by no attention output and no FFN (in place)."""
    with torch.no_grad():
        for blk in hf.model.layers:
            lay = _Layer(blk, hf.config)
            lay.o[dim, :] = 0.0
            lay.down[dim, :] = 0.0


PRECURSOR_NEURON, PRECURSOR_WRITE = 9, 60.0
"""``decoy-precursor``: the neuron of layer ``layer − 1`` that writes the precursor, and about how
much it writes into the massive dim at token 0 (below the Sun criterion's 100: not yet massive)."""
AMPLIFIERS = ((5, 0.6), (6, 0.4))
"""``decoy-precursor``: the ME layer's neurons that read the massive dim and write it back, and
their shares of the massive value :data:`MASSIVE_VALUE`."""


def _plant_precursor(hf, tok, plant: Plant, layer: int) -> dict:
    """Make neuron :data:`PRECURSOR_NEURON` of ``layer − 1`` read the marker (gain dims) and write
    about :data:`PRECURSOR_WRITE` into the massive dim ``D`` at the marked tokens only, and the
    planted neuron of ``layer`` plus a second one (:data:`AMPLIFIERS`) read ``D`` (pre-FFN gain
    ``plant.gain`` on ``D``, none on the gain dims) and write 60 % and 40 % of
    :data:`MASSIVE_VALUE` into ``D`` (down weights calibrated by one forward). Zeroing the precursor's
    weight leaves the ME layer nothing to amplify; zeroing the ME layer's top weight leaves 40 %."""
    D, G = plant.massive_dim, list(plant.gain_dims)
    pre = _Layer(hf.model.layers[layer - 1], hf.config)
    me = _Layer(hf.model.layers[layer], hf.config)
    x = _token0_ffn_io(hf, tok, layer - 1)[1]  # [starter, d]: layer − 1's normalised FFN input
    act = torch.nn.functional.silu(x[:, G].sum(-1)) * x[:, G].sum(-1)
    _set_neuron(pre, PRECURSOR_NEURON, G, D, 1.0, PRECURSOR_WRITE / float(act.mean()))
    me.set_gain_dims(me.ffn_norm, G, 1.0)
    me.set_gain_dims(me.ffn_norm, [D], plant.gain)
    for n, _ in AMPLIFIERS:
        _set_neuron(me, n, [D], D, 1.0, 0.0)
    y = _token0_ffn_io(hf, tok, layer)[1][:, D]
    a = float((torch.nn.functional.silu(y) * y).mean())
    for n, share in AMPLIFIERS:
        me.down[D, n] = share * MASSIVE_VALUE / a
    return {"neuron": AMPLIFIERS[0][0], "reads": (D,), "gain_dims": (D,)}


def causal_decoy(kind: str, layer: int = 2, seed: int = 0):
    """A decoy of :data:`CAUSAL_DECOYS` (a tiny Llama, no BOS; prompts:
    :func:`distinct_first_prompts`): :func:`planted_nobos` (5 layers, planted at ``layer``) with one
    part changed:

    * ``rewritten``: :func:`add_late_writer` in layer ``layer + 1`` with scale
      :data:`REWRITE_SCALE`: a later FFN (after the ME layer, before the last layer) writes more
      along the massive direction than the ME layer did, so the massive activation is rewritten,
      not only carried;
    * ``collapse``: in layer ``layer + 1`` the sink head's value reads the massive dim and its output
      writes about :data:`COLLAPSE_VALUE` into dim :data:`COLLAPSE_DIM` of every token that attends
      to the massive token: the same large vector in every other token, whose states collapse
      (their effective rank drops);
    * ``varying``: the starters carry ``±1`` on :data:`SIGN_DIM` (``+`` on even starters, ``−`` on
      odd ones; written by nothing), which the ME layer's pre-FFN norm boosts like the gain dims,
      and the planted neuron's up weight reads it instead of the gain dims: the massive value is
      ``±`` the planted one, so its direction depends on the input (the sink head's key reads
      ``+D``, so odd starters have no sink);
    * ``sinkapart``: after the ME layer the sink head's key reads the marker (:func:`_sink_on_marker`,
      weight :data:`APART_KEY`) instead of the massive dim: the sink is on token 0, but does not
      depend on its massive activation (removing the massive dims *raises* the normalised marker,
      and a transplanted massive component carries no marker);
    * ``primed``: the starters' embedding carries ``−PRIME_FRACTION × MASSIVE_VALUE`` on the
      massive dim and the planted neuron's down weight is calibrated (a forward pass) so that token
      0's massive value after the ME layer is :data:`MASSIVE_VALUE`: the ME layer's FFN output is
      107 % of the state's norm, so it is *not* the state (``probes.ffn.ffn_share``), and
      setting it to the other tokens' mean leaves token 0 with ``−7 %`` of it: removed, and its
      normalised state points *against* the massive dim, which the sink head's key reads: the sink
      goes;
    * ``primedapart``: ``primed`` with the sink head's key of ``sinkapart``: the same removal leaves
      the sink (the marker is read, and more strongly once the massive value is gone);
    * ``sinkspread``: after the ME layer *every* head is a sink head like head 0
      (:func:`_sink_every_head`; values and outputs random): removing the massive activation changes
      what all of them write, so its effect on the output is spread over every head, not carried by
      one per layer.

    Returns:
        ``(hf_model, tokenizer, CausalDecoy)``.
    """
    from me_interp.architecture import measure_embed_scale

    if kind not in CAUSAL_DECOYS:
        raise ValueError(f"unknown causal decoy {kind!r}; choose one of {', '.join(CAUSAL_DECOYS)}")
    hf, tok, p = planted_nobos(layer=layer, seed=seed)
    D, n, n_layers = p.massive_dim, p.neuron, hf.config.num_hidden_layers
    if layer + 2 >= n_layers:
        raise ValueError(f"decoy-{kind}: layer {layer} leaves no layer between it and the last")
    after = tuple(range(layer + 1, n_layers))
    emb = hf.get_input_embeddings()
    lay = _Layer(hf.model.layers[layer], hf.config)
    rec = dict(_planted_fields(kind, p, layer), sink_reads=(D,))
    with torch.no_grad():
        if kind == "rewritten":
            late = add_late_writer(hf, p, REWRITE_SCALE)
            rec.update(layers=(layer, late), late_writer=(late, LATE_NEURON))
        elif kind == "collapse":
            _collapse_head(hf, p, layer + 1, COLLAPSE_DIM, COLLAPSE_VALUE)
            rec.update(head=p.sink_head, collapse_dim=COLLAPSE_DIM, collapse_value=COLLAPSE_VALUE)
        elif kind == "sinkspread":
            _sink_every_head(hf, p, after)
            rec.update(spread_layers=after)
        elif kind == "precursor":
            rec.update(layers=(layer - 1, layer), **_plant_precursor(hf, tok, p, layer))
        elif kind == "varying":
            _protect(hf, SIGN_DIM)
            sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(N_STARTERS)])
            emb.weight[:, SIGN_DIM] = 0.0
            emb.weight[list(STARTER_IDS), SIGN_DIM] = sign / measure_embed_scale(emb)
            lay.set_gain_dims(lay.ffn_norm, [SIGN_DIM], p.gain)
            lay.up[n, :] = 0.0
            lay.up[n, SIGN_DIM] = float(len(p.gain_dims))  # ± the planted up (Σ over the gains)
            rec.update(sign_dim=SIGN_DIM, reads=(*p.gain_dims, SIGN_DIM))
        else:  # sinkapart, primed, primedapart
            if kind in ("primed", "primedapart"):
                prime = -PRIME_FRACTION * MASSIVE_VALUE
                emb.weight[list(STARTER_IDS), D] = prime / measure_embed_scale(emb)
                x, y = _token0_ffn_io(hf, tok, layer)
                yf = y.to(lay.gate.dtype)
                act = torch.nn.functional.silu(yf @ lay.gate[n]) * (yf @ lay.up[n])
                lay.down[D, n] = (MASSIVE_VALUE - float(x[:, D].mean())) / float(act.mean())
                rec.update(prime=prime)
            if kind != "primed":
                rec.update(sink_reads=_sink_on_marker(hf, p, after))
    return hf, tok, CausalDecoy(**rec)


# --- a planted model whose language model needs its sink (for the WeMask claims) -----------------

NEEDSINK: dict[str, tuple[float, float]] = {
    "planted-needsink": (0.5, 20.0),
    "planted-needsink-wide": (2.0, 20.0),
    "planted-needsink-mild": (2.0, 1.0),
}
"""The planted models that need their sink (:func:`planted_needsink`): name: (``gain``, the
pre-attention gain of the massive dim after the ME layer; ``value_out``, the scale of the sink
head's write when it leaves the sink). A gain of 0.5 is below every other gain (about 1), so the
weight-guided WeMask at a small rate leaves the massive dim alone; 2.0 is above them (*wide*), so it
masks the massive dim first. ``value_out`` 20 scrambles the prediction when the sink is lost; 1
(*mild*) perturbs it only a little (perplexity × 1.004, a few near-tied MC items change)."""

_SINK_KEY_BOOST = 8.0  # the sink head's key on the massive dim, × the planted one
_BIGRAM_SCALE = 3.0  # the unembedding row of word j: this × the unit embedding of word j − 1


def planted_needsink(name: str = "planted-needsink", seed: int = 0):
    """:func:`planted_llama` turned into a language model that *needs* its sink (``name`` of
    :data:`NEEDSINK`; a tiny Llama with BOS; prompts: :func:`planted_prompts`; texts and MC items:
    :func:`word_texts`, :func:`word_mc_items`).

    * a bigram unembedding: the unembedding row of word ``j`` is ``3 · e_{j−1} / ‖e_{j−1}‖``, with
      ``e`` the embedding, so each word predicts the next one (the texts of :func:`word_texts` have a
      perplexity near 1; ``w0`` and the special tokens have a zero row);
    * after the ME layer, the sink head (head 0, whose key reads the massive dim) has its key on the
      massive dim 8 × stronger, a value that is 0 on the massive dim and random elsewhere (so it is 0
      for the massive token, large for the others) and random output weights ``value_out`` times the
      usual size (writing none of the protected dims): while every query attends to the sink, the
      head writes nothing; without the sink, it writes noise into the next-token prediction;
    * the pre-attention gain of the massive dim after the ME layer is ``gain``.

    Returns:
        ``(hf_model, tokenizer, plant)`` (the :class:`Plant` of :func:`planted_llama`).
    """
    if name not in NEEDSINK:
        raise ValueError(f"unknown needsink model {name!r}; choose one of {', '.join(NEEDSINK)}")
    gain, value_out = NEEDSINK[name]
    hf, tok, plant = planted_llama(seed=seed)
    gen = torch.Generator().manual_seed(seed + 5)
    D = plant.massive_dim
    with torch.no_grad():
        emb = hf.get_input_embeddings().weight
        unembed = torch.zeros_like(hf.lm_head.weight)
        for j in range(len(SPECIAL) + 1, emb.shape[0]):
            unembed[j] = _BIGRAM_SCALE * emb[j - 1] / emb[j - 1].norm()
        hf.lm_head.weight.copy_(unembed)
        for blk in hf.model.layers[plant.layer + 1 :]:
            lay = _Layer(blk, hf.config)
            hd, d = lay.head_dim, hf.config.hidden_size
            rows = slice(plant.sink_head * hd, (plant.sink_head + 1) * hd)
            lay.k[plant.sink_head * hd + hd // 2 - 1, D] *= _SINK_KEY_BOOST
            lay.v[rows] = torch.randn(hd, d, generator=gen) / d**0.5
            lay.v[rows, D] = 0.0
            lay.o[:, rows] = torch.randn(d, hd, generator=gen) * value_out / hd**0.5
            lay.o[[plant.bias_dim, *plant.gain_dims, D], :] = 0.0
            lay.set_gain_dims(lay.attn_norm, [D], gain)
    return hf, tok, plant


def word_texts(n: int = 32, length: int = 12, starter: bool = False) -> list[str]:
    """``n`` texts of ``length`` consecutive words (``wk w(k+1) …``, never wrapping past ``w59``),
    which the bigram unembedding of :func:`planted_needsink` predicts almost surely; the starts
    step through ``w1 … w(60 − length)``, so the texts differ. ``starter=True`` (for the models
    without BOS, whose massive token is a starter word at position 0): each text opens with the
    starter word ``w(i mod 20)`` instead, then ``length − 1`` consecutive words."""
    if not 2 <= length <= VOCAB_WORDS - 1:
        raise ValueError(f"length must be in [2, {VOCAB_WORDS - 1}], got {length}")
    starts = VOCAB_WORDS - length  # w1 … w(60 − length): the first word is predicted too
    if not starter:
        return [words(length, start=1 + (7 * i) % starts) for i in range(n)]
    return [
        f"w{i % N_STARTERS} " + words(length - 1, start=1 + (7 * i) % (starts + 1))
        for i in range(n)
    ]


def word_mc_items(n: int = 128, context: int = 6, open_every: int = 8) -> list[dict]:
    """``n`` multiple-choice items (the JSON records of :func:`me_interp.evaluation.load_mc_items`):
    a run of ``context`` consecutive words and three one-word choices, the right one at index
    ``i mod 3``. Most items offer the next word (which the bigram model of
    :func:`planted_needsink` predicts) and two others (14 and 33 words on); every
    ``open_every``-th item offers none of them (9, 21 and 40 words on): there the bigram model is
    at chance, with small margins that a small perturbation can flip, so an 'unchanged' accuracy
    can be measured with a non-zero interval (``open_every=0``: no such item)."""
    last = VOCAB_WORDS - context - 1  # the next word exists: start ≤ 60 − context − 1
    out = []
    for i in range(n):
        start = 1 + (5 * i) % last
        nxt = start + context
        if open_every and i % open_every == open_every - 1:
            choices = [f"w{(nxt + k) % VOCAB_WORDS}" for k in (9, 21, 40)]
        else:
            choices = [f"w{(nxt + k) % VOCAB_WORDS}" for k in (14, 33)]
            choices.insert(i % 3, f"w{nxt}")
        out.append({"context": words(context, start=start), "choices": choices, "answer": i % 3})
    return out


# --- super weights whose damage is (or is not) done at the massive token -------------------------

SPREAD: dict[str, float] = {
    "superweight-spread": 0.0,
    "superweight-spread-mild": 0.5,
}
"""The planted models whose super weight also acts on every other token
(:func:`superweight_spread`, ``synthetic:<name>``): name: the fraction ``λ`` of the sink head's
query (after the ME layer) that stays on the constant bias dim; the rest reads minus the massive
dim, which the planted neuron makes slightly negative on every ordinary token. With ``λ = 0``
restoring the super activation at the massive token cannot bring the sink back (the ordinary
tokens' queries stay 0); with ``λ = 0.5`` it brings back nearly all of it."""

_SPREAD_GATE, _SPREAD_UP = 1.0, -0.3  # the planted neuron's gate / up weights on the bias dim


def describe_models() -> dict[str, str]:
    """One line per named constructed model (``synthetic:<name>``, ``me-interp models``), from the
    registries above; the ``<what>-<arch>`` models and the decoys are described by
    ``loading.synthetic.catalogue_rows`` from :data:`ARCHS` and :data:`DECOYS`."""
    layer, n = (inspect.signature(planted).parameters[k].default for k in ("layer", "n_layers"))
    where = f"planted at layer {layer} of {n}"
    out = {
        "planted": f"the mechanism {where}; BOS is the massive token (and the chat template's first)",
        "twin": "the planted model's twin: its weights without the mechanism, no massive activation",
        "tiny-llama": "random weights (llama)",
        "tiny-qwen3": "random weights (qwen3)",
        "planted-nobos": f"the mechanism {where}, no BOS: a distinct first word is the massive token",
        "twin-nobos": "the no-BOS planted model's twin: no massive activation",
    }
    for name, (at, planted_) in DEEP.items():
        out[name] = (
            f"{DEEP_LAYERS} layers, the mechanism planted at layer {at}"
            if planted_
            else f"the twin of the {DEEP_LAYERS}-layer planted models: no massive activation"
        )
    for name, (gain, value_out) in NEEDSINK.items():
        side = "above" if gain > 1 else "below"
        out[name] = (
            f"planted; its predictions need the sink (x{value_out:g} write off it); the massive "
            f"dim's pre-attention gain {gain:g}, {side} the others"
        )
    out[SINKRESID] = (
        f"the mechanism {where}; its sink heads read a residual of BOS outside the massive dims, "
        "not the massive dim"
    )
    out[WASHOUT] = (
        f"the mechanism {where}; a layer-{WASHOUT_LAYER} head that writes on every other token "
        "once BOS's attention share falls: at 1,024 tokens BOS is no longer massive"
    )
    for name, keep in SPREAD.items():
        back = "nearly all" if keep > 0 else "none"
        out[name] = (
            f"planted; its super weight acts on every token: restoring the super activation "
            f"brings back {back} of the sink (query keeps {keep:g} of the bias dim)"
        )
    return out


def superweight_spread(name: str = "superweight-spread", seed: int = 0):
    """:func:`planted_needsink` (``planted-needsink``: a tiny Llama with BOS, a bigram language
    model that needs its sink; prompts :func:`planted_prompts`) whose super weight, the planted
    ``W_down[D, n]`` of layer ``P``, also writes on every ordinary token (``name`` of :data:`SPREAD`):

    * the planted neuron ``n`` also reads the bias dim ``b`` (1 in every token: gate weight 1, up
      weight −0.3), so on an ordinary token it computes ``silu(ĥ_b) · (−0.3 ĥ_b) ≈ −0.2`` and writes
      about −2 into the massive dim ``D`` (nothing else writes ``D``; the massive token still gets
      its planted value, about 2.3e3);
    * after ``P``, the sink head's query (on its slow rotary pair) is ``λ q₀ ĥ_b − (1 − λ) κ_L ĥ_D``
      with ``q₀`` the planted weight on the bias dim and ``κ_L`` calibrated by a forward pass (the
      mean over ordinary tokens of ``q₀ ĥ_b / (−ĥ_D)`` at layer ``L``'s attention input), so every
      ordinary query has the planted sink score and the model computes what ``planted-needsink``
      computes.

    Zeroing the super weight removes ``D`` everywhere: no sink, the language model scrambles.
    Restoring the super activation at the massive token (Yu et al.) brings the sink's key back but
    not the ordinary tokens' queries: with ``λ = 0`` they stay 0 (uniform attention, scrambled),
    with ``λ = 0.5`` half the planted score is left, still a sink.

    Returns:
        ``(hf_model, tokenizer, plant)`` (the :class:`Plant` of :func:`planted_llama`).
    """
    if name not in SPREAD:
        raise ValueError(f"unknown spread model {name!r}; choose one of {', '.join(SPREAD)}")
    lam = SPREAD[name]
    hf, tok, plant = planted_needsink("planted-needsink", seed=seed)
    D, b, n, P = plant.massive_dim, plant.bias_dim, plant.neuron, plant.layer
    lays = [_Layer(blk, hf.config) for blk in hf.model.layers]
    with torch.no_grad():
        lays[P].gate[n, b] = _SPREAD_GATE
        lays[P].up[n, b] = _SPREAD_UP
    later = list(range(P + 1, len(lays)))
    got: dict[int, torch.Tensor] = {}
    handles = [
        lays[L].attn_norm.register_forward_hook(
            lambda m, i, o, L=L: got.__setitem__(L, o.detach().double())
        )
        for L in later
    ]
    try:
        batch = tok(planted_prompts(), return_tensors="pt", padding=True)
        with torch.no_grad():
            hf(**batch)
    finally:
        for h in handles:
            h.remove()
    ordinary = batch["attention_mask"].bool().clone()
    ordinary[:, 0] = False  # position 0 is <s>, the massive token
    with torch.no_grad():
        for L in later:
            lay = lays[L]
            row = plant.sink_head * lay.head_dim + lay.head_dim // 2 - 1  # the slow rotary pair
            q0 = float(lay.q[row, b])
            x = got[L][ordinary]  # [tokens d_model]
            kappa = q0 * float(x[:, b].mean()) / float((-x[:, D]).mean())
            lay.q[row, :] = 0.0
            lay.q[row, b] = lam * q0
            lay.q[row, D] = -(1.0 - lam) * kappa
    return hf, tok, plant


# --- two-layer births: one_layer must fail ---------------------------------------------------

TWOSTEP: dict[str, tuple[float, float]] = {"twostep": (16.0, 60.0), "twostep-even": (20.0, 25.0)}
"""The two-layer-birth decoys: kind: the norm-ratio jumps ``R_l / R_{l-1}`` targeted at layers
:data:`TWOSTEP_LAYERS` (median over :func:`distinct_first_prompts`), each above ``jump`` (10)."""
TWOSTEP_LAYERS = (2, 3)


def _median_ratio(hf, tok, layer: int) -> tuple[float, float]:
    """Median over :func:`distinct_first_prompts` of token 0's norm over the mean of the other
    tokens' norms at the input and at the output of ``layer`` (one HF forward; not the last
    layer, whose HF hidden state is after the final norm)."""
    batch = tok(distinct_first_prompts(), return_tensors="pt", padding=True)
    with torch.no_grad():
        hs = hf(**batch, output_hidden_states=True).hidden_states
    mask = batch["attention_mask"].bool()
    out = []
    for h in (hs[layer], hs[layer + 1]):
        n = h.norm(dim=-1)  # batch pos
        others = mask.clone()
        others[:, 0] = False
        r = n[:, 0] / ((n * others).sum(-1) / others.sum(-1))
        out.append(float(r.median()))
    return out[0], out[1]


def twostep_decoy(kind: str, seed: int = 0):
    """A tiny Llama (no BOS; prompts: :func:`distinct_first_prompts`) on the unplanted twin of
    :func:`planted_nobos` whose massive activation is born over two layers: the starter words carry
    1 on the massive dim, and one neuron of each of :data:`TWOSTEP_LAYERS` reads that dim and
    writes it larger, its down weight bisected (on the log scale, by forward passes) so that the
    median norm ratio jumps by the factors of :data:`TWOSTEP` (``kind``): ``(hf, tokenizer, Decoy)``.
    """
    from me_interp.architecture import measure_embed_scale

    factors = TWOSTEP[kind]
    hf, tok, p = planted("llama", 2, 5, False, seed, add_bos=False, marked=STARTER_IDS)
    D, n = p.massive_dim, p.neuron
    lays = [_Layer(b, hf.config) for b in hf.model.layers]
    with torch.no_grad():
        emb = hf.get_input_embeddings()
        emb.weight[list(STARTER_IDS), D] = 1.0 / measure_embed_scale(emb)
        for layer, factor in zip(TWOSTEP_LAYERS, factors, strict=True):
            _set_neuron(lays[layer], n, [D], D, 1.0, 0.0)
            lo, hi = -6.0, 8.0  # log10 of the down weight
            for _ in range(40):
                mid = (lo + hi) / 2
                lays[layer].down[D, n] = 10.0**mid
                r_in, r_out = _median_ratio(hf, tok, layer)
                lo, hi = (mid, hi) if r_out / r_in < factor else (lo, mid)
    rec = Decoy(
        kind=kind,
        made_by="ffn-gradual",
        layers=TWOSTEP_LAYERS,
        massive_dim=D,
        position=0,
        reads=(D,),
        gain_dims=(),
        neuron=n,
        head=None,
        marked_tokens=STARTER_IDS,
        factor=factors[1],
    )
    return hf, tok, rec


FADING_LAYERS, FADING_FACTOR = 7, 0.6
"""``decoy-fading``: its layers, and the factor each FFN after the planted layer puts on the
massive value (above ``carried_fraction``, 0.5: no single layer erases it)."""


def fading_decoy(layer: int = 2, seed: int = 0):
    """:func:`planted_nobos`'s mechanism at ``layer`` of :data:`FADING_LAYERS`, and in each later
    layer an eraser (:func:`_plant_eraser`) that writes ``(FADING_FACTOR − 1)`` times token 0's
    massive value into the massive dim, for every starter word: the massive activation fades by
    :data:`FADING_FACTOR` per layer, ``(hf, tokenizer, Decoy)``."""
    hf, tok, p = planted(
        "llama", layer, FADING_LAYERS, True, seed, add_bos=False, marked=STARTER_IDS
    )
    for L in range(layer + 1, FADING_LAYERS):
        _plant_eraser(hf, tok, p, L, fraction=1.0 - FADING_FACTOR)
    return hf, tok, Decoy(**_planted_fields("fading", p, layer), factor=FADING_FACTOR)


# --- a planted model whose sink is carried by a residual outside the massive dims ----------------

SINKRESID = "planted-sinkresid"
"""The planted model whose sink heads read a residual outside the massive dims
(:func:`planted_sinkresid`, ``synthetic:planted-sinkresid``)."""


def planted_sinkresid(seed: int = 0):
    """:func:`planted_llama` (BOS, 5 layers, planted at layer 2; prompts: :func:`planted_prompts`)
    whose sink heads after the ME layer read the marker of ``<s>`` (the gain dims, a small residual
    outside the massive dims that every layer carries unchanged) instead of the massive dim, with
    the key weight set to ``<s>``'s massive value (measured by a forward pass), so the unmodified
    sink score is the planted one. The sink is on the massive token, but the massive dims do not
    carry it: resetting them (which leaves ``<s>`` an ordinary token) *raises* its normalised marker
    and keeps the sink, and moving only the massive dims to another token moves no sink; moving
    ``<s>``'s whole state moves it (``sink_causality.remove_dims`` and ``transplant.sink_follows``
    fail, ``transplant.state_follows`` holds).

    Returns:
        ``(hf_model, tokenizer, plant)`` (the :class:`Plant` of :func:`planted_llama`).
    """
    hf, tok, plant = planted_llama(seed=seed)
    ids = torch.tensor([[BOS_ID, *range(len(SPECIAL), len(SPECIAL) + 4)]])
    with torch.no_grad():
        h = hf(input_ids=ids, output_hidden_states=True).hidden_states[plant.layer + 1]
    value = float(h[0, 0, plant.massive_dim])
    _sink_on_marker(hf, plant, range(plant.layer + 1, hf.config.num_hidden_layers), key=value)
    return hf, tok, plant


# --- beyond the first token: a chat template, and a planted model washed out by long inputs -----

CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
"""The chat template of ``synthetic:planted`` and ``synthetic:decoy-later``: ``<s>``, then each turn
as its role, its content and ``</s>`` (the roles and the system turn are ``<unk>`` words), then the
generation prompt. Its first token is ``<s>``: massive in the planted model (the marker), ordinary in
``decoy-later`` (whose massive token is the delimiter of the user turn)."""


def with_chat_template(tok):
    """``tok`` with :data:`CHAT_TEMPLATE` as its chat template (in place; returned)."""
    tok.chat_template = CHAT_TEMPLATE
    return tok


WASHOUT = "planted-washout"
"""The planted model whose other tokens grow with the context length (:func:`planted_washout`,
``synthetic:planted-washout``)."""
WASHOUT_LAYER, WASHOUT_GAP, WASHOUT_WRITE = 1, 4.6, 5.0
"""``planted-washout``: the layer of its washing head, that head's score on ``<s>`` above every
other key, and what it writes on each unprotected dim where it attends to no ``<s>``."""


def planted_washout(seed: int = 0):
    """:func:`planted_llama` (BOS, 5 layers, planted at layer 2; prompts: :func:`planted_prompts`)
    with a *washing head*, head 2 of layer :data:`WASHOUT_LAYER` (the other head of its KV group
    silenced): its query reads the bias dim and its key the marker of ``<s>``, so query ``t`` gives
    ``<s>`` the share ``s_t = 1 / (1 + t e^{−Δ})`` (``Δ`` = :data:`WASHOUT_GAP`: 0.93 at 8 tokens,
    0.09 at 1,024); its value is ``ĥ_bias − (ĥ_3 + ĥ_11) / 2`` divided by the gains, exactly 0 for
    ``<s>`` (bias and marker 1) and ``1 / rms`` for every other token; its output writes
    :data:`WASHOUT_WRITE` times that on every unprotected dim. While ``<s>`` takes the attention
    (short inputs) the head writes almost nothing; in long inputs the share falls and every token
    gets about 4.5 on 28 of 32 dims, so the median ``|a|`` of a row passes ``<s>``'s massive value
    over 1,000 (the Sun criterion): ``<s>``'s own state is the same (causal attention), but it is
    no longer massive at 1,024 tokens. ``(hf_model, tokenizer, plant)``."""
    hf, tok, plant = planted_llama(seed=seed)
    cfg = hf.config
    lay = _Layer(hf.model.layers[WASHOUT_LAYER], cfg)
    hd, group = lay.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    slow, q, kv = hd // 2 - 1, _WRITER_HEAD * hd, (_WRITER_HEAD // group) * hd
    gain = lay.attn_norm.weight.detach() + lay.offset  # the effective pre-attention gains
    G, B = list(plant.gain_dims), plant.bias_dim
    protected = [B, *G, plant.massive_dim]
    with torch.no_grad():
        for w, start in ((lay.q, q), (lay.k, kv), (lay.v, kv)):
            w[start : start + hd] = 0.0
        lay.o[:, kv * group : kv * group + group * hd] = 0.0  # the heads of its KV group
        # q·k / sqrt(hd) = Δ on <s> (ĥ_B = g_B / rms, Σ_G ĥ = Σ_G g / rms; rms of <s> and a query ≈ 1)
        lay.q[q + slow, B] = hd**0.25 / float(gain[B])
        lay.k[kv + slow, G] = WASHOUT_GAP * hd**0.25 / float(gain[G].sum())
        lay.v[kv, B] = 1.0 / float(gain[B])
        lay.v[kv, G] = -0.5 / gain[G]
        out = torch.full((cfg.hidden_size,), WASHOUT_WRITE)
        out[protected] = 0.0
        lay.o[:, q] = out
    return hf, tok, plant
