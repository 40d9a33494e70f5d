"""permuted_gain / flattened_gain and the permutation builders."""

from __future__ import annotations

import pytest
import torch

from me_interp import edits, names
from me_interp.probes import find_me_layer


def _norm_io(model, batch, layer):
    """(h / rms(h), RMSNorm output) at the pre-FFN norm of ``layer``."""
    store = {}

    def grab(x, hook, key):
        store[key] = x.detach().clone()
        return x

    hooks = [
        (names.site("ffn_normalized", layer), lambda x, hook: grab(x, hook, "n")),
        (names.ffn_in(layer), lambda x, hook: grab(x, hook, "o")),
    ]
    model.run_with_hooks(batch, hooks)
    return store["n"], store["o"]


def test_permuted_gain_positive_by_hand(planted, planted_prompts, snap, changed_ptrs):
    model, _ = planted  # its gains are not all equal (a fresh tiny Llama's are all 1)
    batch = model.tokenize(planted_prompts[:2])
    w0 = model.ffn_norm_gain(1)
    perm = edits.random_permutation(model.d_model, seed=3)
    before = snap(model)
    with edits.permuted_gain(model, 1, perm, norm="ffn"):
        assert torch.equal(model.ffn_norm_gain(1), w0[perm])
        assert changed_ptrs(model, before) == {model.ffn_norm_weight(1).data_ptr()}
        normalized, out = _norm_io(model, batch, 1)
        torch.testing.assert_close(out, normalized * w0[perm], atol=1e-6, rtol=1e-6)


def test_permuted_attn_gain_edits_only_ln1(planted, snap, changed_ptrs):
    model, _ = planted
    before = snap(model)
    with edits.permuted_gain(model, 2, torch.arange(model.d_model).roll(1), norm="attn"):
        assert changed_ptrs(model, before) == {model.attn_norm_weight(2).data_ptr()}


@pytest.mark.parametrize("alpha", [0.0, 0.3, 2.0])
def test_flattened_gain_formula(planted, alpha):
    model, _ = planted
    w0 = model.ffn_norm_gain(2).double()
    assert w0.std() > 0.1
    with edits.flattened_gain(model, 2, alpha):
        w = model.ffn_norm_gain(2).double()
        want = w0.mean() + alpha * (w0 - w0.mean())
        torch.testing.assert_close(w, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(w.mean(), w0.mean(), atol=1e-6, rtol=1e-6)


def test_top_dims_permutation_moves_only_the_top_dims():
    w = torch.tensor([0.1, 5.0, 0.2, -7.0, 0.3, 0.4, 0.5, 0.6])
    assert edits.top_dims(w, 2) == [3, 1]
    perm = edits.top_dims_permutation(w, 2, seed=0)
    assert sorted(perm.tolist()) == list(range(8))
    moved = [i for i in range(8) if perm[i] != i]
    assert len(moved) == 4 and {1, 3} <= set(moved)
    wp = w[perm]
    assert set(edits.top_dims(wp, 2)).isdisjoint({1, 3})  # the large gains now sit elsewhere
    assert torch.equal(perm, edits.top_dims_permutation(w, 2, seed=0))  # seeded
    assert torch.equal(edits.random_permutation(8, 1), edits.random_permutation(8, 1))


def test_planted_gain_edits_kill_the_massive_activation(planted, planted_prompts):
    model, plant = planted
    batch = model.tokenize(planted_prompts)
    w = model.ffn_norm_gain(plant.layer)
    assert set(edits.top_dims(w, len(plant.gain_dims))) == set(plant.gain_dims)
    perm = edits.top_dims_permutation(w, len(plant.gain_dims), seed=0)
    with edits.permuted_gain(model, plant.layer, perm):
        assert find_me_layer(model, batch).me_layer is None
    with edits.flattened_gain(model, plant.layer, 0.0):
        assert find_me_layer(model, batch).me_layer is None
    # the pre-attention norm is not part of the mechanism: the control keeps it
    with edits.permuted_gain(
        model, plant.layer, edits.random_permutation(model.d_model, 0), norm="attn"
    ):
        assert find_me_layer(model, batch).me_layer == plant.layer


def test_gain_bad_inputs(tiny_llama):
    d = tiny_llama.d_model
    with pytest.raises(ValueError, match="permutation"):
        with edits.permuted_gain(tiny_llama, 0, [0] * d):
            pass
    with pytest.raises(ValueError, match="permutation"):
        with edits.permuted_gain(tiny_llama, 0, list(range(d - 1))):
            pass
    with pytest.raises(ValueError, match="unknown norm"):
        with edits.flattened_gain(tiny_llama, 0, 0.5, norm="post"):
            pass
    with pytest.raises(ValueError, match="finite"):
        with edits.flattened_gain(tiny_llama, 0, float("inf")):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with edits.flattened_gain(tiny_llama, -1, 0.5):
            pass
    with pytest.raises(ValueError, match="k must be"):
        edits.top_dims_permutation(tiny_llama.ffn_norm_gain(0), d, seed=0)
