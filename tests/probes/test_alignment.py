"""RMSNorm alignment: fixed points, numpy re-derivations, the planted layer, bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from me_interp import names
from me_interp.probes.alignment import (
    alignment_scan,
    delta_vs_others,
    energy_distribution,
    frac_on_dims,
    gain_distribution,
    gain_ranks,
    kl_to_gain,
    massive_dim_gain_ranks,
    others_mean,
    reference_positions,
    resolve_k,
    top_gain_dims,
)


def np_kl(p, g):
    p, g = np.asarray(p, dtype=np.float64), np.asarray(g, dtype=np.float64)
    out = 0.0
    for pi, gi in zip(p, g):
        if pi > 0:
            out += pi * (math.log(pi) - math.log(gi))
    return out


# -- fixed points ---------------------------------------------------------------------------


def test_kl_of_a_distribution_with_itself_is_zero():
    p = torch.rand(7, 20)
    p = p / p.sum(-1, keepdim=True)
    for row in p:
        assert kl_to_gain(row[None], row).abs().max() < 1e-6


def test_energy_distribution_of_the_gain_gives_zero_kl():
    w = torch.randn(16)
    assert kl_to_gain(energy_distribution(w), gain_distribution(w)).abs() < 1e-6


def test_frac_on_all_dims_is_one_and_on_no_energy_dims_is_zero():
    h = torch.randn(3, 5, 10)
    assert torch.allclose(frac_on_dims(h, torch.arange(10)), torch.ones(3, 5))
    h[..., :4] = 0.0
    assert frac_on_dims(h, torch.arange(4)).abs().max() == 0


def test_same_token_twice_gives_zero_delta():
    v = torch.randn(12)
    h = v.expand(2, 6, 12).clone()  # every position holds the same vector
    mask = torch.ones(2, 6, dtype=torch.bool)
    ref = torch.tensor([0, 3])
    dims = top_gain_dims(torch.randn(12), 3)
    g = gain_distribution(torch.randn(12))
    assert delta_vs_others(frac_on_dims(h, dims), mask, ref).abs().max() < 1e-6
    assert delta_vs_others(kl_to_gain(energy_distribution(h), g), mask, ref).abs().max() < 1e-5


# -- numpy re-derivations -------------------------------------------------------------------


def test_metrics_match_numpy_on_random_tensors():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(4, 9, 24, generator=gen)
    w = torch.randn(24, generator=gen)
    k = 5
    dims = top_gain_dims(w, k)
    hn, wn = h.numpy().astype(np.float64), w.numpy().astype(np.float64)
    np_dims = np.argsort(-np.abs(wn), kind="stable")[:k]
    assert sorted(dims.tolist()) == sorted(np_dims.tolist())
    e = hn**2
    np_frac = e[..., np_dims].sum(-1) / e.sum(-1)
    np.testing.assert_allclose(frac_on_dims(h, dims).numpy(), np_frac, rtol=1e-5)
    p = e / e.sum(-1, keepdims=True)
    g = wn**2 / (wn**2).sum()
    np.testing.assert_allclose(energy_distribution(h).numpy(), p, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(gain_distribution(w).numpy(), g, rtol=1e-5)
    np_kls = np.array([[np_kl(p[b, t], g) for t in range(9)] for b in range(4)])
    np.testing.assert_allclose(
        kl_to_gain(energy_distribution(h), gain_distribution(w)).numpy(),
        np_kls,
        rtol=1e-4,
        atol=1e-5,
    )


def test_kl_conventions_zero_log_zero_and_infinite_support_mismatch():
    g = torch.tensor([0.5, 0.5, 0.0])
    assert torch.isclose(kl_to_gain(torch.tensor([1.0, 0.0, 0.0]), g), torch.tensor(math.log(2)))
    assert kl_to_gain(torch.tensor([0.5, 0.0, 0.5]), g).isinf()


def test_delta_matches_a_loop():
    x = torch.randn(3, 4, 7)  # [layer batch pos]
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[1, 5:] = False
    mask[3, 3:] = False
    x = x.masked_fill(~mask, float("nan"))
    ref = torch.tensor([0, 2, 6, 1])
    got = delta_vs_others(x, mask, ref)
    for layer in range(3):
        for b in range(4):
            others = [x[layer, b, t] for t in range(7) if mask[b, t] and t != ref[b]]
            want = x[layer, b, ref[b]] - sum(others) / len(others)
            assert torch.isclose(got[layer, b], want, atol=1e-6)


def test_others_mean_matches_a_loop():
    """``mean_{t∉P} x_t`` over the real tokens outside ``P``; padding and ``P`` never count."""
    x = torch.randn(3, 6, 5)  # [batch pos d]
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    x[1, 4:] = 1e6  # padding: must not count
    got = others_mean(x, mask, [0, 2])
    for b in range(3):
        keep = [t for t in range(6) if mask[b, t] and t not in (0, 2)]
        torch.testing.assert_close(got[b], x[b, keep].mean(0))
    with pytest.raises(ValueError, match="at least one token outside"):
        others_mean(x[:, :2], mask[:, :2], [0, 1])


def test_gain_ranks_match_numpy_and_show_small_gains():
    w = torch.tensor([0.5, -3.0, 0.01, 2.0, 1.0])
    ranks = {g.dim: g for g in gain_ranks(w, [1, 2, 3], k=2)}
    assert ranks[1].rank == 1 and ranks[1].in_top_k
    assert ranks[3].rank == 2 and ranks[3].in_top_k
    assert ranks[2].rank == 5 and not ranks[2].in_top_k  # the smallest gain ranks last
    assert ranks[2].ratio_to_median == pytest.approx(0.01 / 1.0)  # median |w| = 1.0
    with pytest.raises(ValueError, match="outside"):
        gain_ranks(w, [5], k=1)


# -- bad inputs -----------------------------------------------------------------------------


def test_resolve_k():
    assert resolve_k(3, 100) == 3
    assert resolve_k(0.05, 100) == 5
    assert resolve_k(0.001, 100) == 1
    assert resolve_k(1.0, 100) == 100
    # one count rule with WeMask (interventions.core.n_selected): halves round up, not to even
    from me_interp.interventions.core import n_selected

    assert resolve_k(0.5, 5) == 3 and resolve_k(0.125, 20) == 3  # 2.5 -> 3
    for frac in (0.01, 0.05, 0.1, 0.3, 0.5):
        assert resolve_k(frac, 576) == max(1, n_selected(frac, 576))
    for bad in (0, 101, 0.0, 1.5, float("nan")):
        with pytest.raises(ValueError):
            resolve_k(bad, 100)
    with pytest.raises(TypeError):
        resolve_k(True, 100)


def test_reference_positions_errors(tiny_nobos):
    batch = tiny_nobos.tokenize(["w1 w2 w3", "w4 w5"])
    assert reference_positions(batch).tolist() == [0, 0]
    assert reference_positions(batch, [2, 1]).tolist() == [2, 1]
    with pytest.raises(ValueError, match="outside prompt 1"):
        reference_positions(batch, [0, 2])
    with pytest.raises(ValueError, match="2 prompts"):
        reference_positions(batch, [0])
    with pytest.raises(ValueError, match="single token"):
        reference_positions(tiny_nobos.tokenize(["w1 w2", "w3"]))


def test_alignment_scan_rejects_unknown_site(tiny_nobos, word_prompts):
    with pytest.raises(ValueError, match="unknown alignment site"):
        alignment_scan(tiny_nobos, tiny_nobos.tokenize(word_prompts), sites=("resid_post",))


def test_gain_distribution_rejects_zero_gain():
    with pytest.raises(ValueError, match="all zero"):
        gain_distribution(torch.zeros(4))


# -- model-level scan against an independent computation -----------------------------------


def test_alignment_scan_matches_a_full_capture(tiny_nobos, word_prompts, capture):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    ref = [1, 0, 2, 3]
    scan = alignment_scan(model, batch, k=4, positions=ref)
    acts = capture(
        model,
        batch,
        {f"{s}{L}": names.site(s, L) for s in ("ffn_in", "attn_normalized") for L in range(3)},
    )
    mask = batch.attention_mask.bool().numpy()
    for L in range(3):
        for site, gain in (
            ("ffn_in", model.ffn_norm_gain(L)),
            ("attn_normalized", model.attn_norm_gain(L)),
        ):
            h = acts[f"{site}{L}"].double().numpy()
            w = gain.detach().double().numpy()
            dims = np.argsort(-np.abs(w), kind="stable")[:4]
            e = h**2
            with np.errstate(invalid="ignore", divide="ignore"):  # all-zero padding rows
                frac = e[..., dims].sum(-1) / e.sum(-1)
                p = e / e.sum(-1, keepdims=True)
            g = w**2 / (w**2).sum()
            kl = np.array(
                [[np_kl(p[b, t], g) for t in range(h.shape[1])] for b in range(h.shape[0])]
            )
            norm = np.sqrt(e.sum(-1))
            for b, r in enumerate(ref):
                others = [t for t in range(h.shape[1]) if mask[b, t] and t != r]
                for name, arr, got in (
                    ("frac", frac, scan.delta_frac(site)),
                    ("kl", kl, scan.delta_kl(site)),
                    ("norm", norm, scan.delta_weight_norm(site)),
                ):
                    want = arr[b, r] - np.mean(arr[b, others])
                    assert got[L, b].item() == pytest.approx(want, rel=1e-4, abs=1e-5), (name, L, b)
            assert scan.top_dims[site][L] == dims.tolist()


def test_fwd_hooks_run_in_the_same_forward(tiny_nobos, word_prompts):
    batch = tiny_nobos.tokenize(word_prompts)

    def zero_all_but_dim0(x, hook):
        y = torch.zeros_like(x)
        y[..., 0] = x[..., 0]
        return y

    scan = alignment_scan(
        tiny_nobos, batch, k=1, sites=("ffn_in",), fwd_hooks=[(names.ffn_in(1), zero_all_but_dim0)]
    )
    frac = scan.sites["ffn_in"].frac[1][batch.attention_mask.bool()]
    top = top_gain_dims(tiny_nobos.ffn_norm_gain(1), 1).item()
    assert torch.allclose(frac, torch.full_like(frac, float(top == 0)))


# -- the planted model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def planted_scan(planted, planted_prompts):
    model, plant = planted
    return alignment_scan(model, model.tokenize(planted_prompts), k=len(plant.gain_dims)), plant


def test_planted_delta_frac_peaks_at_the_planted_layer(planted_scan):
    scan, plant = planted_scan
    d = scan.delta_frac("ffn_in").mean(-1)
    assert int(d.argmax()) == plant.layer
    assert d[plant.layer] > 0.3
    others = torch.cat([d[: plant.layer], d[plant.layer + 1 :]])
    assert d[plant.layer] > 2 * others.max()
    # K = |gain dims|: the top-|w| dims of the planted norm are exactly the planted gain dims
    assert sorted(scan.top_dims["ffn_in"][plant.layer]) == sorted(plant.gain_dims)


def test_planted_delta_kl_negative_only_at_the_planted_layer(planted_scan):
    scan, plant = planted_scan
    d = scan.delta_kl("ffn_in").mean(-1)
    assert int(d.argmin()) == plant.layer
    assert d[plant.layer] < -1.0
    others = torch.cat([d[: plant.layer], d[plant.layer + 1 :]])
    assert (others > 0).all()


def test_planted_alignment_is_made_by_the_gain(planted_scan):
    """Before the gain (standardised h/rms) the planted token is barely more aligned: the gain does it."""
    scan, plant = planted_scan
    after = scan.delta_frac("ffn_in").mean(-1)[plant.layer]
    before = scan.delta_frac("ffn_normalized").mean(-1)[plant.layer]
    assert before < 0.5 * after


def test_massive_dim_gain_ranks_on_the_planted_model(planted):
    model, plant = planted
    ranks = massive_dim_gain_ranks(model, [*plant.gain_dims, plant.massive_dim], k=2)
    at = {g.dim: g for g in ranks["ffn"][plant.layer]}
    assert all(at[d].rank <= 2 and at[d].in_top_k for d in plant.gain_dims)
    assert not at[plant.massive_dim].in_top_k
    assert len(ranks["attn"]) == model.n_layers
