"""rmsnorm_permutation and ffn_svd_ablation: the verdicts the planted construction implies, "not
applicable" on models without a massive activation, the edits and metrics against hand computations,
CLI smoke and bad inputs, and the bundled model with two-sided bounds."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

from me_interp import claims, io, load_model, names, synthetic
from me_interp.claims import FAILS, HOLDS, NOT_APPLICABLE, NotApplicable
from me_interp.edits import gains
from me_interp.experiments import ffn_svd_ablation, rmsnorm_permutation
from me_interp.study import execute, roundtrip

# What the planted construction implies (synthetic.planted_llama: layer 2's pre-FFN gain is 8 on the
# gain dims (3, 11); FFN neuron 5 reads them through gate and up and writes the massive dim 7; the
# pre-attention norm plays no part in the creation).
CONTROLS = {
    "rmsnorm_permutation.attn_permutation_keeps",
    "rmsnorm_permutation.other_dims_keep",
    "ffn_svd_ablation.svd_gate_random_keeps",
    "ffn_svd_ablation.svd_up_random_keeps",
    "ffn_svd_ablation.svd_down_random_keeps",
    "ffn_svd_ablation.random_neurons_keep",
}
"""The "random … keeps" comparisons: controls, never counted as evidence (issue 17 finding 6)."""
PLANTED_PERMUTATION = {
    # a random permutation moves the two large gains away from the dims the neuron reads
    "rmsnorm_permutation.ffn_permutation_removes": HOLDS,
    "rmsnorm_permutation.attn_permutation_keeps": HOLDS,
    "rmsnorm_permutation.top_dims_removes": HOLDS,  # the top-|w| dims are the gain dims
    "rmsnorm_permutation.other_dims_keep": HOLDS,  # the gain dims stay where the neuron reads them
    "rmsnorm_permutation.flatten_removes": HOLDS,  # gain 8 → about the mean (≈ 1.5)
}
PLANTED_SVD = {
    # the planted neuron is the top singular direction of each of its three matrices
    "ffn_svd_ablation.svd_gate_removes": HOLDS,
    "ffn_svd_ablation.svd_up_removes": HOLDS,
    "ffn_svd_ablation.svd_down_removes": HOLDS,
    "ffn_svd_ablation.svd_gate_random_keeps": HOLDS,  # the other directions do not carry it
    "ffn_svd_ablation.svd_up_random_keeps": HOLDS,
    "ffn_svd_ablation.svd_down_random_keeps": HOLDS,
    "ffn_svd_ablation.top_neuron_removes": HOLDS,  # neuron 5 alone makes it
    "ffn_svd_ablation.top_neurons_remove": HOLDS,
    "ffn_svd_ablation.random_neurons_keep": HOLDS,
}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "planted.txt"
    path.write_text("\n".join(synthetic.planted_prompts(8)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def nobos():
    """planted-nobos: the planted mechanism with token 0 distinct in every prompt, so that the
    massive token's state is a distinct measurement per prompt (the claims' units)."""
    hf, tok, plant = synthetic.planted_nobos()
    return load_model(hf, tokenizer=tok, device="cpu"), plant


@pytest.fixture(scope="module")
def nobos_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "distinct.txt"
    path.write_text("\n".join(synthetic.distinct_first_prompts(8)) + "\n")
    return str(path)


@pytest.fixture
def snap_hf():
    return lambda model: {k: v.detach().clone() for k, v in model.hf.state_dict().items()}


def _judge(module, res):
    return claims.judge(module.SPECS, res)


def _verdicts(cs):
    return {c.id: c.verdict for c in cs}


def _check_claims(cs, specs):
    """Every spec has exactly one claim, in order; judged claims carry an estimate and a rule."""
    assert [c.id for c in cs] == [s.id for s in specs]
    for c in cs:
        assert isinstance(c, claims.Claim)
        if c.verdict != NOT_APPLICABLE:
            assert c.estimate is not None and c.estimate.n >= 1
            assert "threshold 'removed'" in c.rule and c.control
        assert c.kind == ("control" if c.id in CONTROLS else "claim"), c.id
        json.dumps(c.to_dict())


def _check_result(result, n_prompts):
    d = io.to_jsonable(result)
    json.dumps(d)
    assert io.to_jsonable(roundtrip(result)) == d  # result.json reads back as the typed Result
    unedited = result.baseline.prompt_ratio_at(result.layer)
    assert unedited and len(unedited) == n_prompts
    before = np.mean(unedited)
    for row in result.rows:
        after = row.ratio_at_layer_per_prompt
        assert len(after) == n_prompts
        assert row.change == pytest.approx((np.mean(after) - 1) / (before - 1))  # excess left
    return d


# ---------------------------------------------------------------------------- rmsnorm_permutation


def test_other_dims_permutation_moves_only_small_gain_dims():
    w = torch.tensor([0.1, 5.0, 0.2, 0.3, 4.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1])
    perm = gains.other_dims_permutation(w, 2, seed=3)
    assert sorted(perm.tolist()) == list(range(12))
    moved = [i for i in range(12) if perm[i] != i]
    assert len(moved) == 4 and not {1, 4} & set(moved)  # 2 transpositions, no top-|w| dim
    assert all(perm[int(perm[i])] == i for i in moved)  # transpositions
    assert torch.equal(perm, gains.other_dims_permutation(w, 2, seed=3))
    assert not torch.equal(perm, gains.other_dims_permutation(w, 2, seed=4))
    with pytest.raises(ValueError, match="top_k"):
        gains.other_dims_permutation(w, 5, seed=0)


def test_rmsnorm_permutation_planted(nobos, nobos_prompts):
    model, plant = nobos
    cfg = rmsnorm_permutation.Config(prompts=nobos_prompts, n_prompts=0, top_k=2)
    res = rmsnorm_permutation.run(cfg, model)
    L = plant.layer
    assert res.layer == L and not res.header.layer_given and res.massive_at_layer
    assert set(res.top_dims_of("ffn")) == set(plant.gain_dims)
    assert res.survival("ffn", "random") == 0.0 and res.survival("ffn", "top") == 0.0
    assert res.survival("ffn", "other") == 1.0
    for kind in rmsnorm_permutation.KINDS:
        assert res.survival("attn", kind) == 1.0  # the pre-attention gain does not create it
    flat = {r.param: r for r in res.select("ffn", "flatten")}
    assert not flat[0.0].survives
    base = res.baseline.ratio_at(L)
    assert flat[0.0].ratio_at_layer < flat[0.5].ratio_at_layer < base  # monotone in α
    # the excess left by hand: (mean edited R − 1) / (mean unedited R − 1) at the layer
    row = res.select("ffn", "random")[0]
    want = (np.mean(row.ratio_at_layer_per_prompt) - 1) / (
        np.mean(res.baseline.prompt_ratio_at(L)) - 1
    )
    assert row.change == pytest.approx(want) and 0 <= row.change < 0.1
    assert len(res.select("ffn", "random")) == cfg.n_random == claims.MIN_SEEDS
    d = _check_result(res, len(synthetic.planted_prompts(8)))
    assert d["header"]["layer_1based"] == L + 1 and res.survival("ffn", "random") == 0.0
    cs = _judge(rmsnorm_permutation, res)
    _check_claims(cs, rmsnorm_permutation.SPECS)
    assert _verdicts(cs) == PLANTED_PERMUTATION
    by = {c.id: c for c in cs}
    perm = by["rmsnorm_permutation.ffn_permutation_removes"]
    assert perm.estimate.unit == "prompts × seeds" and perm.estimate.n == res.n_prompts
    assert perm.estimate.method == "two-way bootstrap (crossed)"
    # the point estimate is the mean over seeds of each seed's c (ratio of prompt means)
    assert perm.estimate.value == pytest.approx(np.mean(res.seed_changes("ffn", "random")))
    assert perm.estimate.lo < perm.estimate.value < perm.estimate.hi
    assert by["rmsnorm_permutation.flatten_removes"].estimate.unit == "prompts"
    assert set(rmsnorm_permutation.figures(res)) == {"ratio_after_edit", "flatten_sweep"}
    assert " c" in rmsnorm_permutation.summary(res)


def test_seed_measure_by_hand_and_the_nested_interval(nobos, nobos_prompts, planted, prompt_file):
    """The random controls' cells [prompt, seed] = R_b(edited) − 1 over the unedited R_b − 1 of the
    same prompts, whose ratio of means is the mean over seeds of c; the two-way crossed bootstrap
    (prompts with their denominators, and seeds shared by every prompt: a seed is one edit of the
    model) rebuilt by hand with the engine's seed; on prompts that share <s> one unit."""
    model, plant = nobos
    cfg = rmsnorm_permutation.Config(prompts=nobos_prompts, n_prompts=0, top_k=2, alphas=())
    res = rmsnorm_permutation.run(cfg, model)
    rows = res.select("attn", "random")
    before = np.asarray(res.baseline.prompt_ratio_at(plant.layer))
    want = np.array([[r.ratio_at_layer_per_prompt[b] - 1 for r in rows] for b in range(8)])
    m = res.seed_measure("attn", "random")
    np.testing.assert_allclose(m.values, want, rtol=1e-12)
    np.testing.assert_allclose(m.den, before - 1, rtol=1e-12)
    assert m.values.mean() / m.den.mean() == pytest.approx(np.mean([r.change for r in rows]))
    rng = np.random.default_rng(res.seed)
    n, k = m.values.shape
    iu = rng.integers(0, n, size=(claims.N_BOOTSTRAP, n))
    iseed = rng.integers(0, k, size=(claims.N_BOOTSTRAP, k))  # one seed draw per replicate
    boot = [m.values[iu[i]][:, iseed[i]].mean() / m.den[iu[i]].mean() for i in range(len(iu))]
    lo, hi = np.quantile(boot, [0.025, 0.975])
    c = {c.id: c for c in _judge(rmsnorm_permutation, res)}[
        "rmsnorm_permutation.attn_permutation_keeps"
    ]
    assert c.estimate.n == c.estimate.n_eff == 8  # eight distinct first tokens: eight units
    assert (c.estimate.lo, c.estimate.hi) == pytest.approx((lo, hi))
    assert c.kind == "control" and c.verdict == HOLDS
    assert "c per seed" in c.details
    # every prompt starts with <s>: the massive token's state is one measurement, not decided
    shared = rmsnorm_permutation.run(replace(cfg, prompts=prompt_file), planted[0])
    for c in _judge(rmsnorm_permutation, shared):
        if c.verdict == NOT_APPLICABLE:  # the flattening was not run (alphas=())
            continue
        assert c.estimate.n == 8 and c.estimate.n_eff == 1, c.id
        assert c.verdict == claims.INCONCLUSIVE and "1 distinct measurement" in c.why, c.id


