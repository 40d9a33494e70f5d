"""The mechanism, invariance and attention_sinks experiments: the verdicts the planted construction
implies, nothing holding on models without a massive activation, CLI smoke tests, bad inputs, and the
bundled model's measured values with two-sided bounds."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from me_interp import claims, synthetic
from me_interp.experiments import attention_sinks, invariance, mechanism
from me_interp.models import LoadedModel

MODULES = (mechanism, invariance, attention_sinks)
H, F, NA = claims.HOLDS, claims.FAILS, claims.NOT_APPLICABLE

# What synthetic.planted_llama implies, claim by claim: at layer 2 the pre-FFN RMSNorm gains of dims
# 3 and 11 are 8 (the others ~1) and the BOS token carries a marker on them; FFN neuron 5 reads them
# and writes the massive dim 7; nothing later writes dim 7; head 0 of every layer attends to dim 7.
PLANTED = {
    "mechanism": {
        "mechanism.frac_aligned": H,  # only the BOS token has energy on the boosted gain dims
        "mechanism.frac_peak": H,  # ... and only at layer 2 are they the top-|w| dims
        "mechanism.kl_aligned": H,  # the BOS token's energy follows the boosted gains
        # After layer 2 the BOS token is one-hot on dim 7 while the gains are flat, so ΔKL is large
        # and *positive* at layers 3-4: the other layers' ΔKL is bimodal, and layer 2's −ΔKL (the
        # largest) is only ~2.5 of their standard deviations above their mean: below null_z = 3.
        "mechanism.kl_peak": F,
        "mechanism.dc_gate_peak": H,  # neuron 5's gate is the only one the marker drives
        "mechanism.dc_up_peak": H,
        "mechanism.dc_down_peak": H,  # W_down of neuron 5 writes dim 7 only
        "mechanism.magnification_peak": H,
        "mechanism.few_neurons": H,  # neuron 5 writes ~100 % of it
    },
    # Every planted prompt starts with BOS (the sink token): cross-input invariance would be trivial.
    "invariance": {
        "invariance.state": NA,
        "invariance.beyond_others": NA,
        "invariance.key": NA,
        "invariance.created_at_me": NA,
        "invariance.control": H,  # sanity
    },
    "attention_sinks": {
        "attention_sinks.sink_downstream": H,  # head 0 reads dim 7, which is 0 before layer 2's FFN
        "attention_sinks.entropy_drop": H,  # 1 of 4 heads collapses onto BOS: entropy −25 %
        "attention_sinks.rank_drop_all": H,  # sanity: one huge token makes the states rank ~1
        "attention_sinks.rank_drop_others": F,  # the other tokens keep their dimension
    },
}
# The planted model without BOS, with the sink token <s> second: the massive token (position 1) then
# follows different first tokens, and the cross-input claims apply.
PLANTED_SECOND = {
    "invariance.state": H,  # after layer 2 the massive dim dominates the state
    "invariance.beyond_others": H,  # the other tokens are random words
    "invariance.key": H,  # the keys of layers > 2 read the massive dim
    # <s>'s own embedding already dominates its state before layer 2 (cos ≈ 1 from layer 0 on)
    "invariance.created_at_me": F,
    "invariance.control": H,
}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(synthetic.planted_prompts(16, 10)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def planted_results(planted, prompt_file):
    model, plant = planted
    return {m.NAME: m.run(m.Config(prompts=prompt_file), model) for m in MODULES}, plant


def _verdicts(result) -> dict[str, str]:
    return {c.id: c.verdict for c in _claims(result)}


def _claims(result) -> list[claims.Claim]:
    """The claims of ``result``: its experiment module's ``verdicts``."""
    return importlib.import_module(type(result).__module__).verdicts(result)


