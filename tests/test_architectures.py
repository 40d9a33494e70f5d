"""Every supported architecture computed right: tiny config-built Llama, Mistral, Qwen2 (q/k/v bias),
Qwen3 (q/k norm), Phi-3 (fused qkv / gate_up), Gemma 1 (gain ``1 + w``, sqrt(d) embedding scale, GeGLU,
Llama-style block), Gemma 2 and Gemma 3 (the same, plus sandwich norms).

The independent computation is always the plain HF model (an untouched deep copy, since booting the
bridge rewires the HF model it wraps): its logits, ``output_hidden_states`` and forward hooks on its own
modules, with weights edited *by hand* in its own storage layout (fused rows, stored ``w = g − 1``).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from me_interp import battery, edits, load_model, names, synthetic
from me_interp.architecture import ArchitectureError, describe_hf
from me_interp.interventions.core import attn_norm_gain
from me_interp.interventions.wemask import select_dims, we_mask
from me_interp.models import UnsupportedArchitectureError
from me_interp.probes import ffn_scan, find_me_layer, top_neurons

ARCHS = synthetic.ARCHS

#: What each family is, written from the HF modelling code (not from me_interp).
EXPECTED = {
    #         offset sandwich fused_qkv fused_gate_up qkv_bias qk_norm
    "llama": (0.0, False, False, False, False, False),
    "mistral": (0.0, False, False, False, False, False),
    "qwen2": (0.0, False, False, False, True, False),
    "qwen3": (0.0, False, False, False, False, True),
    "phi3": (0.0, False, True, True, False, False),
    "gemma": (1.0, False, False, False, False, False),
    "gemma2": (1.0, True, False, False, False, False),
    "gemma3": (1.0, True, False, False, False, True),
}
#: HF name of the pre-FFN norm of each family.
FFN_NORM = {a: "post_attention_layernorm" for a in ARCHS} | {
    "gemma2": "pre_feedforward_layernorm",
    "gemma3": "pre_feedforward_layernorm",
}


class Pair:
    """A loaded planted model, its untouched HF reference, the plant and the twin."""

    def __init__(self, arch: str) -> None:
        self.name = arch
        hf, tok, self.plant = synthetic.planted(arch)
        self.ref = copy.deepcopy(hf).eval()
        self.model = load_model(hf, tokenizer=tok, device="cpu")
        twin_hf, twin_tok, _ = synthetic.planted(arch, plant=False)
        self.twin = load_model(twin_hf, tokenizer=twin_tok, device="cpu")
        self.batch = self.model.tokenize(synthetic.planted_prompts(6, 9))
        self.offset = EXPECTED[arch][0]

    def ref_layer(self, layer: int):
        return self.ref.model.layers[layer]

    def ref_logits(self) -> torch.Tensor:
        with torch.no_grad():
            out = self.ref(input_ids=self.batch.tokens, attention_mask=self.batch.attention_mask)
        return out.logits

    def logits(self, fwd_hooks=()) -> torch.Tensor:
        return self.model.run_with_hooks(self.batch, fwd_hooks=fwd_hooks)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request) -> Pair:
    return Pair(request.param)


def _real(batch):
    return batch.attention_mask.bool()


def _close(a, b, batch, atol=2e-5):
    """Equal on the real (unpadded) tokens."""
    m = _real(batch)
    torch.testing.assert_close(a[m].float(), b[m].float(), atol=atol, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# the description
# ------------------------------------------------------------------------------------------


def test_architecture_is_described_from_the_model(pair):
    arch = pair.model.arch
    got = (
        arch.norm_offset,
        arch.sandwich,
        arch.fused_qkv,
        arch.fused_gate_up,
        arch.qkv_bias,
        arch.qk_norm,
    )
    assert got == EXPECTED[pair.name]
    assert arch.attn_norm == "input_layernorm" and arch.ffn_norm == FFN_NORM[pair.name]
    # GeGLU (tanh-approximated GELU gate) in every Gemma, SwiGLU elsewhere (the HF configs' defaults)
    assert arch.act_fn == ("gelu_pytorch_tanh" if pair.name.startswith("gemma") else "silu")
    assert (arch.post_ffn_norm is not None) == arch.sandwich
    emb = pair.ref.get_input_embeddings()
    want_scale = float(getattr(emb, "embed_scale", 1.0))  # Gemma: sqrt(d_model) = 5.657
    assert arch.embed_scale == pytest.approx(want_scale, rel=1e-6)
    assert pair.model.info()["arch"]["norm_offset"] == arch.norm_offset


def test_a_plain_hf_model_is_described_as_its_bridge(pair):
    """``describe_hf`` reads the same per-family facts (the TransformerLens adapter's mapping) off
    the plain HF model: the booted bridge's description; on a meta model (nnsight's remote models)
    the same but for the embedding scale, which needs weights (NaN)."""
    arch = describe_hf(pair.ref)
    assert arch == pair.model.arch
    assert (arch.layers, arch.attn, arch.ffn) == ("model.layers", "self_attn", "mlp")
    with torch.device("meta"):
        meta = type(pair.ref)(pair.ref.config)
    got = describe_hf(meta)
    assert math.isnan(got.embed_scale)
    assert dataclasses.replace(got, embed_scale=arch.embed_scale) == arch


def test_effective_gains_are_what_the_hf_norm_multiplies_by(pair):
    """``x / rms(x) ⊙ g`` computed with the accessor's ``g`` equals the HF norm module's output."""
    x = torch.randn(3, 5, pair.model.d_model, dtype=torch.float64)
    hat = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6)
    for L in range(pair.model.n_layers):
        lay = pair.ref_layer(L)
        for mod, g in (
            (lay.input_layernorm, pair.model.attn_norm_gain(L)),
            (getattr(lay, FFN_NORM[pair.name]), pair.model.ffn_norm_gain(L)),
        ):
            with torch.no_grad():
                want = mod(x.float()).double()
            torch.testing.assert_close(hat * g.double(), want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g, mod.weight.detach() + pair.offset)  # by hand
        # the plain-HF path (generation hooks) measures the same gain
        torch.testing.assert_close(attn_norm_gain(pair.ref, L), pair.model.attn_norm_gain(L))
    planted = pair.model.ffn_norm_gain(pair.plant.layer)[list(pair.plant.gain_dims)]
    assert planted.tolist() == [pair.plant.gain] * len(pair.plant.gain_dims)


# ------------------------------------------------------------------------------------------
# bridge vs HF: logits and every site
# ------------------------------------------------------------------------------------------


def _hf_sites(pair: Pair) -> dict[str, list[torch.Tensor]]:
    """Per-layer activations of the HF reference from its own modules' forward hooks."""
    arch = pair.model.arch
    got: dict[str, list[torch.Tensor]] = {}
    handles = []

    def keep(site):
        def fn(mod, args, out):
            got.setdefault(site, []).append((out[0] if isinstance(out, tuple) else out).detach())

        return fn

    for L in range(pair.model.n_layers):
        lay = pair.ref_layer(L)
        mods = {
            "attn_in": getattr(lay, arch.attn_norm),
            "ffn_in": getattr(lay, arch.ffn_norm),
            "attn_own": lay.self_attn,
            "ffn_own": lay.mlp,
            "resid_post": lay,
        }
        if arch.post_ffn_norm is not None:
            mods["attn_out"] = getattr(lay, arch.post_attn_norm)
            mods["ffn_out"] = getattr(lay, arch.post_ffn_norm)
        for site, mod in mods.items():
            handles.append(mod.register_forward_hook(keep(site)))
    try:
        with torch.no_grad():
            out = pair.ref(
                input_ids=pair.batch.tokens,
                attention_mask=pair.batch.attention_mask,
                output_hidden_states=True,
            )
    finally:
        for h in handles:
            h.remove()
    got["hidden_states"] = list(out.hidden_states)
    got["logits"] = [out.logits]
    return got