def test_me_layer_at_the_last_layer(nobos_prompts):
    """A plant at the last layer: the edits act on it, nothing needs a later layer."""
    hf, tok, plant = synthetic.planted_nobos(layer=4)
    model = load_model(hf, tokenizer=tok, device="cpu")
    prompt_file = nobos_prompts
    cfg = rmsnorm_permutation.Config(prompts=prompt_file, top_k=2, norms=("ffn",), alphas=(0.0,))
    res = rmsnorm_permutation.run(cfg, model)
    assert res.layer == 4
    v = _verdicts(_judge(rmsnorm_permutation, res))
    assert v["rmsnorm_permutation.ffn_permutation_removes"] == HOLDS
    assert v["rmsnorm_permutation.attn_permutation_keeps"] == NOT_APPLICABLE  # not run
    cfg = ffn_svd_ablation.Config(prompts=prompt_file, ks=(1,), matrices=("down",), n_neurons=1)
    res = ffn_svd_ablation.run(cfg, model)
    v = _verdicts(_judge(ffn_svd_ablation, res))
    assert (
        v["ffn_svd_ablation.svd_down_removes"] == v["ffn_svd_ablation.random_neurons_keep"] == HOLDS
    )
    assert ffn_svd_ablation.summary(res) and ffn_svd_ablation.figures(res)


