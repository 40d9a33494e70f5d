"""super_weight: the planted weight found exactly in every architecture and nothing on the twins; the
spikes against an independent HF computation; the edits restore exactly; the verdicts each
constructed model implies; CLI smoke; the bundled model (and Gemma-3-270m) with two-sided bounds."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from me_interp import claims, evaluation, io, load_model, synthetic
from me_interp.claims import (
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    NOT_APPLICABLE,
    NotApplicable,
    excess_fraction,
)
from me_interp.edits import down_weights_zeroed
from me_interp.experiments import super_weight as sw
from me_interp.packaged import GEMMA_3_270M
from me_interp.probes import down_proj as dp
from me_interp.probes.measurement import short_batch
from me_interp.study import execute, roundtrip

THR = claims.threshold("super_weight_spike")
IDS = [s.id for s in sw.SPECS]


def _prompt_file(tmp_path_factory, name, prompts):
    path = tmp_path_factory.mktemp("prompts") / f"{name}.txt"
    path.write_text("\n".join(prompts) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def shared_bos(tmp_path_factory):
    return _prompt_file(tmp_path_factory, "bos", synthetic.planted_prompts(16, 10))


@pytest.fixture(scope="module")
def distinct(tmp_path_factory):
    return _prompt_file(tmp_path_factory, "distinct", synthetic.distinct_first_prompts(16, 10))


def _verdicts(result):
    return {c.id.split(".", 1)[1]: c.verdict for c in claims.judge(sw.SPECS, result)}


def _run(model_name, prompts, **kw):
    model = load_model(model_name, device="cpu")
    return sw.run(sw.Config(prompts=prompts, **kw), model), model


# ---------------------------------------------------------------------------- the random control


def test_control_pool_and_draws(planted):
    model, plant = planted
    L, D, n = plant.layer, plant.massive_dim, plant.neuron
    pool = dp.control_pool(model, L, D, n, 50)
    W = model.ffn_weights(L).down.detach()
    assert len(pool) == 50 and (D, n) not in {(r, c) for r, c, _ in pool}
    mags = [abs(v) for _, _, v in pool]
    assert mags == sorted(mags, reverse=True)
    others = W.abs().clone()
    others[D, n] = -1
    assert mags[0] == pytest.approx(float(others.max())) and all(
        float(W[r, c]) == v for r, c, v in pool
    )
    d = dp.draw(pool, 3, seed=4)
    assert d == dp.draw(pool, 3, seed=4) and d != dp.draw(pool, 3, seed=5) and len(set(d)) == 3
    with pytest.raises(ValueError, match="cannot draw"):
        dp.draw(pool, 51, seed=0)


# ---------------------------------------------------------------------------- run and verdicts


def _check_result(res):
    d = io.to_jsonable(res)
    json.dumps(d)
    assert io.to_jsonable(roundtrip(res)) == d  # result.json reads back as the typed Result
    cs = claims.judge(sw.SPECS, res)
    assert [c.id for c in cs] == IDS
    for c in cs:
        kind = {"random_weights_harmless": "control", "restoring_recovers": "sanity"}
        assert c.kind == kind.get(c.id.split(".", 1)[1], "claim")
        json.dumps(c.to_dict())
    return d


def test_planted_nobos_verdicts_and_the_statistics_by_hand(distinct):
    """Token 0 differs in every prompt: zeroing the planted weight removes the activation, it is in
    the ME layer; the language model is random, so zeroing does not hurt (restoring: n/a)."""
    res, model = _run("synthetic:planted-nobos", distinct)
    plant = synthetic.planted_nobos()[2]
    assert res.super_weight.coord == (plant.layer, plant.massive_dim, plant.neuron)
    assert res.check_layer == plant.layer and res.n_prompts == 16 and res.n_texts == 16
    assert len(set(res.units.keys)) == 16
    assert _verdicts(res) == {
        "zeroing_removes": HOLDS,
        "zeroing_hurts": FAILS,
        "random_weights_harmless": HOLDS,
        "restoring_recovers": NOT_APPLICABLE,
        "in_me_layer": HOLDS,
    }
    by = {c.id.split(".", 1)[1]: c for c in claims.judge(sw.SPECS, res)}
    want = excess_fraction(np.mean(res.ratio_zeroed), np.mean(res.ratio_unedited))
    assert by["zeroing_removes"].estimate.value == pytest.approx(want) and want < 0.01
    # in_me_layer by hand: every layer's largest write zeroed alone; only the ME layer's removes
    assert [c.layer for c in res.layers] == list(range(5)) and res.precursor is None
    rho = {}
    for c in res.layers:
        zeroed, before = np.mean(c.ratio_zeroed), np.mean(res.prompt_ratio[c.check_layer])
        rho[c.layer] = max(0.0, 1 - (zeroed - 1) / (before - 1))
    top = max(v for L, v in rho.items() if L != plant.layer)
    est = by["in_me_layer"].estimate
    assert est.value == pytest.approx(rho[plant.layer] / (rho[plant.layer] + top), rel=1e-9)
    assert est.value > 0.99 and est.n_eff == 16
    # the perplexity ratio from an independent pooled perplexity of the same texts
    prompts = sw.Config(prompts=distinct).load_prompts()
    tb = sw.short_batch(model, prompts, 16, 48)
    base = evaluation.perplexity(model, tb)
    with down_weights_zeroed(model, [res.super_weight.coord]):
        zero = evaluation.perplexity(model, tb)
    assert res.ppl("unedited") == pytest.approx(base, rel=1e-6)
    # the texts ran for the ME layer's candidate, the best upstream one and the 3 that leave least
    # of the excess (text_candidates); each from the unedited prefix, as a whole forward would
    left = {
        c.coord: excess_fraction(np.mean(c.ratio_zeroed), np.mean(res.prompt_ratio[c.check_layer]))
        for c in res.layers
    }
    least = sorted(left, key=left.get)
    up = min((k for k in least if k[0] < plant.layer), key=left.get)
    want = {*least[: sw.N_TEXT], up, *(k for k in least if k[0] == plant.layer)}
    assert {c.coord for c in res.layers if c.nll is not None} == want != set(left)
    for c in res.layers:
        if c.nll is not None:
            with down_weights_zeroed(model, [c.coord]):
                assert res.layer_ppl_ratio(c) == pytest.approx(
                    evaluation.perplexity(model, tb) / base, rel=1e-5
                )
    assert by["zeroing_hurts"].estimate.value == pytest.approx(zero / base, rel=1e-6)
    d = _check_result(res)
    assert d["candidates"][0]["layer"] == plant.layer and d["header"]["layer"] == plant.layer
    assert res.ppl("zeroed") == pytest.approx(zero, rel=1e-6)
    assert set(sw.figures(res)) == {"down_proj_spikes", "perplexity"}
    assert "W_down[7, 5]" in sw.summary(res)


def test_needsink_hurts_and_restoring_is_exact(shared_bos):
    """planted-needsink: zeroing destroys the sink its language model needs; the planted neuron fires
    on the massive token only, so restoring its activation there restores every text exactly (a
    zero-width interval: not decided); the random large weights do nothing."""
    res, model = _run("synthetic:planted-needsink", shared_bos)
    v = _verdicts(res)
    assert v["zeroing_hurts"] == HOLDS and _damage_ok(res, 100, 1e5)
    assert v["random_weights_harmless"] == HOLDS
    np.testing.assert_allclose(res.per_text("restored"), res.per_text("unedited"), rtol=1e-6)
    assert set(res.restore_positions) == {0}
    # a sanity check may be exact: it holds (the engine decides no other kind on a zero width)
    assert v["restoring_recovers"] == HOLDS
    # one shared BOS: the prefix claims rest on one distinct measurement
    assert v["zeroing_removes"] == INCONCLUSIVE and v["in_me_layer"] == INCONCLUSIVE
    # the control's cells by hand: (nll_bs − nll_b) / mean n, and exp(mean) = geometric mean ratio
    cells = res.random_cells()
    base, n = res.per_text("unedited"), res.per_text("n_pred")
    for s, draw in enumerate(res.random_draws):
        assert len(draw) == 1 and (draw[0][0], draw[0][1]) != (
            res.super_weight.row,
            res.super_weight.col,
        )
        np.testing.assert_allclose(cells[:, s], (np.asarray(res.texts.random[s]) - base) / n.mean())
    assert math.exp(cells.mean()) == pytest.approx(res.ppl("random") / res.ppl("unedited"))
    assert res.pool.size == 100 and res.pool.n_at_least == 0  # the planted weight is the largest


def _damage_ok(res, lo, hi):
    return lo < res.ppl("zeroed") / res.ppl("unedited") < hi


@pytest.mark.parametrize(
    "name,verdict", [("superweight-spread", FAILS), ("superweight-spread-mild", HOLDS)]
)
def test_restoring_fails_where_the_super_weight_also_acts_on_other_tokens(
    shared_bos, name, verdict
):
    res, _ = _run(f"synthetic:{name}", shared_bos)
    plant = synthetic.planted_llama()[2]
    assert res.super_weight.coord == (plant.layer, plant.massive_dim, plant.neuron)
    v = _verdicts(res)
    assert v["zeroing_hurts"] == HOLDS and v["restoring_recovers"] == verdict
    rec = {c.id: c for c in claims.judge(sw.SPECS, res)}["super_weight.restoring_recovers"]
    a = res.per_text
    want = (a("zeroed").sum() - a("restored").sum()) / (a("zeroed").sum() - a("unedited").sum())
    assert rec.estimate.value == pytest.approx(want)
    if verdict == FAILS:
        assert want < 0.3
    else:
        assert 0.9 < want < 1.0 and rec.estimate.lo < rec.estimate.hi


def test_rewritten_decoy_the_super_weight_is_the_later_writer(distinct):
    """decoy-rewritten: layer 3's neuron writes more along the massive dim than the ME layer did, so
    the largest write is outside the ME layer, and zeroing it leaves layer 2's activation; but the
    later writer only amplifies what the ME layer made, so zeroing the ME layer's weight removes
    more (all of it): by causal effect the super weight is in the ME layer."""
    res, _ = _run("synthetic:decoy-rewritten", distinct)
    rec = synthetic.decoy("rewritten")[2]
    late, neuron = rec.late_writer
    assert res.super_weight.coord == (late, rec.massive_dim, neuron)
    assert res.me_layer == rec.layers[0] and res.check_layer == late
    coords = [c.coord for c in res.candidates]
    assert (rec.layers[0], rec.massive_dim, rec.neuron) in coords  # the ME layer's is a candidate
    v = _verdicts(res)
    assert v["in_me_layer"] == HOLDS and v["zeroing_removes"] == FAILS
    left = {c.layer: claims.excess_stat(res.layer_pairs(c)) for c in res.layers}
    assert left[rec.layers[0]] < 0.01 < 0.2 < left[late] < 0.4


def test_precursor_decoy_in_me_layer_fails(distinct):
    """decoy-precursor: layer 1's weight writes a precursor that two ME-layer neurons amplify, so
    zeroing it removes the activation, while zeroing the ME layer's top weight leaves 40 %."""
    res, _ = _run("synthetic:decoy-precursor", distinct, n_random=0)
    rec = synthetic.decoy("precursor")[2]
    assert res.me_layer == rec.layers[1] and res.super_weight.coord == (2, 7, rec.neuron)
    p = res.precursor
    assert p.coord == (rec.layers[0], rec.massive_dim, synthetic.PRECURSOR_NEURON)
    assert claims.excess_stat(res.layer_pairs(p)) < 0.01
    me = next(c for c in res.layers if c.layer == res.me_layer)
    assert 0.35 < claims.excess_stat(res.layer_pairs(me)) < 0.45
    v = _verdicts(res)
    assert v["in_me_layer"] == FAILS and v["zeroing_removes"] == FAILS
    c = {c.id: c for c in claims.judge(sw.SPECS, res)}["super_weight.in_me_layer"]
    assert c.estimate.hi < 0.45 and "precursor upstream of it: layer 1 W_down[7, 9]" in c.details