def _check_claims(module, result):
    claims.check_specs(module.SPECS)
    assert [c.id for c in _claims(result)] == [s.id for s in module.SPECS]
    assert module.verdicts(result) == module.verdicts(result)  # seeded: the same intervals
    kinds = {s.id: s.kind for s in module.SPECS}
    for c in _claims(result):
        assert isinstance(c, claims.Claim) and c.kind == kinds[c.id]
        assert c.id.startswith(module.NAME + ".")
        if c.verdict != NA:
            est = c.estimate
            assert est is not None and est.n == result.n_prompts and est.method == "bootstrap"
            assert est.resamples >= 1000 and est.lo <= est.hi
            assert c.threshold == claims.threshold(
                next(s for s in module.SPECS if s.id == c.id).threshold
            )
            assert c.details
    d = result.to_dict()
    json.dumps(d["per_prompt"])  # serialisable
    for v in d["per_prompt"].values():
        assert len(v) == result.n_prompts


def _no_bos(model) -> LoadedModel:
    return LoadedModel(
        model.bridge, model.hf, model.tokenizer, "p", "no", model.dtype, model.device
    )


# -- planted model: the answers the construction implies -----------------------------------


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.NAME)
def test_planted_verdicts_are_what_the_construction_implies(module, planted_results):
    res, plant = planted_results
    r = res[module.NAME]
    _check_claims(module, r)
    assert r.me_layer == plant.layer == r.detected_me_layer
    assert _verdicts(r) == PLANTED[module.NAME]


def test_planted_mechanism_numbers(planted_results):
    res, plant = planted_results
    r = res["mechanism"]
    assert r.neuron_layer == plant.layer and r.neurons["neurons"][0]["neuron"] == plant.neuron
    d = r.to_dict()
    for row in d["layers"]:
        assert {"delta_frac", "delta_kl", "delta_c", "magnification"} <= set(row)
        assert set(row["delta_c"]) == {"input", "gate", "up", "product", "down"}
    assert d["gain_ranks"]["ffn"][plant.layer][0]["dim"] == plant.massive_dim
    assert np.asarray(d["per_prompt"]["delta_kl"]).shape == (r.n_prompts, 5)
    by_id = {c.id: c for c in _claims(r)}
    assert by_id["mechanism.few_neurons"].estimate.lo > 0.99
    kl = by_id["mechanism.kl_peak"].estimate
    assert 1.5 < kl.lo <= kl.hi < 3.0  # the largest −ΔKL, but a bimodal null (see PLANTED)
    assert np.argmax(r.series("delta_kl")) != plant.layer == np.argmin(r.series("delta_kl"))


def test_planted_attention_sink_numbers(planted_results):
    res, plant = planted_results
    r = res["attention_sinks"]
    rates = r.series("sink_rate")
    assert max(rates[: plant.layer + 1]) == 0.0 and min(rates[plant.layer + 1 :]) > 0.0
    heads = r.layers[plant.layer + 1]["head_attn_to_massive"]
    assert max(range(len(heads)), key=heads.__getitem__) == plant.sink_head
    ent = {c.id: c for c in _claims(r)}["attention_sinks.entropy_drop"].estimate
    assert 0.2 < ent.lo <= ent.hi < 0.35


def test_planted_invariance_with_the_sink_token_second(planted, tmp_path):
    model, plant = planted
    p = tmp_path / "p.txt"
    p.write_text(
        "\n".join(f"w{7 * i % 60} <s> " + synthetic.words(8, 3 * i + 1) for i in range(16)) + "\n"
    )
    r = invariance.run(invariance.Config(prompts=str(p)), _no_bos(model))
    _check_claims(invariance, r)
    assert r.me_layer == plant.layer and r.reference_positions == [1] * 16
    assert r.n_pairs_distinct == 120
    assert _verdicts(r) == PLANTED_SECOND


def test_planted_attention_sinks_with_the_massive_token_elsewhere(planted, tmp_path):
    """The massive token at position 2: the geometry without it is re-measured for those prompts."""
    from me_interp.probes import geometry_scan

    model, plant = planted
    model = _no_bos(model)
    p = tmp_path / "p.txt"
    p.write_text("\n".join(f"w{i} w{i + 9} <s> " + synthetic.words(7, 2 * i) for i in range(8)))
    r = attention_sinks.run(attention_sinks.Config(prompts=str(p)), model)
    assert r.reference_positions == [2] * 8
    want = geometry_scan(model, model.tokenize(p.read_text().splitlines()), positions=[2] * 8)
    np.testing.assert_allclose(
        r.series("effective_rank_others"), want.mean("effective_rank", "others"), rtol=1e-5
    )
    assert _verdicts(r)["attention_sinks.sink_downstream"] == H