@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_rmsnorm_permutation_not_applicable_without_massive_activation(
    fixture, request, prompt_file
):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    cfg = rmsnorm_permutation.Config(prompts=prompt_file)
    with pytest.raises(NotApplicable, match="no massive activation"):
        rmsnorm_permutation.run(cfg, model)
    out = execute(rmsnorm_permutation.EXPERIMENT, cfg, model)
    assert out.result is None
    assert [c.verdict for c in out.claims] == [NOT_APPLICABLE] * len(rmsnorm_permutation.SPECS)
    assert all("massive" in c.why for c in out.claims)


def test_rmsnorm_permutation_explicit_layer_on_twin(twin, prompt_file, snap_hf):
    """--layer on a model without a massive activation: the edits run, no claim is judged."""
    model, plant = twin
    before = snap_hf(model)
    cfg = rmsnorm_permutation.Config(prompts=prompt_file, layer=plant.layer, n_random=1, top_k=2)
    res = rmsnorm_permutation.run(cfg, model)
    assert res.header.layer_given and not res.massive_at_layer
    cs = _judge(rmsnorm_permutation, res)
    assert {c.verdict for c in cs} == {NOT_APPLICABLE}
    assert all("no massive activation at layer 2" in c.why for c in cs)
    after = model.hf.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_rmsnorm_permutation_too_few_seeds_is_not_judged(nobos, nobos_prompts):
    model, _ = nobos
    cfg = rmsnorm_permutation.Config(
        prompts=nobos_prompts, n_random=2, alphas=(0.0,), norms=("ffn",)
    )
    cs = {c.id: c for c in _judge(rmsnorm_permutation, rmsnorm_permutation.run(cfg, model))}
    for name in ("ffn_permutation_removes", "top_dims_removes", "other_dims_keep"):
        c = cs[f"rmsnorm_permutation.{name}"]
        assert c.verdict == NOT_APPLICABLE and "at least 5" in c.why
    # the control norm was not edited; the flattening is deterministic and still judged
    assert "no attn random edit" in cs["rmsnorm_permutation.attn_permutation_keeps"].why
    assert cs["rmsnorm_permutation.flatten_removes"].verdict == HOLDS