def test_bridge_equals_hf_logits_and_sites(pair):
    model, batch = pair.model, pair.batch
    hf = _hf_sites(pair)
    sites = ["attn_in", "ffn_in", "attn_own", "ffn_own", "attn_out", "ffn_out", "resid_post"]
    sites += ["resid_pre"]
    hooks, cache = [], {}

    def keep(x, hook, key):
        cache[key] = x.detach().clone()
        return x

    from functools import partial

    for L in range(model.n_layers):
        for s in sites:
            hooks.append((names.site(s, L), partial(keep, key=(s, L))))
    logits = model.run_with_hooks(batch, fwd_hooks=hooks)
    _close(logits, hf["logits"][0], batch, atol=1e-4)
    for L in range(model.n_layers):
        # HF hidden_states[L] is the input of layer L (the last one is after the final norm)
        _close(cache[("resid_pre", L)], hf["hidden_states"][L], batch)
        _close(cache[("resid_post", L)], hf["resid_post"][L], batch)
        for s in ("attn_in", "ffn_in", "attn_own", "ffn_own"):
            _close(cache[(s, L)], hf[s][L], batch)
        if model.arch.sandwich:
            _close(cache[("attn_out", L)], hf["attn_out"][L], batch)
            _close(cache[("ffn_out", L)], hf["ffn_out"][L], batch)
            # the residual contribution is not the FFN's own output on a sandwich block
            assert not torch.allclose(cache[("ffn_out", L)], cache[("ffn_own", L)])
        else:
            assert torch.equal(cache[("ffn_out", L)], cache[("ffn_own", L)])
            assert torch.equal(cache[("attn_out", L)], cache[("attn_own", L)])
        mid = cache[("resid_pre", L)] + cache[("attn_out", L)]
        _close(cache[("resid_post", L)], mid + cache[("ffn_out", L)], batch, atol=1e-3)


