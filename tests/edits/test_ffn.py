"""svd_ablated / directions_removed / neurons_ablated / down_weights_zeroed against independent numpy /
by-hand computations; each touches only its entries and restores them."""

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


def test_directions_removed_matches_svd_ablated_and_restores(planted, snap, changed):
    model, plant = planted
    L = plant.layer
    before = snap(model)
    for mat in ("gate", "up", "down"):
        W = edits.ffn_matrix(model, L, mat)
        svd = edits.SVD.of(W)
        with edits.svd_ablated(model, L, mat, 3):
            want = W.detach().clone()
        with edits.directions_removed(W, svd, range(3)):
            torch.testing.assert_close(W.detach(), want, atol=1e-6, rtol=0)
        # other directions: W − Σ_{i∈S} s_i u_i v_iᵀ by hand
        W0 = W.detach().double().clone()
        U, S, Vh = torch.linalg.svd(W0, full_matrices=False)
        by_hand = W0 - sum(S[i] * torch.outer(U[:, i], Vh[i]) for i in (4, 7))
        with edits.directions_removed(W, svd, [4, 7]):
            torch.testing.assert_close(W.detach().double(), by_hand, atol=1e-6, rtol=0)
        with pytest.raises(RuntimeError), edits.directions_removed(W, svd, [0]):
            raise RuntimeError("inside the edit")
        with pytest.raises(ValueError, match="distinct"):
            with edits.directions_removed(W, svd, [1, 1]):
                pass
    assert changed(model, before) == set()


@pytest.mark.parametrize("matrix", ["gate", "up", "down"])
def test_energy_matched_directions_change_the_top_k_energy_and_not_the_top_k(
    tiny_llama, snap, changed, matrix
):
    """The random control of ffn_svd_ablation: k other directions scaled by energy_matched change W
    by exactly the top k's singular-value energy (‖ΔW‖_F², numpy's SVD), and leave the top-k
    singular subspaces (left and right) alone; restored exactly."""
    model, k = tiny_llama, 3
    before = snap(model)
    W = edits.ffn_matrix(model, 1, matrix)
    W0 = W.detach().double().numpy().copy()
    U, S, Vt = np.linalg.svd(W0, full_matrices=False)
    svd = edits.SVD.of(W)
    d = edits.random_others(svd.rank, range(k), k, seed=2)
    beta = edits.energy_matched(svd, k, d)
    assert beta == pytest.approx(np.sqrt((S[:k] ** 2).sum() / (S[d] ** 2).sum()), rel=1e-9)
    assert beta > 1 and min(d) >= k
    with edits.directions_removed(W, svd, d, beta):
        delta = W0 - W.detach().double().numpy()
    assert (delta**2).sum() == pytest.approx((S[:k] ** 2).sum(), rel=1e-4)
    np.testing.assert_allclose(delta @ Vt[:k].T, 0, atol=1e-5)  # the top right directions
    np.testing.assert_allclose(U[:, :k].T @ delta, 0, atol=1e-5)  # and the top left ones
    with pytest.raises(ValueError, match="finite"):
        with edits.directions_removed(W, svd, d, float("nan")):
            pass
    assert changed(model, before) == set()


def test_direction_plan_by_hand(tiny_llama):
    """The top-j removals of the sweep, then seeded energy-matched draws of k others."""
    W = edits.ffn_matrix(tiny_llama, 1, "down")
    S = np.linalg.svd(W.detach().double().numpy(), compute_uv=False)
    svd = edits.SVD.of(W)
    plan = edits.direction_plan(svd, [1, 4], 2, 2, seed=7)
    assert [(p.directions, p.scale, p.seed) for p in plan[:2]] == [
        ([0], 1.0, None),
        ([0, 1, 2, 3], 1.0, None),
    ]
    assert plan[1].energy == pytest.approx((S[:4] ** 2).sum(), rel=1e-9)
    for p, seed in zip(plan[2:], (7, 8), strict=True):
        assert p.seed == seed and p.directions == edits.random_others(svd.rank, range(2), 2, seed)
        assert p.energy == pytest.approx((S[:2] ** 2).sum(), rel=1e-9)  # matched to the top 2
        assert p.scale == pytest.approx(np.sqrt((S[:2] ** 2).sum() / (S[p.directions] ** 2).sum()))
    assert len(edits.direction_plan(svd, [], 2, 0, seed=0)) == 0


def test_random_others():
    got = edits.random_others(20, range(5), 5, seed=1)
    assert len(set(got)) == 5 and min(got) >= 5 and got == sorted(got)
    assert got == edits.random_others(20, range(5), 5, seed=1)
    with pytest.raises(ValueError, match="cannot draw"):
        edits.random_others(6, range(5), 2, seed=0)


def test_down_weights_zeroed_touches_only_its_entries_and_restores(planted):
    model, plant = planted
    before = {k: v.detach().clone() for k, v in model.hf.state_dict().items()}
    # (rows 1 and 2 are not among the dims planted() keeps at 0)
    entries = [(plant.layer, plant.massive_dim, plant.neuron), (plant.layer, 1, 2), (0, 2, 3)]
    downs = {L: model.ffn_weights(L).down.detach().clone() for L in range(model.n_layers)}
    with edits.down_weights_zeroed(model, entries):
        after = model.hf.state_dict()
        changed = [k for k, v in before.items() if not torch.equal(after[k], v)]
        assert changed  # (the bridge aliases each weight under several names)
        for L in range(model.n_layers):
            diff = (model.ffn_weights(L).down.detach() != downs[L]).nonzero().tolist()
            assert sorted(map(tuple, diff)) == sorted((r, c) for e, r, c in entries if e == L)
    with pytest.raises(RuntimeError), edits.down_weights_zeroed(model, entries[:1]):
        raise RuntimeError("inside the edit")
    after = model.hf.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="outside"):
        with edits.down_weights_zeroed(model, [(0, 999, 0)]):
            pass
    with pytest.raises(ValueError, match="at least one"):
        with edits.down_weights_zeroed(model, []):
            pass