def test_rmsnorm_permutation_bad_inputs(planted, prompt_file):
    model, _ = planted
    with pytest.raises(ValueError, match="top_k"):
        rmsnorm_permutation.run(rmsnorm_permutation.Config(prompts=prompt_file, top_k=11), model)
    with pytest.raises(ValueError, match="unknown norm"):
        rmsnorm_permutation.Config(norms=("ln3",))
    with pytest.raises(ValueError, match="n_random"):
        rmsnorm_permutation.Config(n_random=-1)


# ---------------------------------------------------------------------------- ffn_svd_ablation


def _grab(x, hook, *, store, key):
    store[key] = x.detach().clone()
    return x


def test_ffn_svd_ablation_planted(nobos, nobos_prompts):
    model, plant = nobos
    cfg = ffn_svd_ablation.Config(prompts=nobos_prompts, n_prompts=0, ks=(1, 4), n_neurons=2)
    res = ffn_svd_ablation.run(cfg, model)
    assert res.layer == plant.layer and res.massive_at_layer
    assert res.neurons[0] == plant.neuron and plant.massive_dim in res.massive_dims
    assert res.kill_k("down") == res.kill_k("up") == res.kill_k("gate") == 1
    assert [r.k for r in res.select("svd", "down")] == [1, 4, 8]  # claim_k is always run
    assert res.spectrum("down")[0] == pytest.approx(plant.down_scale, rel=1e-4)
    assert not res.neurons_row([plant.neuron]).survives
    assert res.neurons_row([res.neurons[1]]).survives  # the runner-up is not the mechanism
    for r in res.select("svd_random"):  # k other directions, scaled to the top k's energy
        assert r.survives and min(r.directions) >= cfg.claim_k and r.scale > 1
        top = res.svd_row(r.matrix, cfg.claim_k)
        assert r.energy == pytest.approx(top.energy, rel=1e-9) and top.scale == 1
        assert top.energy == pytest.approx(sum(v**2 for v in res.spectrum(r.matrix)[:8]), rel=1e-5)
    for r in res.select("neurons_random"):
        assert r.survives and not set(r.neurons) & set(res.neurons)
    assert len(res.select("neurons_random")) == cfg.n_random
    _check_result(res, len(synthetic.planted_prompts(8)))
    cs = _judge(ffn_svd_ablation, res)
    _check_claims(cs, ffn_svd_ablation.SPECS)
    assert _verdicts(cs) == PLANTED_SVD
    keeps = {c.id: c for c in cs}["ffn_svd_ablation.random_neurons_keep"]
    assert keeps.estimate.unit == "prompts × seeds" and keeps.kind == "control"
    assert set(ffn_svd_ablation.figures(res)) == {"svd_sweep", "neuron_ablation"}
    assert " c" in ffn_svd_ablation.summary(res)