def test_not_applicable_without_a_massive_activation_or_a_super_weight(twin, distinct, shared_bos):
    model, _ = twin
    cfg = sw.Config(prompts=shared_bos)
    with pytest.raises(NotApplicable, match="no massive activation"):
        sw.run(cfg, model)
    out = execute(sw.EXPERIMENT, cfg, model)
    assert [c.verdict for c in out.claims] == [NOT_APPLICABLE] * len(sw.SPECS)
    # decoy-attention: the massive activation is written by a head, no W_down weight writes it
    res, _ = _run("synthetic:decoy-attention", distinct)
    assert res.super_weight is None and res.candidates == [] and not res.texts
    cs = claims.judge(sw.SPECS, res)
    assert {c.verdict for c in cs} == {NOT_APPLICABLE}
    assert all("no super weight" in c.why for c in cs)
    assert set(sw.figures(res)) == {"down_proj_spikes"} and "none" in sw.summary(res)


def test_a_given_weight_is_tested_instead(distinct):
    """--weight: the causal tests zero the given weight (here a random one of the ME layer, which
    changes nothing); the detection still reports the planted one."""
    plant = synthetic.planted_nobos()[2]
    res, _ = _run("synthetic:planted-nobos", distinct, weight=(plant.layer, 1, 2), n_random=0)
    assert res.given is not None and res.super_weight.coord == (plant.layer, 1, 2)
    assert res.detected.coord == (plant.layer, plant.massive_dim, plant.neuron)
    v = _verdicts(res)
    assert v["zeroing_removes"] == FAILS and v["in_me_layer"] == HOLDS
    assert v["random_weights_harmless"] == NOT_APPLICABLE  # 0 seeds
    assert "given weight" in sw.summary(res)


