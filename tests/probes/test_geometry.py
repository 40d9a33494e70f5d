"""Representation geometry: fixed points, numpy re-derivations, the planted collapse, bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from me_interp import names
from me_interp.probes.geometry import (
    effective_rank,
    geometry_metrics,
    geometry_scan,
    mean_pairwise_cosine,
    participation_ratio,
)


def test_orthonormal_set_has_rank_equal_to_its_size():
    q, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64))
    for n in (1, 3, 7):
        x = q[:, :n].T  # n orthonormal rows in R^20
        assert effective_rank(x) == pytest.approx(n)
        assert participation_ratio(x) == pytest.approx(n)
        if n >= 2:
            assert mean_pairwise_cosine(x) == pytest.approx(0.0, abs=1e-12)


def test_one_direction_has_rank_one_and_cosine_one():
    x = torch.randn(10)[None, :] * torch.tensor([[1.0], [2.0], [0.5], [3.0]])
    assert effective_rank(x) == pytest.approx(1.0, abs=1e-5)
    assert participation_ratio(x) == pytest.approx(1.0, abs=1e-9)
    assert mean_pairwise_cosine(x) == pytest.approx(1.0)


def test_metrics_match_numpy():
    x = torch.randn(8, 15)
    xn = x.double().numpy()
    s = np.linalg.svd(xn, compute_uv=False)
    q = s / s.sum()
    assert effective_rank(x) == pytest.approx(math.exp(-(q * np.log(q)).sum()), rel=1e-6)
    lam = s**2
    assert participation_ratio(x) == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), rel=1e-6)
    u = xn / np.linalg.norm(xn, axis=1, keepdims=True)
    c = u @ u.T
    assert mean_pairwise_cosine(x) == pytest.approx(c[np.triu_indices(8, 1)].mean(), rel=1e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least 2"):
        mean_pairwise_cosine(torch.randn(1, 4))
    with pytest.raises(ValueError, match="all-zero"):
        effective_rank(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="all-zero"):
        participation_ratio(torch.zeros(3, 4))
    assert np.isnan(geometry_metrics(torch.randn(1, 4))["mean_cos"])


def test_scan_matches_a_full_capture(tiny_nobos, word_prompts, capture):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    ref = [1, 0, 2, 3]
    scan = geometry_scan(model, batch, positions=ref)
    acts = capture(model, batch, {f"h{L}": names.resid_post(L) for L in range(3)})
    for L in range(3):
        for b, (n, r) in enumerate(zip(batch.lengths, ref)):
            h = acts[f"h{L}"][b, :n].double().numpy()
            hr = np.delete(h, r, axis=0)
            for tokens, mat in (("all", h), ("others", hr)):
                s = np.linalg.svd(mat, compute_uv=False)
                q = s / s.sum()
                er = math.exp(-(q * np.log(q)).sum())
                got = scan.values["effective_rank"][tokens][L, b].item()
                assert got == pytest.approx(er, rel=1e-5)
                lam = s**2
                got = scan.values["participation_ratio"][tokens][L, b].item()
                assert got == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), rel=1e-5)
    assert scan.mean("effective_rank")[0] == pytest.approx(
        float(scan.values["effective_rank"]["all"][0].mean()), rel=1e-9
    )
    with pytest.raises(ValueError, match="unknown metric"):
        scan.mean("rank")
    with pytest.raises(ValueError, match="tokens must be"):
        scan.mean("mean_cos", "some")


def test_layers_subset_leaves_the_rest_nan(tiny_nobos, word_prompts):
    scan = geometry_scan(tiny_nobos, tiny_nobos.tokenize(word_prompts), layers=[1])
    er = scan.values["effective_rank"]["all"]
    assert er[1].isfinite().all() and er[0].isnan().all() and er[2].isnan().all()
    with pytest.raises(ValueError, match="out of range"):
        geometry_scan(tiny_nobos, tiny_nobos.tokenize(word_prompts), layers=[3])


def test_planted_massive_token_collapses_the_rank(planted, planted_prompts):
    model, plant = planted
    scan = geometry_scan(model, model.tokenize(planted_prompts))
    er = scan.mean("effective_rank")
    assert max(er[plant.layer :]) < 1.5
    assert min(er[: plant.layer]) > 4.0
    # without the massive token the other tokens keep their dimension
    others = scan.mean("effective_rank", "others")
    assert min(others[plant.layer :]) > 4.0


def test_gram_metrics_equal_the_svd_metrics_also_with_a_massive_row():
    from me_interp.probes.geometry import gram_metrics

    torch.manual_seed(1)
    for scale in (1.0, 1e4):
        x = torch.randn(9, 30, dtype=torch.float64)
        x[0] *= scale  # one massive token
        want = geometry_metrics(x)
        got = gram_metrics(x @ x.T)
        for m in want:
            assert got[m] == pytest.approx(want[m], rel=1e-7), (scale, m)
        keep = torch.arange(9) != 0
        g = x @ x.T
        others = gram_metrics(g[keep][:, keep])
        assert others["effective_rank"] == pytest.approx(effective_rank(x[1:]), rel=1e-7)
    assert np.isnan(gram_metrics(torch.ones(1, 1, dtype=torch.float64))["mean_cos"])
    with pytest.raises(ValueError, match="all-zero"):
        gram_metrics(torch.zeros(3, 3, dtype=torch.float64))


def test_planted_reference_elsewhere_is_left_out(planted):
    """A massive token that is not the first token: ``others`` leaves out that token."""
    from me_interp.models import LoadedModel

    model, plant = planted
    no_bos = LoadedModel(
        model.bridge, model.hf, model.tokenizer, "p", "no", model.dtype, model.device
    )
    batch = no_bos.tokenize(["w1 w2 <s> w3 w4 w5 w6", "w7 <s> w8 w9 w10"])
    scan = geometry_scan(no_bos, batch, positions=[2, 1])
    er = scan.mean("effective_rank")
    others = scan.mean("effective_rank", "others")
    assert max(er[plant.layer :]) < 1.5 and min(others[plant.layer :]) > 3.0