# -- models without a massive activation ----------------------------------------------------


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.NAME)
@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_not_applicable_without_a_massive_activation(module, fixture, request, prompt_file):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    with pytest.raises(claims.NotApplicable, match="no massive activation on this model"):
        module.run(module.Config(prompts=prompt_file), model)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.NAME)
@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_a_given_layer_on_a_null_model_claims_nothing(module, fixture, request, prompt_file):
    """--layer forces the measurement on a model without the mechanism: no claim may hold."""
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    r = module.run(module.Config(prompts=prompt_file, layer=2), model)
    assert r.me_layer == 2 and r.detected_me_layer is None and "given" in r.me_text()
    held = [c.id for c in _claims(r) if c.kind == "claim" and c.verdict == H]
    assert held == []


def test_position_zero_option_and_neuron_layer(planted, prompt_file):
    model, plant = planted
    r = mechanism.run(
        mechanism.Config(prompts=prompt_file, position="zero", neuron_layer=0, k_abs=2), model
    )
    assert r.k == 2 and r.neuron_layer == 0 and r.neurons["chosen_as"] == "given"
    assert r.reference_positions == [0] * r.n_prompts
    assert _verdicts(r)["mechanism.few_neurons"] == F  # layer 0 has no dominant neuron
    with pytest.raises(ValueError, match="out of range"):
        mechanism.run(mechanism.Config(prompts=prompt_file, neuron_layer=9), model)
    with pytest.raises(ValueError, match="out of range"):
        mechanism.run(mechanism.Config(prompts=prompt_file, layer=9), model)


def test_peak_z_and_relative_drop_helpers():
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 1.0, size=(40, 6))
    x[:, 2] += 10.0
    z = mechanism.peak_z(x, 2, seed=0)
    want = claims.null_z(x.mean(0).tolist(), 2)
    assert z.value == pytest.approx(want) and z.lo < want < z.hi and z.n == 40
    x[3, 4] = np.inf  # a layer that is not finite everywhere leaves the null
    assert mechanism.peak_z(x, 2, seed=0).value == pytest.approx(
        claims.null_z(np.delete(x, 4, axis=1).mean(0).tolist(), 2)
    )
    assert np.isnan(mechanism.peak_z(x, 4, seed=0).value)
    ref, val = np.full(30, 2.0), np.full(30, 1.5)
    d = mechanism.relative_drop(ref, val, seed=0)
    assert d.value == pytest.approx(0.25) and d.lo == pytest.approx(0.25)


def test_pair_bootstrap_resamples_prompts_not_pairs():
    n = 12
    first = np.arange(n) % 4  # 4 first tokens: pairs with equal first tokens are excluded
    pairs = first[:, None] != first[None, :]
    mats = np.stack([np.full((n, n), 0.5), np.add.outer(first, first) / 10.0])
    est = invariance.pair_estimate(mats, pairs, np.min, seed=0)
    want = min(m[pairs].mean() for m in mats)
    assert est.value == pytest.approx(want) and est.n == n
    assert est.lo <= est.value <= est.hi
    single = invariance.pair_estimate(mats[:1], pairs, np.min, seed=0)
    assert single.lo == single.hi == pytest.approx(0.5)  # a constant: every resample agrees


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
    assert [c["id"] for c in result["claims"]] == [s.id for s in module.SPECS]
    assert all(
        set(c) >= {"verdict", "estimate", "rule", "control", "line"} for c in result["claims"]
    )
    row = result["layers"][0]
    keys = {
        "mechanism": {"delta_frac", "delta_kl", "delta_c"},
        "invariance": {"cos_across_inputs", "key_cos_across_inputs", "norm_cv"},
        "attention_sinks": {"sink_rate", "attn_entropy", "effective_rank", "bos_attention"},
    }[module.NAME]
    assert keys <= set(row)
    assert (runs[0] / "config.json").is_file() and (runs[0] / "env.json").is_file()
    assert list(runs[0].glob("*.html"))
    printed = capsys.readouterr().out
    assert "results:" in printed and f"{module.NAME}." in printed and "95% CI" in printed