# ------------------------------------------------------------------------------------------
# me_interp's edits vs the same edit made by hand in the HF weights
# ------------------------------------------------------------------------------------------


def _ref_ffn_rows(pair: Pair, layer: int):
    """(gate, up, down) of the reference layer, as views into its own (possibly fused) storage."""
    mlp = pair.ref_layer(layer).mlp
    if hasattr(mlp, "gate_up_proj"):
        w = mlp.gate_up_proj.weight
        n = w.shape[0] // 2
        return w[:n], w[n:], mlp.down_proj.weight
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


def _ref_restored(pair: Pair):
    """Snapshot of the reference weights, to restore after a hand edit."""
    return {k: v.clone() for k, v in pair.ref.state_dict().items()}


def test_gain_edits_write_gain_minus_offset(pair):
    model, L = pair.model, pair.plant.layer
    g = model.ffn_norm_gain(L).clone()
    perm = edits.top_dims_permutation(g, 2, seed=1)
    saved = _ref_restored(pair)
    norm = getattr(pair.ref_layer(L), FFN_NORM[pair.name])
    try:
        for edit, want_gain in (
            (edits.permuted_gain(model, L, perm), g[perm]),
            (edits.flattened_gain(model, L, 0.25), g.mean() + 0.25 * (g - g.mean())),
        ):
            with torch.no_grad():
                norm.weight.copy_(want_gain - pair.offset)  # the stored weight, by hand
            with edit:
                torch.testing.assert_close(model.ffn_norm_gain(L), want_gain)
                _close(pair.logits(), pair.ref_logits(), pair.batch, atol=1e-4)
            pair.ref.load_state_dict(saved)
    finally:
        pair.ref.load_state_dict(saved)
    torch.testing.assert_close(model.ffn_norm_gain(L), g)
    # the top-|g| dims are the planted gain dims (never the top-|w| of the stored weight on Gemma)
    assert sorted(edits.top_dims(g, 2)) == sorted(pair.plant.gain_dims)


def test_ffn_edits_match_hand_edits_in_the_hf_layout(pair):
    """Neuron ablation and a rank-1 SVD ablation of ``W_up`` written through ``ffn_weights()`` (split
    views on Phi-3) equal the same edit in the HF storage (rows of the fused ``gate_up_proj``)."""
    model, L, n = pair.model, pair.plant.layer, pair.plant.neuron
    saved = _ref_restored(pair)
    try:
        gate, up, down = _ref_ffn_rows(pair, L)
        with torch.no_grad():
            gate[n] = 0.0
            up[n] = 0.0
            down[:, n] = 0.0
        with edits.neurons_ablated(model, L, [n]):
            _close(pair.logits(), pair.ref_logits(), pair.batch, atol=1e-4)
            if model.arch.fused_gate_up:  # the split view wrote the fused HF weight
                fused = model.hf.model.layers[L].mlp.original_component.gate_up_proj.weight
                rows = fused.detach()[[n, model.d_mlp + n]]
                assert float(rows.abs().sum()) == 0.0
        pair.ref.load_state_dict(saved)
        gate, up, down = _ref_ffn_rows(pair, L)
        U, S, Vh = torch.linalg.svd(up.detach().double(), full_matrices=False)
        with torch.no_grad():
            up.copy_((up.double() - S[0] * torch.outer(U[:, 0], Vh[0])).float())
        with edits.svd_ablated(model, L, "up", 1):
            _close(pair.logits(), pair.ref_logits(), pair.batch, atol=1e-4)
    finally:
        pair.ref.load_state_dict(saved)
    _close(pair.logits(), pair.ref_logits(), pair.batch, atol=1e-4)  # restored