@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_ffn_svd_ablation_not_applicable_without_massive_activation(fixture, request, prompt_file):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    cfg = ffn_svd_ablation.Config(prompts=prompt_file)
    out = execute(ffn_svd_ablation.EXPERIMENT, cfg, model)
    assert out.result is None and "no massive activation" in out.not_applicable
    assert [c.verdict for c in out.claims] == [NOT_APPLICABLE] * len(ffn_svd_ablation.SPECS)


def test_ffn_svd_ablation_explicit_layer_on_twin(twin, prompt_file):
    model, plant = twin
    cfg = ffn_svd_ablation.Config(
        prompts=prompt_file, layer=plant.layer, ks=(1,), claim_k=1, n_neurons=1, n_random=1
    )
    res = ffn_svd_ablation.run(cfg, model)
    assert not res.massive_at_layer
    assert {c.verdict for c in _judge(ffn_svd_ablation, res)} == {NOT_APPLICABLE}


def test_ffn_svd_ablation_bad_inputs(planted, prompt_file):
    model, _ = planted
    with pytest.raises(ValueError, match="exceeds the rank"):
        ffn_svd_ablation.run(ffn_svd_ablation.Config(prompts=prompt_file, ks=(33,)), model)
    with pytest.raises(ValueError, match="half the rank"):
        ffn_svd_ablation.run(ffn_svd_ablation.Config(prompts=prompt_file, claim_k=17), model)
    with pytest.raises(ValueError, match="half the FFN width"):
        ffn_svd_ablation.run(ffn_svd_ablation.Config(prompts=prompt_file, n_neurons=40), model)
    with pytest.raises(ValueError, match="unknown matrices"):
        ffn_svd_ablation.Config(matrices=("o",))
    with pytest.raises(ValueError, match=">= 1"):
        ffn_svd_ablation.Config(ks=(0,))


# ---------------------------------------------------------------------------- command line

CLI = [
    (rmsnorm_permutation, ["--n-random", "5", "--alphas", "0", "--norms", "ffn", "--top-k", "2"]),
    (ffn_svd_ablation, ["--ks", "1", "--n-neurons", "1", "--matrices", "down"]),
]