@pytest.mark.parametrize(
    "module, argv, msg",
    [
        (mechanism, ["--k-frac", "0"], "fractional k"),
        (mechanism, ["--k-abs", "-1"], "k_abs"),
        (mechanism, ["--criterion", "max"], "criterion"),
        (invariance, ["--layer", "-1"], "layer"),
        (attention_sinks, ["--criterion", "loud"], "criterion"),
    ],
)
def test_cli_rejects_bad_input(module, argv, msg, tmp_path, capsys):
    rc = module.main(["--model", "synthetic:planted", "--out", str(tmp_path), *argv])
    assert rc == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize(
    "module, flag", [(invariance, "--threshold"), (attention_sinks, "--eps")], ids=str
)
def test_thresholds_are_not_flags(module, flag):
    """The decision thresholds live in claims.THRESHOLDS, not in each experiment's config."""
    with pytest.raises(SystemExit):
        module.main([flag, "0.5"])


def test_invariance_needs_two_prompts(planted, tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("w1 w2 w3\n")
    with pytest.raises(ValueError, match="at least 2 prompts"):
        invariance.run(invariance.Config(prompts=str(one)), planted[0])


# -- the bundled model: measured values, two-sided bounds ------------------------------------
# Measured with the built-in prompts (82, 23-243 tokens, every first token different), fp32, seed 0.


@pytest.fixture(scope="module")
def bundled_results(bundled):
    return {m.NAME: m.run(m.Config(), bundled) for m in MODULES}


def _est(result, cid):
    return next(c for c in _claims(result) if c.id == cid).estimate


@pytest.mark.slow
def test_bundled_mechanism(bundled_results):
    r = bundled_results["mechanism"]
    me = r.me_layer
    assert me == 11 and r.k == 6 and r.n_prompts >= 64
    assert _verdicts(r) == {
        "mechanism.frac_aligned": H,  # 0.83 [0.81, 0.85]: Frac 0.058 vs 0.010
        "mechanism.frac_peak": F,  # ΔFrac is larger at layers 2, 9, 28, 29: z −0.44
        "mechanism.kl_aligned": H,  # 0.70 [0.69, 0.70]: KL 0.72 vs 2.38 nats
        "mechanism.kl_peak": F,  # the most negative ΔKL, but layers 3-8 and 27 are ~+5: z 1.58
        "mechanism.dc_gate_peak": F,  # z 0.60: larger at layers 27-28
        "mechanism.dc_up_peak": H,  # z 4.1
        "mechanism.dc_down_peak": F,  # 0.96 at ME, the largest, but 0.83-0.85 at 2, 9, 28: z 2.96
        "mechanism.magnification_peak": H,  # 4200× vs 10-1000× elsewhere: z 3.5 (log10)
        "mechanism.few_neurons": H,  # neurons 1229 and 1487: 99.7 %
    }
    assert 0.75 < _est(r, "mechanism.frac_aligned").lo < 0.9
    assert -0.6 < _est(r, "mechanism.frac_peak").value < -0.3
    assert 0.65 < _est(r, "mechanism.kl_aligned").lo < 0.75
    assert 1.3 < _est(r, "mechanism.kl_peak").value < 1.9
    assert 3.5 < _est(r, "mechanism.dc_up_peak").lo < 5.0
    dc_down = _est(r, "mechanism.dc_down_peak")
    assert 2.7 < dc_down.lo <= dc_down.hi < 3.0
    assert 3.2 < _est(r, "mechanism.magnification_peak").lo < 3.8
    assert 0.99 < _est(r, "mechanism.few_neurons").lo <= 1.0
    dkl = r.series("delta_kl")
    assert -2.0 < dkl[me] < -1.3 and min(range(30), key=dkl.__getitem__) == me
    down = r.series("delta_c", "down")
    assert 0.9 < down[me] < 0.99 and max(range(30), key=down.__getitem__) == me
    mag = r.series("magnification")
    assert 2000 < mag[me] < 8000 and max(range(30), key=mag.__getitem__) == me
    rows = r.neurons["neurons"]
    assert [n["neuron"] for n in rows[:2]] == [1229, 1487]
    assert 0.65 < rows[0]["share"] < 0.8 and 0.2 < rows[1]["share"] < 0.33
    g507 = next(g for g in r.gain_ranks["ffn"][me] if g["dim"] == 507)
    assert g507["rank"] >= 570 and g507["abs_gain"] < 1e-3  # the massive dim has a tiny gain


@pytest.mark.slow
def test_bundled_invariance(bundled_results):
    r = bundled_results["invariance"]
    assert r.me_layer == 11 and r.n_pairs_distinct == r.n_prompts * (r.n_prompts - 1) // 2
    assert _verdicts(r) == {
        "invariance.state": H,  # min over layers ≥ 11 of the cross-input cosine: 0.96 (layer 29)
        "invariance.beyond_others": H,  # the other tokens' cosine is 0.36-0.61
        "invariance.key": H,  # ≥ 0.996 at layers 12-29
        "invariance.created_at_me": F,  # already 0.996 at layers 2-8: +0.077 only
        "invariance.control": H,
    }
    state = _est(r, "invariance.state")
    assert 0.92 < state.lo <= state.hi < 0.99
    assert 0.3 < _est(r, "invariance.beyond_others").lo < 0.45
    assert 0.98 < _est(r, "invariance.key").lo < 1.0
    created = _est(r, "invariance.created_at_me")
    assert 0.05 < created.lo <= created.hi < 0.12
    cos = r.series("cos_across_inputs")
    assert all(c > 0.999 for c in cos[11:28])
    assert 0.4 < cos[0] < 0.65 and 0.75 < cos[10] < 0.9 and min(cos[2:9]) > 0.99
    assert all(c == pytest.approx(1.0, abs=1e-5) for c in r.series("cos_across_inputs_control"))
    cme = r.cos_across_layers[11]
    assert min(cme[11:28]) > 0.95 and 0.4 < cme[29] < 0.8  # carried to layer 28, then rotated


@pytest.mark.slow
def test_bundled_attention_sinks(bundled_results):
    r = bundled_results["attention_sinks"]
    assert r.me_layer == 11
    assert _verdicts(r) == {
        "attention_sinks.sink_downstream": F,  # 0.81 at layer 3 already vs 0.92 after: +0.12
        "attention_sinks.entropy_drop": H,  # 1.54 -> 1.12 nats: 0.27 [0.26, 0.29]
        "attention_sinks.rank_drop_all": H,  # sanity: 27 -> 7
        "attention_sinks.rank_drop_others": F,  # 29 -> 33: the other tokens do not collapse
    }
    sink = _est(r, "attention_sinks.sink_downstream")
    assert 0.0 < sink.lo <= sink.hi < 0.2
    ent = _est(r, "attention_sinks.entropy_drop")
    assert 0.2 < ent.lo <= ent.hi < 0.35
    assert 0.65 < _est(r, "attention_sinks.rank_drop_all").lo < 0.85
    others = _est(r, "attention_sinks.rank_drop_others")
    assert -0.25 < others.lo <= others.hi < 0.0
    rate = r.series("sink_rate")
    assert 0.0 <= rate[11] < 0.05  # the ME layer's own attention has no sink ...
    assert min(rate[3:9]) > 0.7  # ... but layers before the ME layer already do
    assert min(rate[12:29]) > 0.65
    er, ero = r.series("effective_rank"), r.series("effective_rank_others")
    assert 30 < er[10] < 37 and 2.5 < er[11] < 3.5 and 30 < ero[11] < 37


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