def _path_modules(part: str, arch: str) -> list[str]:
    """The HF modules of composite ``part`` in ``arch``, written from the HF modelling code: the
    sub-layer with its norms, from the residual stream back into it (on Gemma 2/3 the post-norm too;
    docs/weight_experiments.md, "Sandwich-norm models")."""
    sandwich = EXPECTED[arch][1]
    if part == "ffn_path":
        return [FFN_NORM[arch], "mlp"] + (["post_feedforward_layernorm"] if sandwich else [])
    return ["input_layernorm", "self_attn"] + (["post_attention_layernorm"] if sandwich else [])


def _hand_swap(pair: Pair, a: int, b: int, modules: list[str]) -> None:
    """Exchange the HF modules ``modules`` of reference layers ``a`` and ``b`` in place."""
    la, lb = pair.ref_layer(a), pair.ref_layer(b)
    for name in modules:
        mod_a, mod_b = getattr(la, name), getattr(lb, name)
        sa = {k: v.clone() for k, v in mod_a.state_dict().items()}
        mod_a.load_state_dict(mod_b.state_dict())
        mod_b.load_state_dict(sa)


@pytest.mark.parametrize("part", ["ffn_path", "attn_path"])
def test_path_swap_matches_a_hand_swap(pair, part):
    """``ffn_path`` / ``attn_path`` of layers 1 and 3 swapped equals swapping their HF modules by hand:
    the pre-norm and the sub-layer, and on Gemma 2/3 the post-norm too. Without the post-norm the
    hand swap differs there (so the comparison can tell the two definitions apart)."""
    model = pair.model
    saved = _ref_restored(pair)
    modules = _path_modules(part, pair.name)
    try:
        _hand_swap(pair, 1, 3, modules)
        with edits.swapped_layers(model, 1, 3, part=part):
            _close(pair.logits(), pair.ref_logits(), pair.batch, atol=1e-4)
            if model.arch.sandwich:
                _hand_swap(pair, 1, 3, modules[-1:])  # back: the post-norms in their own layers
                m = _real(pair.batch)
                assert not torch.allclose(pair.logits()[m], pair.ref_logits()[m], atol=1e-3)
    finally:
        pair.ref.load_state_dict(saved)


def test_block_swap_matches_a_hand_swap_of_the_whole_layer(pair):
    """``block`` moves every parameter of the decoder layer: on Gemma 2/3 all four norms (pre- and
    post-attention, pre- and post-FFN), with the attention and the FFN."""
    model = pair.model
    saved = _ref_restored(pair)
    try:
        a, b = pair.ref_layer(1), pair.ref_layer(3)
        sa = {k: v.clone() for k, v in a.state_dict().items()}
        a.load_state_dict(b.state_dict())
        b.load_state_dict(sa)
        n_norms = sum(k.endswith("layernorm.weight") for k in sa)
        assert n_norms == (4 if model.arch.sandwich else 2)
        with edits.swapped_layers(model, 1, 3, part="block"):
            _close(pair.logits(), pair.ref_logits(), pair.batch, atol=1e-4)
    finally:
        pair.ref.load_state_dict(saved)


# ------------------------------------------------------------------------------------------
# WeMask with the effective gain
# ------------------------------------------------------------------------------------------


def test_wemask_masks_the_top_effective_gain_dims_by_hand(pair):
    model, L, rate = pair.model, 3, 0.125  # 4 of 32 dims
    # a gain whose top-|g| dims differ from the top-|g - 1| dims (what a raw-w reading would pick)
    g = torch.ones(model.d_model)
    g[[1, 2, 4, 5]] = torch.tensor([3.0, -2.5, 2.2, 2.0])  # top |g|
    g[[8, 9, 10, 12]] = torch.tensor([-1.9, -1.8, -1.7, -1.6])  # top |g - 1| together with 1, 2
    with edits.set_gain(model, L, g, norm="attn"):
        dims = select_dims(model, L, "weight", rate)
        assert dims.tolist() == [1, 2, 4, 5]
        hooks = we_mask(model, rate, "weight", layers=[L])
        got = {}

        def keep(x, hook):
            got["x"] = x.detach().clone()
            return x

        model.run_with_hooks(pair.batch, fwd_hooks=[*hooks, (names.attn_in(L), keep)])
        with torch.no_grad():  # by hand: the HF norm with the stored weight g - offset
            saved = _ref_restored(pair)
            pair.ref_layer(L).input_layernorm.weight.copy_(g - pair.offset)
            cap = {}
            h = pair.ref_layer(L).input_layernorm.register_forward_hook(
                lambda m, a, o: cap.setdefault("x", o.detach().clone())
            )
            try:
                pair.ref(input_ids=pair.batch.tokens, attention_mask=pair.batch.attention_mask)
            finally:
                h.remove()
                pair.ref.load_state_dict(saved)
    want = cap["x"].clone()
    want[:, 0, [1, 2, 4, 5]] = 0.0
    _close(got["x"], want, pair.batch)
    assert bool((got["x"][:, 1:] != 0).any(-1).all())  # other positions untouched


