"""FFN concentration and neuron contributions: fixed points, re-derivations, the planted neuron."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from me_interp import claims, names, synthetic
from me_interp.probes.ffn import (
    PROJECTIONS,
    STAGES,
    FfnShare,
    concentration,
    ffn_scan,
    ffn_share,
    neuron_contributions,
    neuron_scores,
    top_neurons,
)


def test_concentration_fixed_points():
    d = 37
    one_hot = torch.zeros(d)
    one_hot[5] = -4.0
    assert concentration(one_hot).item() == pytest.approx(1.0)
    assert concentration(torch.full((d,), 0.3)).item() == pytest.approx(1 / d)
    two = torch.zeros(d)
    two[[1, 2]] = 1.0
    assert concentration(two).item() == pytest.approx(0.5)


def test_concentration_matches_numpy_and_is_scale_invariant():
    h = torch.randn(3, 6, 50)
    e = h.double().numpy() ** 2
    p = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(concentration(h).numpy(), (p**2).sum(-1), rtol=1e-5)
    assert torch.allclose(concentration(h), concentration(1000 * h), rtol=1e-5)


def test_same_token_twice_gives_zero_delta_c():
    from me_interp.probes.alignment import delta_vs_others

    h = torch.randn(20).expand(1, 5, 20)
    c = concentration(h)
    assert (
        delta_vs_others(c, torch.ones(1, 5, dtype=torch.bool), torch.tensor([2])).abs().max() < 1e-7
    )


def test_neuron_contributions_sum_to_one_and_match_numpy():
    a = torch.randn(4, 30)
    W = torch.randn(12, 30)
    s = neuron_contributions(a, W)
    assert torch.allclose(s.sum(-1), torch.ones(4), atol=1e-4)
    an, Wn = a.double().numpy(), W.double().numpy()
    for b in range(4):
        y = Wn @ an[b]
        want = np.array([an[b, n] * (Wn[:, n] @ y) / (y @ y) for n in range(30)])
        np.testing.assert_allclose(s[b].numpy(), want, rtol=1e-4, atol=1e-6)


def test_ffn_scan_matches_a_full_capture(tiny_nobos, word_prompts, capture):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    ref = [2, 0, 1, 5]
    scan = ffn_scan(model, batch, positions=ref)
    sites = {
        "input": "ffn_in",
        "gate": "ffn_gate",
        "up": "ffn_up",
        "product": "ffn_act",
        "down": "ffn_out",
    }
    acts = capture(
        model,
        batch,
        {f"{s}{L}": names.site(site, L) for s, site in sites.items() for L in range(3)},
    )
    mask = batch.attention_mask.bool().numpy()
    for L in range(3):
        for s in STAGES:
            h = acts[f"{s}{L}"].double().numpy()
            e = h**2
            with np.errstate(invalid="ignore"):
                c = ((e / e.sum(-1, keepdims=True)) ** 2).sum(-1)
            for b, r in enumerate(ref):
                others = [t for t in range(h.shape[1]) if mask[b, t] and t != r]
                want = c[b, r] - c[b, others].mean()
                assert scan.delta_c(s)[L, b].item() == pytest.approx(want, rel=1e-4, abs=1e-6)
        hin = acts[f"input{L}"].double().numpy()
        hout = acts[f"down{L}"].double().numpy()
        for b, r in enumerate(ref):
            want = np.linalg.norm(hout[b, r]) / np.linalg.norm(hin[b, r])
            assert scan.magnification()[L, b].item() == pytest.approx(want, rel=1e-4)
        act = acts[f"product{L}"]
        assert torch.allclose(
            scan.act_at_ref[L], act[torch.arange(4), torch.tensor(ref)], atol=1e-6
        )
        # the neuron decomposition reproduces the captured FFN output exactly
        recon = scan.act_at_ref[L] @ model.ffn_weights(L).down.detach().T
        assert torch.allclose(recon, scan.out_at_ref[L], atol=1e-4)


def test_bad_inputs(tiny_nobos, word_prompts):
    scan = ffn_scan(tiny_nobos, tiny_nobos.tokenize(word_prompts))
    with pytest.raises(ValueError, match="unknown FFN stage"):
        scan.delta_c("W_q")
    with pytest.raises(ValueError, match="top must be"):
        top_neurons(tiny_nobos, scan, 0, top=0)
    with pytest.raises(ValueError, match="out of range"):
        top_neurons(tiny_nobos, scan, 7)
    with pytest.raises(ValueError, match="outside prompt"):
        ffn_scan(tiny_nobos, tiny_nobos.tokenize(word_prompts), positions=[0, 0, 3, 0])


# -- the planted model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def planted_ffn(planted, planted_prompts):
    model, plant = planted
    return model, ffn_scan(model, model.tokenize(planted_prompts)), plant


def test_planted_delta_c_peaks_at_the_planted_layer(planted_ffn):
    _, scan, plant = planted_ffn
    for s in PROJECTIONS:
        d = scan.delta_c(s).mean(-1)
        assert int(d.argmax()) == plant.layer, s
        assert d[plant.layer] > 0.5, s
        others = torch.cat([d[: plant.layer], d[plant.layer + 1 :]])
        assert others.abs().max() < 0.2, s


def test_planted_magnification_peaks_at_the_planted_layer(planted_ffn):
    _, scan, plant = planted_ffn
    mag = scan.magnification().mean(-1)
    assert int(mag.argmax()) == plant.layer
    assert mag[plant.layer] > 100 * mag[plant.layer - 1]
    assert scan.magnification_others()[plant.layer].mean() < 1.0


def test_planted_neuron_is_the_top_neuron(planted_ffn):
    model, scan, plant = planted_ffn
    table = top_neurons(model, scan, plant.layer, top=5)
    assert table.neurons[0] == plant.neuron
    assert table.mean_share[0] > 0.99
    assert table.to_dict()["neurons"][0]["neuron"] == plant.neuron
    assert len(table.neurons) == 5


# -- neuron scores and the FFN share ----------------------------------------------------------


def test_neuron_scores_by_hand(planted, capture):
    """score_n = mean_b ‖act_n · W_down[D, n]‖ from a hand-written FFN on the captured input; the
    planted neuron scores highest; ``rows`` averages over those prompts only."""
    model, plant = planted
    batch = model.tokenize(synthetic.planted_prompts(8))
    L, dims = plant.layer, [plant.massive_dim]
    pos = torch.zeros(len(batch), dtype=torch.long)
    got = neuron_scores(model, batch, L, pos, dims)
    x = capture(model, batch, {"x": names.ffn_in(L)})["x"][:, 0]  # [batch d_model] at position 0
    w = model.ffn_weights(L)
    act = torch.nn.functional.silu(x @ w.gate.detach().T) * (x @ w.up.detach().T)
    per_prompt = (act * w.down.detach()[plant.massive_dim]).abs()  # [batch d_mlp]
    torch.testing.assert_close(got, per_prompt.mean(0), atol=1e-4, rtol=1e-4)
    assert int(got.argmax()) == plant.neuron
    rows = [1, 4, 6]
    torch.testing.assert_close(
        neuron_scores(model, batch, L, pos, dims, rows),
        per_prompt[rows].mean(0),
        atol=1e-4,
        rtol=1e-4,
    )
    with pytest.raises(ValueError, match="dims must be"):
        neuron_scores(model, batch, L, pos, [])
    with pytest.raises(ValueError, match="dims must be"):
        neuron_scores(model, batch, L, pos, [model.d_model])


def test_ffn_share_by_hand_and_its_thresholds(planted, capture):
    """cos(FFN_p, h_p) and ‖FFN_p‖ / ‖h_p‖ from the captured activations; on the planted model the
    ME layer's FFN output is the massive token's state, one layer earlier it is not; ``is_state``
    at the edges of its thresholds."""
    model, plant = planted
    batch = model.tokenize(synthetic.planted_prompts(6))
    L = plant.layer
    acts = capture(
        model,
        batch,
        {n: n for L_ in (L - 1, L) for n in (names.ffn_out(L_), names.resid_post(L_))},
    )
    share = ffn_share(model, batch, L, 0, acts)
    f, h = acts[names.ffn_out(L)][:, 0].double(), acts[names.resid_post(L)][:, 0].double()
    cos = (f * h).sum(-1) / (f.norm(dim=-1) * h.norm(dim=-1))
    np.testing.assert_allclose(share.cos, cos.numpy(), rtol=1e-5)
    np.testing.assert_allclose(
        share.norm_ratio, (f.norm(dim=-1) / h.norm(dim=-1)).numpy(), rtol=1e-5
    )
    assert share.is_state() and share.to_dict()["is_state"] is True and "cosine" in share.text()
    assert not ffn_share(model, batch, L - 1, 0, acts).is_state()
    cos_min, tol = claims.threshold("ffn_state_cos"), claims.threshold("ffn_state_norm")
    assert FfnShare((1.0,), (1.0,)).is_state()
    assert not FfnShare((cos_min,), (1.0,)).is_state()  # strict: cos > cos_min
    assert FfnShare((cos_min + 1e-6,), (1.0,)).is_state()
    assert not FfnShare((1.0,), (1.0 + 1.01 * tol,)).is_state()
    assert FfnShare((1.0,), (1.0 - 0.99 * tol,)).is_state()
    assert FfnShare((cos_min + 0.002, cos_min), (1.0, 1.0)).is_state()  # on prompt means
    with pytest.raises(ValueError, match="outside the shortest prompt"):
        ffn_share(model, batch, L, min(batch.lengths), acts)
    with pytest.raises(ValueError, match="acts has no"):
        ffn_share(model, batch, L + 1, 0, acts)
    with pytest.raises(ValueError, match="rows for a batch"):
        ffn_share(model, batch, L, 0, {k: v[:2] for k, v in acts.items()})
