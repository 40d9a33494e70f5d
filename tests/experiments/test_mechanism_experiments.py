"""The mechanism, invariance and attention_sinks experiments: planted answers, CLI smoke tests, bad
inputs, and the bundled model's measured values with two-sided bounds."""

from __future__ import annotations

import json

import pytest

from me_interp.experiments import attention_sinks, invariance, mechanism

MODULES = (mechanism, invariance, attention_sinks)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    from me_interp import synthetic

    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(synthetic.planted_prompts()) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def planted_results(planted, prompt_file):
    model, plant = planted
    return {m.NAME: m.run(m.Config(prompts=prompt_file), model) for m in MODULES}, plant


def _holds(result):
    return [v["holds"] for v in result.verdicts]


def _check_verdicts(module, result):
    vs = module.verdicts(result)
    assert vs and vs == result.verdicts
    for v in vs:
        assert set(v) == {"claim", "measured", "holds"}
        assert isinstance(v["claim"], str) and v["claim"]
        assert isinstance(v["measured"], str) and v["measured"]
        assert v["holds"] in (True, False, None)


# -- planted model: the answers the construction implies -----------------------------------


def test_planted_mechanism(planted_results):
    res, plant = planted_results
    r = res["mechanism"]
    _check_verdicts(mechanism, r)
    assert r.me_layer == plant.layer and r.neuron_layer == plant.layer
    assert r.neurons["neurons"][0]["neuron"] == plant.neuron
    # ΔFrac > 0, ΔKL < 0, ΔC and magnification peaks: all at the planted layer; the massive dim
    # itself is not a large-gain dim (the gain sits on the FFN's input dims), which is shown as such.
    assert _holds(r) == [True, True, True, True, True, True, False, True]
    d = r.to_dict()
    for row in d["layers"]:
        assert {"delta_frac", "delta_kl", "delta_c", "magnification"} <= set(row)
        assert set(row["delta_c"]) == {"input", "gate", "up", "product", "down"}
    assert d["gain_ranks"]["ffn"][plant.layer][0]["dim"] == plant.massive_dim


def test_planted_invariance_is_inconclusive_because_every_prompt_starts_with_bos(planted_results):
    res, plant = planted_results
    r = res["invariance"]
    _check_verdicts(invariance, r)
    assert r.n_pairs_distinct == 0
    assert _holds(r) == [None, True]
    assert "same token" in r.verdicts[0]["measured"]
    assert all(row["cos_across_inputs_control"] == pytest.approx(1.0) for row in r.layers)


def test_planted_attention_sinks(planted_results):
    res, plant = planted_results
    r = res["attention_sinks"]
    _check_verdicts(attention_sinks, r)
    # sink downstream only; entropy drops; rank collapses with the massive token, not without it
    assert _holds(r) == [True, True, True, False]
    rates = [row["sink_rate"] for row in r.layers]
    assert max(rates[: plant.layer + 1]) == 0.0 and min(rates[plant.layer + 1 :]) > 0.0
    heads = r.layers[plant.layer + 1]["head_attn_to_massive"]
    assert max(range(len(heads)), key=heads.__getitem__) == plant.sink_head


def test_unplanted_twin_has_nothing_to_test(twin, prompt_file):
    model, _ = twin
    for m in (mechanism, attention_sinks, invariance):
        r = m.run(m.Config(prompts=prompt_file), model)
        assert r.me_layer is None
        assert _holds(r) == [None]


def test_position_zero_option_and_neuron_layer(planted, prompt_file):
    model, plant = planted
    r = mechanism.run(
        mechanism.Config(prompts=prompt_file, position="zero", neuron_layer=0, k_abs=2), model
    )
    assert r.k == 2 and r.neuron_layer == 0 and r.neurons["chosen_as"] == "given"
    assert r.reference_positions == [0] * r.n_prompts
    with pytest.raises(ValueError, match="out of range"):
        mechanism.run(mechanism.Config(prompts=prompt_file, neuron_layer=9), model)


# -- figures and CLI --------------------------------------------------------------------------


def test_figures_are_labelled(planted_results):
    res, _ = planted_results
    for m in MODULES:
        figs = m.figures(res[m.NAME])
        assert figs
        for name, fig in figs.items():
            lay = fig.layout
            assert lay.title.text, (m.NAME, name)
            assert lay.xaxis.title.text and lay.yaxis.title.text, (m.NAME, name)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.NAME)