# ------------------------------------------------------------------------------------------
# the planted mechanism, found in every architecture; none in its twin
# ------------------------------------------------------------------------------------------


def test_planted_mechanism_found_and_twin_shows_none(pair):
    plant, model = pair.plant, pair.model
    loc = find_me_layer(model, pair.batch)
    assert loc.me_layer == plant.layer and loc.me_event.site == "ffn"
    assert loc.massive_dims == [plant.massive_dim]
    assert loc.massive_positions == [[0]] * len(pair.batch)
    scan = ffn_scan(model, pair.batch)
    assert top_neurons(model, scan, plant.layer, top=1).neurons == [plant.neuron]
    # neuron shares are of the FFN's own output y = W_down a: they sum to 1 on every architecture
    from me_interp.probes.ffn import neuron_contributions

    shares = neuron_contributions(scan.act_at_ref[plant.layer], model.ffn_weights(plant.layer).down)
    torch.testing.assert_close(shares.sum(-1), torch.ones(len(pair.batch)), atol=1e-4, rtol=0)
    mag = scan.magnification()  # [layer batch], on the FFN's own output
    assert int(mag.mean(-1).argmax()) == plant.layer
    res = scan.magnification_residual()
    assert (res is not None) == model.arch.sandwich
    if res is not None:  # both measured; the post-FFN norm changes the magnitude
        assert not torch.allclose(res, mag)
    twin = find_me_layer(pair.twin, pair.twin.tokenize(synthetic.planted_prompts(6, 9)))
    assert twin.me_layer is None and twin.massive_dims == []


# ------------------------------------------------------------------------------------------
# refused architectures
# ------------------------------------------------------------------------------------------


