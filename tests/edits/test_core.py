"""edited_parameters and part resolution: restore always, bit-identical; parts are architecture-neutral."""

from __future__ import annotations

import pytest
import torch

from me_interp import edits
from me_interp.edits import core


def _all_edits(model):
    d = model.d_model
    return {
        "swap": lambda: edits.swapped_layers(model, 0, 2, "block"),
        "patch": lambda: edits.patched_weights(model, 2, 0, "ffn"),
        "permute": lambda: edits.permuted_gain(model, 2, torch.arange(d).flip(0)),
        "flatten": lambda: edits.flattened_gain(model, 1, 0.0, norm="attn"),
        "svd": lambda: edits.svd_ablated(model, 2, "down", 3),
        "neurons": lambda: edits.neurons_ablated(model, 2, [5, 6]),
    }


@pytest.mark.parametrize("kind", ["swap", "patch", "permute", "flatten", "svd", "neurons"])
def test_every_edit_restores_bit_identical_after_normal_exit(planted, snap, changed, kind):
    model, _ = planted
    before = snap(model)
    with _all_edits(model)[kind]():
        assert changed(model, before), f"{kind} changed nothing inside the block"
    assert changed(model, before) == set()


@pytest.mark.parametrize("kind", ["swap", "patch", "permute", "flatten", "svd", "neurons"])
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


def test_unknown_part_and_bad_layer(tiny_llama):
    with pytest.raises(ValueError, match="unknown component 'mlp'"):
        core.part_parameters(tiny_llama, 0, "mlp")
    with pytest.raises(ValueError, match="out of range"):
        core.part_parameters(tiny_llama, 4, "ffn")
