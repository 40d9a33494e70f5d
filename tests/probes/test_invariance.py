"""Directional invariance: cosine re-derivations, the trivial control, keys, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from me_interp import names
from me_interp.probes.invariance import (
    cosine_matrix,
    invariance_scan,
    mean_pair_cosine,
    norm_cv,
    pair_mask,
    same_first_token_control,
)


def test_cosine_helpers_match_numpy():
    x = torch.randn(5, 9)
    xn = x.double().numpy()
    u = xn / np.linalg.norm(xn, axis=1, keepdims=True)
    np.testing.assert_allclose(cosine_matrix(x).numpy(), u @ u.T, atol=1e-12)
    pairs = pair_mask([1, 2, 1, 3, 2], same=False)
    want = np.mean(
        [
            u[a] @ u[b]
            for a in range(5)
            for b in range(a + 1, 5)
            if [1, 2, 1, 3, 2][a] != [1, 2, 1, 3, 2][b]
        ]
    )
    assert mean_pair_cosine(x, pairs) == pytest.approx(want)
    n = np.linalg.norm(xn, axis=1)
    assert norm_cv(x) == pytest.approx(n.std() / n.mean())


def test_pair_mask():
    same = pair_mask([4, 4, 7], same=True)
    diff = pair_mask([4, 4, 7], same=False)
    assert same.nonzero().tolist() == [[0, 1]]
    assert diff.nonzero().tolist() == [[0, 2], [1, 2]]
    assert np.isnan(mean_pair_cosine(torch.randn(3, 4), pair_mask([1, 2, 3], same=True)))


def test_identical_vectors_have_cosine_one_and_zero_cv():
    x = torch.randn(6).expand(4, 6)
    assert mean_pair_cosine(x, pair_mask([1, 2, 3, 4], False)) == pytest.approx(1.0)
    assert norm_cv(x) == pytest.approx(0.0, abs=1e-12)


def test_scan_matches_a_full_capture(tiny_nobos, word_prompts, capture):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    ref = [1, 0, 2, 3]
    scan = invariance_scan(model, batch, positions=ref)
    acts = capture(
        model,
        batch,
        {
            **{f"h{L}": names.resid_post(L) for L in range(3)},
            **{f"a{L}": names.attn_in(L) for L in range(3)},
        },
    )
    idx, r = torch.arange(4), torch.tensor(ref)
    for L in range(3):
        assert torch.allclose(scan.states[L], acts[f"h{L}"][idx, r], atol=1e-6)
        # the key: k_proj of the pre-attention RMSNorm output, computed here with HF's own module
        k_proj = model.block_module(L).self_attn.k_proj
        with torch.no_grad():
            k = k_proj(acts[f"a{L}"][idx, r])
        assert torch.allclose(scan.keys[L].flatten(1), k, atol=1e-5)
    assert scan.first_tokens == batch.tokens[:, 0].tolist()
    cal = scan.cos_across_layers()
    assert torch.allclose(torch.diagonal(cal), torch.ones(3, dtype=cal.dtype), atol=1e-9)
    u = scan.states.double() / scan.states.double().norm(dim=-1, keepdim=True)
    assert cal[0, 2].item() == pytest.approx(float((u[0] * u[2]).sum(-1).mean()))


def test_the_control_is_trivially_one_and_the_real_test_is_not(tiny_nobos, word_prompts):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    scan = invariance_scan(model, batch)
    assert scan.n_pairs(False) == 6 and scan.n_pairs(True) == 0
    real = scan.cos_across_inputs(False)
    assert real[0] < 0.9  # different first tokens of a random model: not invariant
    ctrl_batch = same_first_token_control(batch)
    assert (ctrl_batch.tokens[:, 0] == batch.tokens[0, 0]).all()
    assert torch.equal(ctrl_batch.tokens[:, 1:], batch.tokens[:, 1:])
    ctrl = invariance_scan(model, ctrl_batch)
    assert ctrl.n_pairs(False) == 0
    for c in ctrl.cos_across_inputs(True):
        assert c == pytest.approx(1.0, abs=1e-6)
    for row in ctrl.key_cos_across_inputs(True):
        assert all(c == pytest.approx(1.0, abs=1e-6) for c in row)
    assert all(np.isnan(c) for c in ctrl.cos_across_inputs(False))
    assert all(v == pytest.approx(0.0, abs=1e-6) for v in ctrl.norm_cv())


def test_planted_prompts_all_share_bos(planted, planted_prompts):
    model, plant = planted
    scan = invariance_scan(model, model.tokenize(planted_prompts))
    assert set(scan.first_tokens) == {plant.sink_token}
    assert scan.n_pairs(False) == 0
    assert all(np.isnan(c) for c in scan.cos_across_inputs(False))
    # carried unchanged from the planted layer on
    cal = scan.cos_across_layers()
    assert cal[plant.layer, plant.layer + 1 :].min() > 0.99
    assert cal[plant.layer, plant.layer - 1] < 0.5


def test_bad_inputs(tiny_nobos):
    with pytest.raises(ValueError, match="at least 2 prompts"):
        invariance_scan(tiny_nobos, tiny_nobos.tokenize(["w1 w2 w3"]))
    with pytest.raises(ValueError, match="outside prompt"):
        invariance_scan(tiny_nobos, tiny_nobos.tokenize(["w1 w2 w3", "w4 w5"]), positions=[0, 2])


def test_other_token_directions_and_pair_matrices_match_a_direct_computation(
    tiny_nobos, word_prompts, capture
):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    ref = [1, 0, 2, 3]
    scan = invariance_scan(model, batch, positions=ref, others=True)
    acts = capture(model, batch, {f"h{L}": names.resid_post(L) for L in range(3)})
    cm, om, km = scan.cos_matrices(), scan.others_cos_matrices(), scan.key_cos_matrices()
    for L in range(3):
        h = acts[f"h{L}"].double()
        units = []
        for b, (n, r) in enumerate(zip(batch.lengths, ref)):
            rows = torch.cat([h[b, :r], h[b, r + 1 : n]])
            u = rows / rows.norm(dim=-1, keepdim=True)
            units.append(u)
            assert torch.allclose(scan.others[L, b].double(), u.mean(0), atol=1e-5)
        # ū_a · ū_b is the mean cosine between every other token of a and of b
        for a in range(4):
            for b in range(4):
                want = (units[a] @ units[b].T).mean()
                assert om[L, a, b].item() == pytest.approx(want.item(), abs=1e-5)
        p = scan.pairs(False)
        assert cm[L][p].mean().item() == pytest.approx(scan.cos_across_inputs()[L], abs=1e-9)
        for k, c in enumerate(scan.key_cos_across_inputs()[L]):
            assert km[L, k][p].mean().item() == pytest.approx(c, abs=1e-9)
    torch.testing.assert_close(scan.cos_to_layers().mean(-1), scan.cos_across_layers())
    with pytest.raises(ValueError, match="other-token directions"):
        invariance_scan(model, batch, positions=ref).others_cos_matrices()