def _tiny(cls_cfg, cls_model, **extra):
    cfg = cls_cfg(
        vocab_size=synthetic.vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    torch.manual_seed(0)
    return cls_model(cfg).eval()


@pytest.mark.parametrize(
    "kind, match",
    [("olmo2", "post-norm"), ("mixtral", "mixture of experts")],
)
def test_post_norm_and_moe_are_refused(kind, match):
    import transformers as T

    if kind == "olmo2":
        hf = _tiny(T.Olmo2Config, T.Olmo2ForCausalLM)
    else:
        hf = _tiny(
            T.MixtralConfig, T.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2
        )
    with pytest.raises(ArchitectureError, match=match):
        describe_hf(hf)  # the plain model, before a bridge rewires it
    with pytest.raises(UnsupportedArchitectureError, match=match):
        load_model(hf, tokenizer=synthetic.word_tokenizer(), device="cpu")


# ------------------------------------------------------------------------------------------
# the whole battery on a sandwich-norm architecture
# ------------------------------------------------------------------------------------------

#: Where planted Gemma 3 must differ from planted Llama (tests/test_verdict_meta.PLANTED), and why.
#: Its post-FFN RMSNorm rescales the FFN's own output to a fixed norm before it joins the residual
#: stream, and that output is the planted neuron's write on the massive dim (the other neurons' are
#: tiny at HF's 0.02 init): every edit that only *shrinks* that write leaves its direction, so the
#: post-norm restores the massive activation; only edits that remove it (the neuron, W_down's top
#: direction, the FFN output itself) or move it (the pair, the block) act.
GEMMA3_VS_LLAMA = {
    "rmsnorm_permutation.ffn_permutation_removes": "fails",
    "rmsnorm_permutation.top_dims_removes": "fails",
    "rmsnorm_permutation.flatten_removes": "fails",
    "ffn_svd_ablation.svd_gate_removes": "fails",
    "ffn_svd_ablation.svd_up_removes": "fails",
    "component_ablation.flatten_gain": "fails",
    # the FFN alone, without the boosted gain, still writes (a smaller) massive-dim output: with 4
    # partners and 2 targets that is inconclusive, as every swap and patch claim of planted Llama
    #
    # The sink heads (L3h0, L4h0, as on Llama) restore less of the output: the first_token
    # corruption also changes token 0 in the blocks before the ME layer, and with the sqrt(d)
    # embedding scale that change reaches the output through every head and the residual stream
    # (measured: KL(clean ‖ corrupt) 0.0045 nats against Llama's 8e-7), so the two heads
    # restore 0.42 [0.35, 0.54] of it (Llama 0.89), which straddles its threshold; the random heads
    # they are compared with are non-sink heads, which restore nothing, so they beat them (holds)
    "activation_patching.sink_heads_restore": "inconclusive",
    # the moved component draws the sink heads 0.9997 of their attention in every prompt (Llama:
    # values that differ from prompt to prompt): 2 distinct values, fewer than 'min_units'
    "transplant.sink_follows": "inconclusive",
    "transplant.second_sink": "inconclusive",
}


#: Measured, Gemma 2 against Gemma 3: the attention entropy after the ME layer drops by 0.156
#: [0.151, 0.160] of its value before (Gemma 3: 0.25), short of the 0.2 threshold, although the sink
#: itself is the same (``sink_downstream`` 1 [1, 1]). Not the attention-logit soft cap nor the query
#: scale (each set to Gemma 3's value leaves 0.156); the cause is not pinned down (untested: q/k norms).
GEMMA2_VS_GEMMA3 = {
    "attention_sinks.entropy_drop": "fails",
    # the same first_token effect (KL 0.0040 nats) with weaker sink heads (attention to p 0.82-0.89,
    # Gemma 3 0.998): they restore 0.36 [0.30, 0.47], below the 0.5 of `restore`
    "activation_patching.sink_heads_restore": "fails",
    "activation_patching.sink_heads_beat_random": "inconclusive",
    # the moved component's sink varies from prompt to prompt, as on Llama: decided
    "transplant.sink_follows": "holds",
    "transplant.second_sink": "holds",
}

#: The whole battery runs on the planted model of every architecture (Llama's in test_verdict_meta).
BATTERY_ARCHS = tuple(a for a in synthetic.ARCHS if a != "llama")


@pytest.mark.slow  # end to end: the whole battery, per architecture
@pytest.mark.parametrize("arch", BATTERY_ARCHS)
def test_battery_on_planted_model_finds_what_was_planted(arch, tmp_path):
    """Every claim of the battery gets the verdict planted Llama gets (``test_verdict_meta.PLANTED``,
    reasoned claim by claim), except on sandwich-norm models where the post-FFN norm changes
    exactly the claims of :data:`GEMMA3_VS_LLAMA`."""
    import importlib.util
    import json
    from pathlib import Path

    from me_interp import __main__ as cli
    from me_interp import falsifiability, io, report

    spec = importlib.util.spec_from_file_location(
        "_verdict_meta", Path(__file__).with_name("test_verdict_meta.py")
    )
    meta = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(meta)  # the planted Llama's expected verdicts, claim by claim
    PLANTED = meta.PLANTED

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(falsifiability.prompts("synthetic:planted")) + "\n")
    out = tmp_path / "out"
    argv = ["--model", f"synthetic:planted-{arch}", "--prompts", str(prompts), "--out", str(out)]
    assert cli.main(argv) == 0
    state = json.loads((out / report.STATE_FILE).read_text())
    got = {
        c["id"]: c["verdict"]
        for name in battery.NAMES
        for c in state["experiments"][name]["claims"]
    }
    sandwich = arch in ("gemma2", "gemma3")
    want = {**PLANTED, **GEMMA3_VS_LLAMA} if sandwich else dict(PLANTED)
    if arch == "gemma2":
        want.update(GEMMA2_VS_GEMMA3)
    # only synthetic:planted's tokenizer has a chat template, and the CLI's one long input (the
    # default --long-rows 1) cannot decide a k-of-n claim; test_verdict_meta runs 16 on Llama
    want.update(
        {"conditions.chat_first": "not applicable", "conditions.long_first": "inconclusive"}
    )
    wrong = {i: (got.get(i), v) for i, v in want.items() if got.get(i) != v}
    assert not wrong, f"(got, expected): {wrong}"
    from me_interp.experiments import me_layer, mechanism

    me = io.read_result(me_layer.Result, next((out / "me_layer").glob("*/")))
    assert (me.me_layer, me.location.massive_dims, me.me_site) == (2, [7], "ffn")
    # the site table reports the FFN's own output beside its residual contribution
    ratios = me.location.site_ratios
    mech = io.read_result(mechanism.Result, next((out / "mechanism").glob("*/")))
    assert mech.neurons.neurons[0].neuron == 5
    if sandwich:
        assert ratios["ffn_own"][2] != ratios["ffn_out"][2]
        assert mech.layers[2].magnification_residual is not None
    else:
        assert mech.layers[2].magnification_residual is None


