"""edited_parameters and part resolution: restore always, bit-identical; parts are architecture-neutral
(Llama-style blocks and the sandwich-norm blocks of Gemma 2/3, whose post-norms join the paths)."""

from __future__ import annotations

import pytest
import torch

from me_interp import edits, load_model, synthetic
from me_interp.edits import core

SANDWICH = ("gemma2", "gemma3")


@pytest.fixture(scope="module", params=SANDWICH)
def sandwich(request):
    """A planted tiny Gemma 2 / Gemma 3 (its post-norm gains differ between layers)."""
    hf, tok, _ = synthetic.planted(request.param)
    return load_model(hf, tokenizer=tok, device="cpu")


def _all_edits(model):
    d = model.d_model
    return {
        "swap": lambda: edits.swapped_layers(model, 0, 2, "block"),
        "patch": lambda: edits.patched_weights(model, 2, 0, "ffn"),
        "permute": lambda: edits.permuted_gain(model, 2, torch.arange(d).flip(0)),
        "flatten": lambda: edits.flattened_gain(model, 1, 0.0, norm="attn"),
        "svd": lambda: edits.svd_ablated(model, 2, "down", 3),
        "neurons": lambda: edits.neurons_ablated(model, 2, [5, 6]),
        "directions": lambda: edits.directions_removed(
            edits.ffn_matrix(model, 2, "up"), edits.SVD.of(edits.ffn_matrix(model, 2, "up")), [1, 4]
        ),
        "zeroed": lambda: edits.down_weights_zeroed(model, [(2, 7, 5), (2, 1, 2), (0, 2, 3)]),
    }


