"""FFN concentration and neuron contributions: fixed points, re-derivations, the planted neuron."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from me_interp import names
from me_interp.probes.ffn import (
    PROJECTIONS,
    STAGES,
    concentration,
    ffn_scan,
    neuron_contributions,
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