def test_config_checks():
    for bad, match in (
        ({"top_k": 0}, "top_k"),
        ({"text_tokens": 1}, "text_tokens"),
        ({"max_texts": -1}, "max_texts"),
        ({"n_random": -1}, "n_random"),
        ({"pool": 0}, "pool must be >= 1"),
        ({"weight": (1, 2)}, "weight must hold 3 values"),
    ):
        with pytest.raises(ValueError, match=match):
            sw.Config(**bad)


def survey_column(model, prompts):
    """The super-weight column as the survey experiment reads it: 16 prompts cut to 16 tokens."""
    return dp.survey(model, short_batch(model, prompts, 16, 16))


def test_survey_column(planted, twin):
    model, plant = planted
    entry = survey_column(model, synthetic.planted_prompts(8))
    assert entry.super_weight.layer == plant.layer
    assert (entry.super_weight.row, entry.super_weight.col) == (plant.massive_dim, plant.neuron)
    assert entry.text() == "2 [7, 5] (ME layer; top on 100%)"
    none = survey_column(twin[0], synthetic.planted_prompts(8))
    assert none.me_layer is None and none.super_weight is None and none.text() == ""
    assert dp.SuperWeightCell(error="X: y").text() == "error: X: y"
    assert dp.SuperWeightCell(me_layer=3).text() == "none"