@pytest.mark.parametrize("module,args", CLI, ids=[m.NAME for m, _ in CLI])
def test_cli_smoke(module, args, nobos_prompts, tmp_path, capsys):
    argv = ["--model", "synthetic:planted-nobos", "--prompts", nobos_prompts]
    argv += ["--out", str(tmp_path)]
    rc = module.main(argv + ["--device", "cpu", "--verbose", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"[holds] {module.NAME}." in out and "rule: holds if" in out
    run_dir = next((tmp_path / module.NAME).iterdir())
    result = json.loads((run_dir / "result.json").read_text())
    assert result["header"]["layer"] == 2 and result["baseline"]["prompt_ratio"][2]
    assert {c["id"] for c in result["claims"]} == {s.id for s in module.SPECS}
    assert (run_dir / "config.json").is_file() and (run_dir / "env.json").is_file()
    assert list(run_dir.glob("*.html"))


@pytest.mark.parametrize("module", [rmsnorm_permutation, ffn_svd_ablation])
def test_cli_not_applicable_exits_0(module, prompt_file, tmp_path, capsys):
    argv = ["--model", "synthetic:twin", "--prompts", prompt_file, "--out", str(tmp_path)]
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "not applicable" in out and "no massive activation" in out


@pytest.mark.parametrize("module", [rmsnorm_permutation, ffn_svd_ablation])
def test_cli_help(module, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    assert "--model" in capsys.readouterr().out


BAD = [
    (ffn_svd_ablation, ["--ks", "1000"], "exceeds the rank"),
    (rmsnorm_permutation, ["--top-k", "20"], "top_k"),
    (rmsnorm_permutation, ["--layer", "9"], "out of range"),
]


@pytest.mark.parametrize("module,args,message", BAD, ids=[f"{m.NAME}:{a[0]}" for m, a, _ in BAD])
def test_cli_bad_inputs(module, args, message, prompt_file, tmp_path, capsys):
    argv = ["--model", "synthetic:planted", "--prompts", prompt_file, "--out", str(tmp_path)]
    assert module.main(argv + ["--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err
    assert not (tmp_path / module.NAME).exists() or not any((tmp_path / module.NAME).iterdir())


# ---------------------------------------------------------------------------- bundled model


@pytest.mark.slow
def test_rmsnorm_permutation_bundled(bundled):
    """Real SmolLM2-135M (ME layer 11): no edit of the pre-FFN gain removes the massive activation —
    only its scale matters (docs/permutation_svd.md). Defaults: 8 prompts of 16 tokens."""
    res = rmsnorm_permutation.run(rmsnorm_permutation.Config(), bundled)
    assert res.layer == 11 and res.n_prompts == 8
    assert 100 < res.baseline.ratio_at(11) < 250
    for kind in ("random", "top", "other", "flatten"):
        for r in res.select("ffn", kind):
            assert r.survives and 0.8 < r.change < 1.2
    v = _verdicts(_judge(rmsnorm_permutation, res))
    assert v == {
        "rmsnorm_permutation.ffn_permutation_removes": FAILS,
        "rmsnorm_permutation.attn_permutation_keeps": HOLDS,
        "rmsnorm_permutation.top_dims_removes": FAILS,
        "rmsnorm_permutation.other_dims_keep": HOLDS,
        "rmsnorm_permutation.flatten_removes": FAILS,
    }


@pytest.mark.slow
def test_ffn_svd_ablation_bundled(bundled):
    """Real SmolLM2-135M: the input side of the ME layer's FFN reads the massive token through one or
    two singular directions (W_up k = 1, W_gate k = 2 remove it); W_down's top directions do not; three
    neurons together do, the top one alone does not."""
    res = ffn_svd_ablation.run(ffn_svd_ablation.Config(ks=(1, 2, 8)), bundled)
    assert res.layer == 11 and res.neurons[:2] == [1229, 1487]
    assert res.kill_k("up") == 1 and res.kill_k("gate") == 2 and res.kill_k("down") is None
    assert 0.4 < res.svd_row("down", 8).change < 0.8
    assert res.svd_row("up", 8).change < 0.05 and res.svd_row("gate", 8).change < 0.05
    assert 0.15 < res.neurons_row([1229]).change < 0.4
    assert res.neurons_row(res.neurons).change < 0.05
    v = _verdicts(_judge(ffn_svd_ablation, res))
    assert v == {
        "ffn_svd_ablation.svd_gate_removes": HOLDS,
        "ffn_svd_ablation.svd_up_removes": HOLDS,
        "ffn_svd_ablation.svd_down_removes": FAILS,
        "ffn_svd_ablation.svd_gate_random_keeps": HOLDS,
        "ffn_svd_ablation.svd_up_random_keeps": HOLDS,
        "ffn_svd_ablation.svd_down_random_keeps": HOLDS,
        "ffn_svd_ablation.top_neuron_removes": FAILS,
        "ffn_svd_ablation.top_neurons_remove": HOLDS,
        "ffn_svd_ablation.random_neurons_keep": HOLDS,
    }


def test_ffn_neurons_chosen_on_the_selection_half(tmp_path):
    """On prompts with distinct first tokens the neurons are scored on the selection half only,
    and the neuron claims and their control are measured on the held-out half only."""
    model = load_model("synthetic:planted-nobos")
    f = tmp_path / "p.txt"
    f.write_text("\n".join(synthetic.distinct_first_prompts(12)))
    cfg = ffn_svd_ablation.Config(prompts=str(f), n_prompts=0, ks=(1,), matrices=("down",))
    res = ffn_svd_ablation.run(cfg, model)
    sel = res.units.prompts(res.units.select)
    held = res.neuron_prompts
    assert res.units.held_out and sel and held and not set(sel) & set(held)
    assert sorted(sel + held) == list(range(res.n_prompts))
    # the scores are the selection half's, computed by hand at the massive token (position 0)
    batch = model.tokenize(synthetic.distinct_first_prompts(12))
    store: dict = {}
    model.run_with_hooks(batch, [(names.ffn_in(res.layer), partial(_grab, store=store, key="x"))])
    w = model.ffn_weights(res.layer)
    x = store["x"][sel, 0]  # [selection d_model]
    act = torch.nn.functional.silu(x @ w.gate.detach().T) * (x @ w.up.detach().T)
    want = (act[:, None, :] * w.down.detach()[res.massive_dims][None]).norm(dim=1).mean(0)
    assert [float(want[n]) for n in res.neurons] == pytest.approx(res.neuron_scores, rel=1e-4)
    assert res.neurons == want.argsort(descending=True)[: cfg.n_neurons].tolist()
    cs = {c.id: c for c in _judge(ffn_svd_ablation, res)}
    for cid in ("top_neuron_removes", "top_neurons_remove"):
        est = cs[f"ffn_svd_ablation.{cid}"].estimate
        assert est.n == len(held) and est.unit == "held-out prompts"
    keeps = cs["ffn_svd_ablation.random_neurons_keep"].estimate
    assert keeps.n == len(held)
    assert res.units.held_out  # the neurons were chosen on the selection half


def test_ffn_neuron_details_give_the_tested_prompts_means(tmp_path):
    """The neuron claims' details show the held-out means their statistic is computed from."""
    model = load_model("synthetic:planted-nobos")
    f = tmp_path / "p.txt"
    f.write_text("\n".join(synthetic.distinct_first_prompts(12)))
    cfg = ffn_svd_ablation.Config(prompts=str(f), n_prompts=0, ks=(1,), matrices=("down",))
    res = ffn_svd_ablation.run(cfg, model)
    c = {c.id: c for c in _judge(ffn_svd_ablation, res)}["ffn_svd_ablation.top_neurons_remove"]
    rows = res.neuron_prompts
    r = res.neurons_row(res.neurons)
    before = float(np.mean(np.asarray(res.baseline.prompt_ratio_at(res.layer))[rows]))
    after = float(np.mean(np.asarray(r.ratio_at_layer_per_prompt)[rows]))
    assert f"on the {len(rows)} prompts tested" in c.details
    assert f"{before:.4g} → {after:.4g}" in c.details
    assert c.estimate.value == pytest.approx((after - 1) / (before - 1), rel=1e-9)
