"""swapped_layers / patched_weights: positive (moves exactly the part), negative (nothing else), reference
forward (an HF copy edited by hand gives the same logits), bit-identical restore (also after an
exception, also for the composite parts ffn_path / attn_path), planted answers, bad inputs; on the
sandwich-norm Gemma 2/3 the paths carry the post-norms (hand-edited HF reference) and the weight
experiments record the modules each part moved."""

from __future__ import annotations

import pytest
import torch

from me_interp import claims, edits, io, load_model, synthetic
from me_interp.edits import core
from me_interp.experiments import weight_patching, weight_swap
from me_interp.probes import find_me_layer

HF_PART = {
    "attn_norm": ("input_layernorm",),
    "ffn_norm": ("post_attention_layernorm",),
    "ffn": ("mlp",),
    "attn": ("self_attn",),
    "ffn_path": ("post_attention_layernorm", "mlp"),
    "attn_path": ("input_layernorm", "self_attn"),
}
HF_PART_SANDWICH = {
    "ffn": ("mlp",),
    "ffn_norm": ("pre_feedforward_layernorm",),
    "post_ffn_norm": ("post_feedforward_layernorm",),
    "post_attn_norm": ("post_attention_layernorm",),
    "ffn_path": ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
    "attn_path": ("input_layernorm", "self_attn", "post_attention_layernorm"),
}
"""The HF modules of Gemma 2/3 each part must move (written from the HF Gemma decoder layers)."""
SANDWICH = ("gemma2", "gemma3")


@pytest.fixture(scope="module", params=SANDWICH)
def sandwich(request):
    """(arch, LoadedModel, Plant) of a planted tiny Gemma 2 / Gemma 3: post-FFN gain 400 on the
    massive dim in every layer, other norm gains differing between layers."""
    hf, tok, plant = synthetic.planted(request.param)
    return request.param, load_model(hf, tokenizer=tok, device="cpu"), plant


@pytest.mark.parametrize("part", edits.PARTS)
def test_swap_positive_and_negative(planted, snap, changed_ptrs, part):
    model, _ = planted  # its norm gains differ between layers (a fresh tiny Llama's are all 1)
    pa, pb = edits.part_parameters(model, 0, part), edits.part_parameters(model, 3, part)
    a0 = {n: p.detach().clone() for n, p in pa.items()}
    b0 = {n: p.detach().clone() for n, p in pb.items()}
    before = snap(model)
    with edits.swapped_layers(model, 0, 3, part):
        for n in pa:
            assert torch.equal(pa[n].detach(), b0[n])
            assert torch.equal(pb[n].detach(), a0[n])
        touched = {p.data_ptr() for p in [*pa.values(), *pb.values()]}
        assert changed_ptrs(model, before) <= touched  # nothing outside the part moved
        assert changed_ptrs(model, before)  # and the part did (random layers differ)