# ---------------------------------------------------------------------------- command line


def test_cli_smoke(shared_bos, tmp_path, capsys):
    argv = [
        "--model",
        "synthetic:planted-needsink",
        "--prompts",
        shared_bos,
        "--out",
        str(tmp_path),
    ]
    assert sw.main([*argv, "--device", "cpu", "--max-texts", "8"]) == 0
    out = capsys.readouterr().out
    assert "super_weight.zeroing_hurts" in out and "W_down[7, 5]" in out
    run_dir = next((tmp_path / sw.NAME).iterdir())
    result = json.loads((run_dir / "result.json").read_text())
    verdicts = {c["id"]: c["verdict"] for c in result["claims"]}
    assert verdicts["super_weight.zeroing_hurts"] == HOLDS
    assert result["candidates"][0]["row"] == 7 and result["n_texts"] == 8
    assert io.read_result(sw.Result, run_dir).super_weight.row == 7
    assert {c["id"] for c in result["claims"]} == set(IDS)
    assert (run_dir / "down_proj_spikes.html").is_file() and (run_dir / "perplexity.html").is_file()


def test_cli_not_applicable_and_bad_input(shared_bos, tmp_path, capsys):
    argv = ["--prompts", shared_bos, "--out", str(tmp_path), "--device", "cpu"]
    assert sw.main(["--model", "synthetic:twin", *argv]) == 0
    assert "not applicable" in capsys.readouterr().out
    assert sw.main(["--model", "synthetic:planted", *argv, "--weight", "9", "0", "0"]) == 2
    assert "out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sw.main(["--help"])
    assert e.value.code == 0 and "--weight" in capsys.readouterr().out