# ------------------------------------------------------------------------------------------
# dtypes
# ------------------------------------------------------------------------------------------

#: Measured on the bundled model, 16 built-in prompts, CPU (bf16 / fp16 against fp32): the ME-layer
#: jump within 0.4% / 0.2%, the per-layer max-token ratio within 1.6% / 0.4%, max |a| / median |a|
#: within 5.8% / 0.5%. The bounds below leave about 2x room.
DTYPE_TOL = {"bfloat16": (0.01, 0.03, 0.12), "float16": (0.005, 0.01, 0.02)}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_finds_the_same_me_layer_on_the_bundled_model(bundled, dtype):
    import numpy as np

    from me_interp.prompts import builtin_prompts

    batch = bundled.tokenize(builtin_prompts()[:16])
    ref = find_me_layer(bundled, batch)
    low_model = load_model(bundled, dtype=dtype)
    low = find_me_layer(low_model, batch)
    del low_model
    assert (low.me_layer, low.massive_dims, low.massive_positions) == (
        ref.me_layer,
        ref.massive_dims,
        ref.massive_positions,
    )
    assert low.me_event.site == ref.me_event.site == "ffn"
    jump_tol, ratio_tol, mom_tol = DTYPE_TOL[dtype]
    assert low.me_event.jump == pytest.approx(ref.me_event.jump, rel=jump_tol)
    r = np.array(low.top_ratio) / np.array(ref.top_ratio)
    assert np.abs(r - 1).max() < ratio_tol
    m = np.array(low.max_over_median) / np.array(ref.max_over_median)
    assert np.abs(m - 1).max() < mom_tol


def test_float16_overflow_stops_with_the_message():
    """A planted activation of ~1e5 > 65504 (fp16's largest value) is inf in fp16: the scan stops and
    says so; the same model in bfloat16 (fp32's range) finds it."""
    hf, tok, plant = synthetic.planted("llama", down_scale=400.0)  # a ≈ 256 → 1e5 on the dim
    model = load_model(hf, tokenizer=tok, device="cpu")
    batch = model.tokenize(synthetic.planted_prompts(4, 8))
    fp16 = load_model(model, dtype="float16")
    with pytest.raises(FloatingPointError, match="fp16 overflows above 65504"):
        find_me_layer(fp16, batch)
    bf16 = load_model(model, dtype="bfloat16")
    assert find_me_layer(bf16, batch).me_layer == plant.layer


def test_a_cast_fused_model_keeps_split_views_on_the_fused_weights():
    """After ``load_model(model, dtype=...)`` a Phi-3's split gate/up and q/k/v still share storage
    with the fused HF weights, so an edit through either is seen by the bridge's forward."""
    model = load_model("synthetic:planted-phi3", device="cpu")
    bf16 = load_model(model, dtype="bfloat16")
    for L in range(bf16.n_layers):
        blk = bf16.bridge.blocks[L]
        fused = blk.mlp.original_component.gate_up_proj.weight
        w = bf16.ffn_weights(L)
        assert w.gate.data_ptr() == fused.data_ptr()
        assert w.up.data_ptr() == fused[bf16.d_mlp :].data_ptr()
        qkv = blk.attn.original_component.qkv_proj.weight
        assert blk.attn.q.original_component.weight.data_ptr() == qkv.data_ptr()
    batch = bf16.tokenize(synthetic.planted_prompts(2, 6))
    before = bf16.run_with_hooks(batch)
    with edits.swapped_layers(bf16, 1, 2, part="ffn"):  # writes the fused HF gate_up_proj
        assert not torch.equal(bf16.run_with_hooks(batch), before)