def _hf_logits(hf, batch):
    with torch.no_grad():
        return hf(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits


@pytest.mark.parametrize("part", ["ffn", "block", "ffn_path", "attn_path"])
def test_swap_matches_a_hand_edited_hf_reference(planted, part):
    """An independent HF copy with the weights swapped by hand gives the same logits."""
    model, _ = planted  # its norm gains differ between layers, so a norm swap changes the logits
    ref, _, _ = synthetic.planted_llama()  # same seed: the same weights, a plain HF model
    layers = ref.model.layers
    with torch.no_grad():
        if part == "block":
            mods = [(layers[0], layers[2])]
        else:
            mods = [(getattr(layers[0], m), getattr(layers[2], m)) for m in HF_PART[part]]
        for ma, mb in mods:
            for (na, pa), (nb, pb) in zip(ma.named_parameters(), mb.named_parameters()):
                assert na == nb
                tmp = pa.detach().clone()
                pa.copy_(pb)
                pb.copy_(tmp)
    batch = model.tokenize(synthetic.planted_prompts(3))
    with edits.swapped_layers(model, 0, 2, part):
        got = model.run_with_hooks(batch)
    want = _hf_logits(ref, batch)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # measured: bit-identical
    unedited = model.run_with_hooks(batch)
    assert (unedited - want).abs().max() > 1e-5  # the swap did change the logits (attn_path: 1e-4)


def test_planted_swap_answers(planted, planted_prompts):
    """Construction: the massive activation needs gain dims (ffn_norm) and neuron 5 (ffn) in one layer,
    so the pair (ffn_path) moves it and either half alone makes it vanish."""
    model, plant = planted
    batch = model.tokenize(planted_prompts)
    L = plant.layer
    for partner in (0, 4):
        for part in ("block", "ffn_path"):  # gain and neuron travel together: the emergence moves
            with edits.swapped_layers(model, L, partner, part):
                assert find_me_layer(model, batch).me_layer == partner
        for part in (
            "ffn",
            "ffn_norm",
        ):  # each alone splits gain from neuron: no massive activation
            with edits.swapped_layers(model, L, partner, part):
                assert find_me_layer(model, batch).me_layer is None
        for part in (
            "attn",
            "attn_norm",
            "attn_path",
        ):  # the same sink head everywhere: nothing moves
            with edits.swapped_layers(model, L, partner, part):
                assert find_me_layer(model, batch).me_layer == L
    assert find_me_layer(model, batch).me_layer == L


@pytest.mark.parametrize("composite", sorted(edits.COMPOSITE_PARTS))
@pytest.mark.parametrize("which", ["llama", "sandwich"])
def test_composite_part_is_the_union_of_its_single_parts(planted, sandwich, composite, which):
    model = planted[0] if which == "llama" else sandwich[1]
    members = core.part_members(model, composite)
    got = edits.part_parameters(model, 2, composite)
    want = {
        f"{single}.{name}": p
        for single in members
        for name, p in edits.part_parameters(model, 2, single).items()
    }
    assert list(got) == list(want)
    assert all(got[n] is want[n] for n in got)  # the live parameters, not copies
    assert composite in edits.PARTS and edits.check_part(composite) == composite
    post = "post_ffn_norm" if composite == "ffn_path" else "post_attn_norm"
    assert members == edits.COMPOSITE_PARTS[composite][: 3 if which == "sandwich" else 2]
    assert (post in members) == (which == "sandwich")


@pytest.mark.parametrize("part", sorted(edits.COMPOSITE_PARTS))
@pytest.mark.parametrize("kind", ["swap", "patch", "patch_from_twin"])
def test_composite_edits_restore_bit_identical_after_exception(
    planted, twin, snap, changed, part, kind
):
    model, plant = planted
    twin_model, _ = twin
    edit = {
        "swap": lambda: edits.swapped_layers(model, plant.layer, 0, part),
        "patch": lambda: edits.patched_weights(model, plant.layer, 0, part),
        "patch_from_twin": lambda: edits.patched_weights(
            model, 0, plant.layer, part, source_model=twin_model
        ),
    }[kind]
    before, before_twin = snap(model), snap(twin_model)
    with edit():
        assert changed(model, before)
    assert changed(model, before) == set()
    with pytest.raises(RuntimeError, match="boom"):
        with edit():
            assert changed(model, before)
            raise RuntimeError("boom")
    assert changed(model, before) == set()
    assert changed(twin_model, before_twin) == set()  # the source is never written


def test_swap_bad_inputs(tiny_llama):
    with pytest.raises(ValueError, match="with itself"):
        with edits.swapped_layers(tiny_llama, 1, 1, "ffn"):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with edits.swapped_layers(tiny_llama, 1, 9, "ffn"):
            pass
    with pytest.raises(ValueError, match="unknown component"):
        with edits.swapped_layers(tiny_llama, 0, 1, "mlp"):
            pass


def test_patch_positive_and_negative(tiny_llama, snap, changed_ptrs):
    model = tiny_llama
    src = {n: p.detach().clone() for n, p in edits.part_parameters(model, 1, "attn").items()}
    tgt = edits.part_parameters(model, 2, "attn")
    before = snap(model)
    with edits.patched_weights(model, 1, 2, "attn"):
        for n, p in tgt.items():
            assert torch.equal(p.detach(), src[n])
        assert changed_ptrs(model, before) == {p.data_ptr() for p in tgt.values()}
    assert changed_ptrs(model, before) == set()


def test_patch_from_second_model_creates_the_planted_mechanism(
    planted, twin, planted_prompts, snap, changed
):
    model, plant = planted
    twin_model, _ = twin
    batch = twin_model.tokenize(planted_prompts)
    assert find_me_layer(twin_model, batch).me_layer is None
    before_src = snap(model)
    with edits.patched_weights(twin_model, plant.layer, plant.layer, "block", source_model=model):
        assert find_me_layer(twin_model, batch).me_layer == plant.layer
    assert find_me_layer(twin_model, batch).me_layer is None
    assert changed(model, before_src) == set()  # the source is never written
    # the pair alone carries the mechanism over; either half alone does not
    with edits.patched_weights(
        twin_model, plant.layer, plant.layer, "ffn_path", source_model=model
    ):
        assert find_me_layer(twin_model, batch).me_layer == plant.layer
    for part in ("ffn", "ffn_norm"):
        with edits.patched_weights(twin_model, plant.layer, plant.layer, part, source_model=model):
            assert find_me_layer(twin_model, batch).me_layer is None
    # the unplanted layer copied into the planted model removes the mechanism
    with edits.patched_weights(model, plant.layer, plant.layer, "ffn", source_model=twin_model):
        assert find_me_layer(model, model.tokenize(planted_prompts)).me_layer is None


def test_patch_bad_inputs(tiny_llama, tiny_qwen3):
    with pytest.raises(ValueError, match="onto itself"):
        with edits.patched_weights(tiny_llama, 2, 2, "ffn"):
            pass
    with pytest.raises(ValueError, match="different parameters"):
        with edits.patched_weights(tiny_llama, 0, 0, "attn", source_model=tiny_qwen3):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with edits.patched_weights(tiny_llama, 0, 7, "ffn"):
            pass


# ------------------------------------------------------------------------------------------
# sandwich-norm models (Gemma 2/3): the paths carry the post-norms
# ------------------------------------------------------------------------------------------


def test_sandwich_swap_positive_and_negative(sandwich, snap, changed_ptrs):
    _, model, _ = sandwich
    for part in core.model_parts(model):  # PARTS and the two post-norms
        pa, pb = edits.part_parameters(model, 0, part), edits.part_parameters(model, 3, part)
        b0 = {n: p.detach().clone() for n, p in pb.items()}
        before = snap(model)
        with edits.swapped_layers(model, 0, 3, part):
            assert all(torch.equal(pa[n].detach(), b0[n]) for n in pa), part
            touched = {p.data_ptr() for p in [*pa.values(), *pb.values()]}
            assert changed_ptrs(model, before) <= touched, part
            assert changed_ptrs(model, before), part
        assert changed_ptrs(model, before) == set(), part


def _hand_swapped(arch: str, modules: tuple[str, ...] | None, a: int, b: int):
    """A fresh HF copy of the planted ``arch`` model with ``modules`` of layers a, b swapped by hand
    (``None``: the whole decoder layer)."""
    ref, _, _ = synthetic.planted(arch)  # same seed: the same weights, a plain HF model
    layers = ref.model.layers
    pairs = (
        [(layers[a], layers[b])]
        if modules is None
        else [(getattr(layers[a], m), getattr(layers[b], m)) for m in modules]
    )
    with torch.no_grad():
        for ma, mb in pairs:
            for (na, pa), (nb, pb) in zip(ma.named_parameters(), mb.named_parameters()):
                assert na == nb
                tmp = pa.detach().clone()
                pa.copy_(pb)
                pb.copy_(tmp)
    return ref


@pytest.mark.parametrize("part", [*HF_PART_SANDWICH, "block"])
def test_sandwich_swap_matches_a_hand_edited_hf_reference(sandwich, part):
    """me_interp's swap of ``part`` on Gemma 2/3 gives the logits of an HF copy whose modules
    (HF_PART_SANDWICH: ffn_path = pre_feedforward_layernorm + mlp + post_feedforward_layernorm) were
    swapped by hand; for ffn_path that differs from swapping the pre-norm and the FFN only."""
    arch, model, _ = sandwich
    batch = model.tokenize(synthetic.planted_prompts(3))
    with edits.swapped_layers(model, 0, 2, part):
        got = model.run_with_hooks(batch)
    want = _hf_logits(_hand_swapped(arch, HF_PART_SANDWICH.get(part), 0, 2), batch)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # measured: bit-identical
    assert (model.run_with_hooks(batch) - want).abs().max() > 1e-3  # the swap changed the logits
    if part == "ffn_path":  # the post-FFN norm travelled too (measured difference ~1e-2)
        pre_only = _hf_logits(_hand_swapped(arch, HF_PART_SANDWICH["ffn_path"][:2], 0, 2), batch)
        assert (got - pre_only).abs().max() > 1e-3


def test_sandwich_planted_swap_answers(sandwich, planted_prompts):
    """Construction: every layer's post-FFN norm has the same gain (400) on the massive dim, and only
    layer L has the neuron that writes it; so the FFN path (with or without the rest of the block)
    moves the emergence, while the post-FFN norm alone and the attention parts move nothing."""
    _, model, plant = sandwich
    batch = model.tokenize(planted_prompts)
    L = plant.layer
    assert find_me_layer(model, batch).me_layer == L
    for partner in (0, 4):
        for part in ("block", "ffn_path"):
            with edits.swapped_layers(model, L, partner, part):
                assert find_me_layer(model, batch).me_layer == partner, part
        for part in ("post_ffn_norm", "attn_path", "post_attn_norm"):
            with edits.swapped_layers(model, L, partner, part):
                assert find_me_layer(model, batch).me_layer == L, part
    assert find_me_layer(model, batch).me_layer == L


def test_sandwich_parts_between_architectures(planted, sandwich):
    """A post-norm part is refused on Llama with the architecture named, in a swap and in a patch
    from a Gemma model; ffn_path differs in its parameters between the two and is refused too."""
    llama, _ = planted
    _, gemma, _ = sandwich
    with pytest.raises(ValueError, match="LlamaForCausalLM .* has no such norm"):
        with edits.swapped_layers(llama, 0, 1, "post_ffn_norm"):
            pass
    with pytest.raises(ValueError, match="LlamaForCausalLM .* has no such norm"):
        with edits.patched_weights(llama, 0, 0, "post_attn_norm", source_model=gemma):
            pass
    with pytest.raises(ValueError, match="different parameters"):
        with edits.patched_weights(llama, 0, 0, "ffn_path", source_model=gemma):
            pass


def test_weight_experiments_record_the_modules_moved(planted, sandwich, planted_prompts, tmp_path):
    """weight_swap / weight_patching results say which HF modules each part moved (on Gemma the
    post-norms with the paths); a post-norm part on Llama stops with the architecture named."""
    _, gemma, plant = sandwich
    llama, _ = planted
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(planted_prompts[:3]) + "\n")
    parts = ("ffn_path", "post_ffn_norm", "attn_path")
    want = {p: list(HF_PART_SANDWICH[p]) for p in parts}
    cfg = weight_swap.Config(prompts=str(prompts), partners=(0,), parts=parts, sink=False)
    res = weight_swap.run(cfg, gemma)
    moved = {pm.part: pm.modules for pm in res.part_modules}
    written = io.to_jsonable(res)["part_modules"]
    assert moved == want and written == [{"part": p, "modules": want[p]} for p in parts]
    assert [r.outcome for r in res.rows] == ["moved", "stayed", "stayed"]
    assert "post_ffn_norm: post_feedforward_layernorm" in weight_swap.summary(res)
    assert "ffn_path: pre_feedforward_layernorm + mlp + post_feedforward_layernorm" in (
        weight_swap.summary(res)
    )
    assert {c.id for c in claims.judge(weight_swap.SPECS, res)} == {s.id for s in weight_swap.SPECS}
    pcfg = weight_patching.Config(prompts=str(prompts), targets=(0,), parts=("ffn_path",))
    pres = weight_patching.run(pcfg, gemma)
    assert [(pm.part, pm.modules) for pm in pres.part_modules] == [("ffn_path", want["ffn_path"])]
    lres = weight_swap.run(
        weight_swap.Config(prompts=str(prompts), partners=(0,), parts=("ffn_path",)), llama
    )
    assert [(pm.part, pm.modules) for pm in lres.part_modules] == [
        ("ffn_path", ["post_attention_layernorm", "mlp"])
    ]
    with pytest.raises(ValueError, match="LlamaForCausalLM .* has no such norm"):
        weight_swap.run(weight_swap.Config(prompts=str(prompts), parts=("post_ffn_norm",)), llama)
    with pytest.raises(ValueError, match="LlamaForCausalLM .* has no such norm"):
        weight_patching.run(
            weight_patching.Config(prompts=str(prompts), parts=("post_attn_norm",)), llama
        )


def test_patch_between_gain_conventions_is_refused():
    """A Llama stores g, a Gemma g − 1: copying the stored weights across would change the gains."""
    from me_interp import load_model

    llama = load_model("synthetic:planted-llama")
    gemma = load_model("synthetic:planted-gemma")
    for part in ("ffn_norm", "ffn_path", "block"):
        with pytest.raises(ValueError, match="w = g - 1"):
            with edits.patched_weights(llama, 1, 1, part, source_model=gemma):
                pass
    with edits.patched_weights(llama, 1, 1, "ffn", source_model=gemma):  # no gain moves: allowed
        torch.testing.assert_close(llama.ffn_weights(1).down, gemma.ffn_weights(1).down)