# ---------------------------------------------------------------------------- real models


@pytest.mark.slow
def test_bundled(bundled):
    """SmolLM2-135M: W_down[507, 1229] of the ME layer 11 is the super weight on every prompt (73 %
    of the super activation); zeroing it multiplies perplexity by ~18 and restoring the super
    activation takes all of it back, yet it leaves ~29 % of the massive excess (neuron 1487 makes
    the rest). Defaults: 16 prompts of 16 tokens, 16 texts of 48 tokens (docs/super_weight.md)."""
    res = sw.run(sw.Config(), bundled)
    s = res.super_weight
    assert res.me_layer == 11 and s.coord == (11, 507, 1229) and s.stability == 1.0
    assert 5.5 < s.weight < 6.2 and 0.6 < s.share < 0.85 and s.abs_rank == 1
    assert 1e4 < s.write < 3e4 and s.me_neuron and s.massive_dim
    assert res.me_neurons.top_neurons[:2] == [1229, 1487]
    assert 507 in res.massive_dims and (11, 507, 1229) in {
        (d.layer, d.row, d.col) for d in res.yu_layers
    }
    assert res.erasers[28].row == 507 and res.erasers[28].write > 5e3  # the late eraser
    assert 8 < res.ppl("zeroed") / res.ppl("unedited") < 40
    assert abs(res.ppl("restored") / res.ppl("unedited") - 1) < 0.01
    assert 0.2 < excess_fraction(np.mean(res.ratio_zeroed), np.mean(res.ratio_unedited)) < 0.4
    assert _verdicts(res) == {
        "zeroing_removes": FAILS,
        "zeroing_hurts": HOLDS,
        "random_weights_harmless": HOLDS,
        "restoring_recovers": HOLDS,
        # by causal effect the super weight is not singled out: Yu's coordinate of layer 9,
        # W_down[507, 200], leaves 0.063 of the ME-layer excess; layer 2's [507, 90] 0.287 and
        # doubles perplexity (issue 29 item 2); the ME layer's share is 0.43 (measured)
        "in_me_layer": FAILS,
    }
    left = {c.coord: claims.excess_stat(res.layer_pairs(c)) for c in res.layers}
    assert (
        0.2 < left[(2, 507, 90)] < 0.4
        and 1.5 < res.layer_ppl_ratio(next(c for c in res.layers if c.coord == (2, 507, 90))) < 2.5
    )
    assert res.precursor.coord == (9, 507, 200) and left[(9, 507, 200)] < 0.15


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec(GEMMA_3_270M.module) is None,
    reason=f"{GEMMA_3_270M.requirement} is not installed",
)
def test_gemma_3_270m():
    """Gemma-3-270m: the ME layer is 0 (the post-FFN norm's gain makes it); down_proj itself writes
    under 50 there, so the largest building write into <bos>'s residual stream is a post-normed one
    of a later layer on dim 163, and zeroing it hardly changes perplexity."""
    model = load_model("gemma-3-270m", device="cpu", dtype="float32")
    res = sw.run(sw.Config(max_texts=8, text_tokens=24, n_random=5), model)
    assert res.me_layer == 0 and res.yu_layers == []
    assert max(res.out_max[0]) < THR < max(res.in_max[0])
    s = res.super_weight
    assert s.row == 163 and s.layer > 2 and not s.in_me_layer and s.stability == 1.0
    assert 0.8 < res.ppl("zeroed") / res.ppl("unedited") < 1.5
    v = _verdicts(res)
    assert v["zeroing_hurts"] == FAILS and v["in_me_layer"] == INCONCLUSIVE  # one <bos>
    assert v["random_weights_harmless"] == HOLDS
