"""svd_ablated / neurons_ablated against independent numpy / by-hand computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from me_interp import edits, names
from me_interp.probes import find_me_layer


@pytest.mark.parametrize("matrix", ["gate", "up", "down"])
def test_svd_ablation_matches_numpy(tiny_llama, snap, changed_ptrs, matrix):
    model = tiny_llama
    W = edits.ffn_matrix(model, 1, matrix)
    W0 = W.detach().double().numpy().copy()
    U, S, Vt = np.linalg.svd(W0, full_matrices=False)
    k = 3
    want = W0 - (U[:, :k] * S[:k]) @ Vt[:k]
    before = snap(model)
    with edits.svd_ablated(model, 1, matrix, k):
        got = W.detach().double().numpy()
        np.testing.assert_allclose(got, want, atol=1e-6)
        # the remaining spectrum is the old one without its top k
        sv = np.linalg.svd(got, compute_uv=False)
        np.testing.assert_allclose(sv[: len(S) - k], S[k:], atol=1e-5)
        assert changed_ptrs(model, before) == {W.data_ptr()}


def test_svd_full_rank_removal_zeroes_the_matrix(tiny_llama):
    W = edits.ffn_matrix(tiny_llama, 0, "down")
    with edits.svd_ablated(tiny_llama, 0, "down", min(W.shape)):
        assert W.detach().abs().max() < 1e-5


def _ffn_io(model, batch, layer):
    store = {}

    def grab(x, hook, key):
        store[key] = x.detach().clone()
        return x

    model.run_with_hooks(
        batch,
        [
            (names.ffn_in(layer), lambda x, hook: grab(x, hook, "in")),
            (names.site("ffn_act", layer), lambda x, hook: grab(x, hook, "act")),
            (names.ffn_out(layer), lambda x, hook: grab(x, hook, "out")),
        ],
    )
    return store


def test_neuron_ablation_by_hand(tiny_llama, planted_prompts, snap, changed_ptrs):
    model = tiny_llama
    batch = model.tokenize(planted_prompts[:2])
    w = model.ffn_weights(2)
    gate, up, down = (t.detach().clone() for t in (w.gate, w.up, w.down))
    neurons = [4, 17]
    before = snap(model)
    with edits.neurons_ablated(model, 2, neurons):
        io = _ffn_io(model, batch, 2)
        assert changed_ptrs(model, before) == {
            w.gate.data_ptr(),
            w.up.data_ptr(),
            w.down.data_ptr(),
        }
    assert (io["act"][..., neurons] == 0).all()
    keep = [n for n in range(gate.shape[0]) if n not in neurons]
    x = io["in"]
    act = torch.nn.functional.silu(x @ gate[keep].T) * (x @ up[keep].T)
    torch.testing.assert_close(io["out"], act @ down[:, keep].T, atol=1e-5, rtol=1e-5)
    # negative: the unedited FFN output differs exactly by the removed neurons' writes
    base = _ffn_io(model, batch, 2)
    removed = base["act"][..., neurons] @ down[:, neurons].T
    torch.testing.assert_close(base["out"] - removed, io["out"], atol=1e-5, rtol=1e-5)


def test_planted_neuron_and_top_direction_carry_the_massive_activation(planted, planted_prompts):
    model, plant = planted
    batch = model.tokenize(planted_prompts)
    with edits.neurons_ablated(model, plant.layer, [plant.neuron]):
        assert find_me_layer(model, batch).me_layer is None
    with edits.neurons_ablated(model, plant.layer, [plant.neuron + 1]):
        assert find_me_layer(model, batch).me_layer == plant.layer
    for matrix in edits.MATRICES:
        with edits.svd_ablated(model, plant.layer, matrix, 1):
            assert find_me_layer(model, batch).me_layer is None
    with edits.svd_ablated(
        model, plant.layer + 1, "down", 1
    ):  # another layer's top direction: no effect
        assert find_me_layer(model, batch).me_layer == plant.layer


def test_ffn_bad_inputs(tiny_llama):
    rank = min(edits.ffn_matrix(tiny_llama, 0, "up").shape)
    with pytest.raises(ValueError, match="k must be"):
        with edits.svd_ablated(tiny_llama, 0, "up", rank + 1):
            pass
    with pytest.raises(ValueError, match="k must be"):
        with edits.svd_ablated(tiny_llama, 0, "up", 0):
            pass
    with pytest.raises(ValueError, match="unknown FFN matrix"):
        with edits.svd_ablated(tiny_llama, 0, "o_proj", 1):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with edits.neurons_ablated(tiny_llama, 0, [tiny_llama.d_mlp]):
            pass
    with pytest.raises(ValueError, match="at least one"):
        with edits.neurons_ablated(tiny_llama, 0, []):
            pass
    with pytest.raises(ValueError, match="repeat"):
        with edits.neurons_ablated(tiny_llama, 0, [1, 1]):
            pass