KINDS = ["swap", "patch", "permute", "flatten", "svd", "neurons", "directions", "zeroed"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_edit_restores_bit_identical_after_normal_exit(planted, snap, changed, kind):
    model, _ = planted
    before = snap(model)
    with _all_edits(model)[kind]():
        assert changed(model, before), f"{kind} changed nothing inside the block"
    assert changed(model, before) == set()


@pytest.mark.parametrize("kind", KINDS)
def test_every_edit_restores_bit_identical_after_exception(planted, snap, changed, kind):
    model, _ = planted
    before = snap(model)
    with pytest.raises(RuntimeError, match="boom"):
        with _all_edits(model)[kind]():
            raise RuntimeError("boom")
    assert changed(model, before) == set()


def test_edited_parameters_positive_and_negative(tiny_llama, snap, changed, changed_ptrs):
    model = tiny_llama
    w = model.ffn_norm_weight(1)
    before = snap(model)
    new = torch.linspace(-1, 1, w.numel())
    with core.edited_parameters({w: new}):
        assert torch.equal(w.detach(), new)
        assert changed_ptrs(model, before) == {w.data_ptr()}  # nothing else moved
    assert changed(model, before) == set()


def test_edited_parameters_validates_before_writing(tiny_llama, snap, changed):
    model = tiny_llama
    a, b = model.ffn_norm_weight(0), model.ffn_norm_weight(1)
    before = snap(model)
    with pytest.raises(ValueError, match="shape mismatch"):
        with core.edited_parameters({a: torch.zeros_like(a), b: torch.zeros(3)}):
            pass
    with pytest.raises(ValueError, match="finite"):
        with core.edited_parameters({a: torch.full_like(a, float("nan"))}):
            pass
    with pytest.raises(TypeError):  # the runtime type check or our own check
        with core.edited_parameters({a: [1.0] * a.numel()}):
            pass
    assert changed(model, before) == set()


def test_swap_values_are_read_before_any_write(tiny_llama):
    """A swap maps a→b and b→a in one dict: the values must be the originals, not half-swapped."""
    model = tiny_llama
    a, b = model.attn_norm_weight(0), model.attn_norm_weight(1)
    a0, b0 = a.detach().clone(), b.detach().clone()
    with core.edited_parameters({a: b, b: a}):
        assert torch.equal(a.detach(), b0)
        assert torch.equal(b.detach(), a0)


def test_parts_resolve_to_the_hf_modules(tiny_llama):
    model = tiny_llama
    hf_layer = model.hf.model.layers[1]
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(core.part_parameters(model, 1, "attn_norm").values()) == ids(
        hf_layer.input_layernorm.parameters()
    )
    assert ids(core.part_parameters(model, 1, "ffn_norm").values()) == ids(
        hf_layer.post_attention_layernorm.parameters()
    )
    assert ids(core.part_parameters(model, 1, "ffn").values()) == ids(hf_layer.mlp.parameters())
    assert ids(core.part_parameters(model, 1, "attn").values()) == ids(
        hf_layer.self_attn.parameters()
    )
    assert ids(core.part_parameters(model, 1, "block").values()) == ids(hf_layer.parameters())
    # the four parts tile the block exactly
    parts = [core.part_parameters(model, 1, p) for p in ("attn_norm", "ffn_norm", "ffn", "attn")]
    assert sum(len(p) for p in parts) == len(core.part_parameters(model, 1, "block"))


def test_qwen3_attn_part_includes_qk_norms(tiny_qwen3):
    names = list(core.part_parameters(tiny_qwen3, 0, "attn"))
    assert any("q_norm" in n for n in names) and any("k_norm" in n for n in names)
    assert len(names) == 6


def test_part_names_match_across_layers(tiny_llama):
    for part in edits.PARTS:
        assert list(core.part_parameters(tiny_llama, 0, part)) == list(
            core.part_parameters(tiny_llama, 3, part)
        )


def test_sandwich_parts_resolve_to_the_hf_modules(sandwich):
    """On Gemma 2/3 the paths end with the post-norms: ffn_path = pre_feedforward_layernorm + mlp +
    post_feedforward_layernorm, attn_path = input_layernorm + self_attn + post_attention_layernorm,
    and the six single parts tile the decoder layer."""
    model = sandwich
    hf_layer = model.block_module(1)  # the HF Gemma2/3DecoderLayer
    assert type(hf_layer).__name__.startswith("Gemma")
    ids = lambda ps: [id(p) for p in ps]  # noqa: E731
    hf = {
        "attn_norm": ("input_layernorm",),
        "ffn_norm": ("pre_feedforward_layernorm",),
        "ffn": ("mlp",),
        "attn": ("self_attn",),
        "post_attn_norm": ("post_attention_layernorm",),
        "post_ffn_norm": ("post_feedforward_layernorm",),
        "ffn_path": ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"),
        "attn_path": ("input_layernorm", "self_attn", "post_attention_layernorm"),
    }
    for part, mods in hf.items():
        want = [i for m in mods for i in ids(getattr(hf_layer, m).parameters())]
        assert ids(core.part_parameters(model, 1, part).values()) == want, part
        assert core.moved_modules(model, part) == list(mods), part
    singles = (*core.SINGLE_PARTS, *core.POST_NORM_PARTS)
    tiled = [i for p in singles for i in ids(core.part_parameters(model, 1, p).values())]
    assert sorted(tiled) == sorted(ids(hf_layer.parameters()))  # each parameter exactly once
    assert core.part_members(model, "block") == singles
    assert sorted(core.moved_modules(model, "block")) == sorted(
        n for n, _ in hf_layer.named_children()
    )
    assert core.model_parts(model) == (*edits.PARTS, *core.POST_NORM_PARTS)
    for part in core.model_parts(model):  # the same names in every layer
        assert list(core.part_parameters(model, 0, part)) == list(
            core.part_parameters(model, 3, part)
        )


def test_llama_parts_are_unchanged(tiny_llama):
    """Without post-norms the paths are what they were: the pre-norm and the sub-layer only."""
    model = tiny_llama
    assert core.model_parts(model) == edits.PARTS
    assert core.part_members(model, "ffn_path") == ("ffn_norm", "ffn")
    assert core.part_members(model, "attn_path") == ("attn_norm", "attn")
    assert core.moved_modules(model, "ffn_path") == ["post_attention_layernorm", "mlp"]
    assert core.moved_modules(model, "attn_path") == ["input_layernorm", "self_attn"]
    ffn = [f"ffn.{n}" for n in core.part_parameters(model, 1, "ffn")]
    assert list(core.part_parameters(model, 1, "ffn_path")) == ["ffn_norm.weight", *ffn]


@pytest.mark.parametrize("part", core.POST_NORM_PARTS)
def test_post_norm_part_on_a_model_without_one(tiny_llama, part):
    """Asked for on Llama, a post-norm part is refused with the architecture named; nothing is
    written."""
    msg = rf"part '{part}' .* LlamaForCausalLM .* has no such norm"
    for call in (
        lambda: core.part_parameters(tiny_llama, 0, part),
        lambda: core.moved_modules(tiny_llama, part),
        lambda: core.check_model_part(tiny_llama, part),
    ):
        with pytest.raises(ValueError, match=msg):
            call()
    assert core.check_part(part) == part  # a known part name, just not on this model
    assert "post_ffn_norm" in str(pytest.raises(ValueError, core.check_part, "post_mlp").value)


def test_unknown_part_and_bad_layer(tiny_llama):
    with pytest.raises(ValueError, match="unknown component 'mlp'"):
        core.part_parameters(tiny_llama, 0, "mlp")
    with pytest.raises(ValueError, match="out of range"):
        core.part_parameters(tiny_llama, 4, "ffn")