def test_cli_writes_a_run(module, tmp_path, prompt_file, capsys):
    out = tmp_path / "runs"
    rc = module.main(["--model", "synthetic:planted", "--prompts", prompt_file, "--out", str(out)])
    assert rc == 0
    runs = list((out / module.NAME).iterdir())
    assert len(runs) == 1
    result = json.loads((runs[0] / "result.json").read_text())
    assert result["me_layer"] == 2 and result["me_layer_1based"] == 3
    assert result["verdicts"]
    row = result["layers"][0]
    keys = {
        "mechanism": {"delta_frac", "delta_kl", "delta_c"},
        "invariance": {"cos_across_inputs", "key_cos_across_inputs", "norm_cv"},
        "attention_sinks": {"sink_rate", "attn_entropy", "effective_rank", "bos_attention"},
    }[module.NAME]
    assert keys <= set(row)
    assert (runs[0] / "config.json").is_file() and (runs[0] / "env.json").is_file()
    assert list(runs[0].glob("*.html"))
    assert "results:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "module, argv, msg",
    [
        (mechanism, ["--k-frac", "0"], "fractional k"),
        (mechanism, ["--k-abs", "-1"], "k_abs"),
        (mechanism, ["--criterion", "max"], "criterion"),
        (invariance, ["--threshold", "1.5"], "threshold"),
        (attention_sinks, ["--eps", "1.5"], "eps"),
    ],
)
def test_cli_rejects_bad_input(module, argv, msg, tmp_path, capsys):
    rc = module.main(["--model", "synthetic:planted", "--out", str(tmp_path), *argv])
    assert rc == 2
    assert msg in capsys.readouterr().err


def test_invariance_needs_two_prompts(planted, tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("w1 w2 w3\n")
    with pytest.raises(ValueError, match="at least 2 prompts"):
        invariance.run(invariance.Config(prompts=str(one)), planted[0])


# -- the bundled model: measured values, two-sided bounds ------------------------------------


@pytest.fixture(scope="module")
def bundled_results(bundled):
    return {m.NAME: m.run(m.Config(), bundled) for m in MODULES}


@pytest.mark.slow
def test_bundled_mechanism(bundled_results):
    r = bundled_results["mechanism"]
    me = r.me_layer
    assert me == 11 and r.k == 6
    dkl = r.series("delta_kl")
    assert -2.5 < dkl[me] < -1.0 and min(range(30), key=dkl.__getitem__) == me
    dfrac = r.series("delta_frac")
    assert 0.0 < dfrac[me] < 0.1  # positive but small: not the peak
    assert max(range(30), key=dfrac.__getitem__) != me
    down = r.series("delta_c", "down")
    assert 0.9 < down[me] < 0.99 and max(range(30), key=down.__getitem__) == me
    assert 0.05 < r.layers[me]["delta_c"]["gate"] < 0.2
    mag = r.series("magnification")
    assert 2000 < mag[me] < 8000 and max(range(30), key=mag.__getitem__) == me
    rows = r.neurons["neurons"]
    assert [n["neuron"] for n in rows[:2]] == [1229, 1487]
    assert 0.65 < rows[0]["share"] < 0.8 and 0.2 < rows[1]["share"] < 0.33
    g507 = next(g for g in r.gain_ranks["ffn"][me] if g["dim"] == 507)
    assert g507["rank"] >= 570 and g507["abs_gain"] < 1e-3  # the massive dim has a tiny gain
    assert _holds(r) == [True, False, True, True, False, True, False, True]


@pytest.mark.slow
def test_bundled_invariance(bundled_results):
    r = bundled_results["invariance"]
    assert r.me_layer == 11 and r.n_pairs_distinct == 66
    cos = r.series("cos_across_inputs")
    assert all(c > 0.999 for c in cos[11:28])
    assert 0.5 < cos[0] < 0.7 and 0.8 < cos[10] < 0.9
    assert all(c == pytest.approx(1.0, abs=1e-5) for c in r.series("cos_across_inputs_control"))
    kmin = min(min(row) for row in r.series("key_cos_across_inputs")[11:])
    assert 0.9 < kmin < 0.95
    cme = r.cos_across_layers[11]
    assert min(cme[11:28]) > 0.95 and 0.4 < cme[29] < 0.8  # carried to layer 27, then rotated
    assert _holds(r) == [True, True, False]


@pytest.mark.slow
def test_bundled_attention_sinks(bundled_results):
    r = bundled_results["attention_sinks"]
    assert r.me_layer == 11
    sink = r.series("sink_rate")
    assert 0.0 <= sink[11] < 0.05  # the ME layer's own attention has no sink ...
    assert min(sink[3:10]) > 0.85  # ... but layers before the ME layer already do
    assert min(sink[12:29]) > 0.85
    er, ero = r.series("effective_rank"), r.series("effective_rank_others")
    assert 10 < er[10] < 12.5 and 1.3 < er[11] < 1.6
    assert 9.5 < ero[11] < 11.5
    ent = r.series("attn_entropy")
    assert 1.1 < ent[11] < 1.4
    assert _holds(r) == [False, True, True, False]


def test_sink_figure_shows_each_massive_position(planted_results):
    import dataclasses

    res, _ = planted_results
    r = res["attention_sinks"]
    n = len(r.layers)
    two = dataclasses.replace(r, attn_to_each_position={0: [0.5] * n, 3: [0.1] * n})
    names = [t.name for t in attention_sinks.figures(two)["sink_rate"].data]
    assert "mean attention to massive position 3" in names
    assert not any(
        "massive position" in t.name for t in attention_sinks.figures(r)["sink_rate"].data
    )
