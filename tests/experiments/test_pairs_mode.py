"""activation_patching --pairs: the user's own pairs through the experiment, the CLI and the files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from me_interp import claims, io, synthetic
from me_interp.experiments import activation_patching as ap
from me_interp.experiments import patching_pairs
from me_interp.patching import LogitDiff, patch_sweep
from me_interp.patching.cells import TOP
from me_interp.patching.pairs import as_pairs, read_pairs, tokenize_pairs
from me_interp.study.result import roundtrip

MODEL = "synthetic:planted"
PAIRS = [  # the last token differs: logit_diff separates clean from corrupt on every pair
    {"clean": "w1 w2 w3 w4 w5", "corrupt": "w1 w2 w3 w4 w9", "answer": "w6", "wrong": "w7"},
    {"clean": "w8 w9 w10 w11", "corrupt": "w8 w9 w10 w3", "answer": "w12", "wrong": "w2"},
    {
        "clean": "w13 w14 w15 w16 w17",
        "corrupt": "w13 w14 w15 w16 w4",
        "answer": "w1",
        "wrong": "w18",
    },
]


@pytest.fixture()
def pairs_file(tmp_path):
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in PAIRS) + "\n", encoding="utf-8")
    return str(p)


def test_run_equals_the_sweep_and_its_intervals_the_bootstrap(planted, pairs_file):
    model, _ = planted
    cfg = ap.Config(model=MODEL, pairs=pairs_file, sites=("resid_pre", "attn_head_out"), seed=3)
    r = ap.run(cfg, model)
    assert isinstance(r, patching_pairs.PairsResult) and ap.specs_for(r) == ()
    assert roundtrip(r) == r and "to_dict" not in vars(type(r))
    pb = tokenize_pairs(model, read_pairs(pairs_file))
    direct = patch_sweep(
        model, pb.clean, pb.corrupt, "resid_pre", {"x": LogitDiff(pb.answer, pb.wrong)}
    )
    sw = r.cells("resid_pre")
    np.testing.assert_allclose(
        sw.values("logit_diff").reshape(*sw.shape, -1), direct.values["x"].double().numpy()
    )
    assert r.cells("attn_head_out").axes == ("layer", "head")  # all positions at once by default
    # the interval of one cell, bootstrapped by hand with the same draws
    rng = np.random.default_rng(3)
    idx = rng.integers(0, len(pb), size=(claims.N_BOOTSTRAP, len(pb)))
    vals = direct.values["x"][2, 1].double().numpy()
    clean, corrupt = (direct.clean["x"].double().numpy(), direct.corrupt["x"].double().numpy())
    boot = (vals[idx].mean(1) - corrupt[idx].mean(1)) / (clean[idx].mean(1) - corrupt[idx].mean(1))
    lo, hi = sw.bootstrap("logit_diff", 3)
    assert (lo[2, 1], hi[2, 1]) == pytest.approx(tuple(np.nanquantile(boot, [0.025, 0.975])))
    assert lo[2, 1] <= sw.normalized("logit_diff")[2, 1] <= hi[2, 1]
    # the one position where pair 0 differs: patching it at layer 0 is pair 0's clean run
    (where,) = (pb.clean.tokens[0] != pb.corrupt.tokens[0]).nonzero()[:, 0].tolist()
    assert sw.normalized("logit_diff", [0])[0, where] == pytest.approx(1.0, abs=1e-5)
    # the top cells: chosen on the selection pairs, reported on the held-out ones
    select, test = claims.halves(len(pb), 3)
    assert (r.select, r.test) == (select.tolist(), test.tolist())
    assert {t.site for t in r.top} == {"resid_pre", "attn_head_out"}
    assert len(r.top) == 2 * TOP and r.top[0].cell.startswith("L")
    t = r.top[0]
    assert t.selected == pytest.approx(sw.normalized("logit_diff", select.tolist()).ravel()[t.flat])
    assert t.normalised == pytest.approx(sw.normalized("logit_diff", test.tolist()).ravel()[t.flat])
    n_cells = sum(
        np.isfinite(r.cells(s).normalized("logit_diff", select.tolist())).sum() for s in cfg.sites
    )
    assert r.n_searched == n_cells
    assert ", 3 pairs, metric logit_diff: clean" in repr(r) and len(repr(r)) < 300


def test_two_string_pairs_from_python_with_logit_diff(planted):
    """Issue 33: pairs as Python objects (tuples or dicts), scored by logit_diff, in a few lines."""
    model, _ = planted
    pairs = [("w1 w2 w3 w4", "w1 w2 w3 w9", "w6", "w7"), PAIRS[1]]
    r = ap.patch_pairs(model, pairs, metric="logit_diff", sites=("resid_pre",))
    pb = tokenize_pairs(model, as_pairs(pairs))
    ld = LogitDiff(["w6", pb.answer[1].item()], ["w7", "w2"], tokenizer=model.tokenizer)
    torch.testing.assert_close(ld.answer, pb.answer)
    direct = patch_sweep(model, pb.clean, pb.corrupt, "resid_pre", {"x": ld})
    np.testing.assert_allclose(
        r.cells("resid_pre").metric("logit_diff").clean, direct.clean["x"].double().numpy()
    )
    assert [p.clean for p in r.pairs] == ["w1 w2 w3 w4", PAIRS[1]["clean"]]
    with pytest.raises(ValueError, match="pair 1: a tuple is"):
        as_pairs([("only clean",)])
    with pytest.raises(ValueError, match="pass tokenizer="):
        LogitDiff("w6", "w7")
    with pytest.raises(ValueError, match="not one"):
        LogitDiff("w6 w7", 3, tokenizer=model.tokenizer)


def test_a_metric_that_does_not_separate_clean_from_corrupt_is_refused(tmp_path, capsys):
    """Issue 29 item 11: on decoy-erased the norm ratio at the last layer is about 1.05 on clean and
    corrupt alike; the run is refused in one line, with the numbers."""
    prompts = synthetic.distinct_first_prompts(16, 10)
    pairs = [
        {"clean": p, "corrupt": " ".join([prompts[(i + 1) % 16].split()[0], *p.split()[1:]])}
        for i, p in enumerate(prompts)
    ]
    path = tmp_path / "erased.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in pairs) + "\n", encoding="utf-8")
    argv = ["--model", "synthetic:decoy-erased", "--pairs", str(path), "--metric", "norm_ratio"]
    assert ap.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: metric norm_ratio: clean 1.04") and "\n" not in err
    assert "does not separate clean from corrupt beyond its bootstrap noise" in err


def test_separation_by_hand():
    from me_interp.patching.cells import separation

    clean, corrupt = [1.0, 2.0, 3.0, 4.0], [0.5, 2.5, 2.0, 3.5]
    s = separation(clean, corrupt, seed=1)
    idx = np.random.default_rng(1).integers(0, 4, size=(claims.N_BOOTSTRAP, 4))
    d = (np.asarray(clean) - np.asarray(corrupt))[idx].mean(1)
    assert (s.lo, s.hi) == pytest.approx(tuple(np.quantile(d, [0.025, 0.975])))
    assert s.difference == pytest.approx(0.375) and s.separates == (s.lo > 0 or s.hi < 0)
    assert separation([1.0, 1.1], [0.0, 0.1], 0).separates


@pytest.mark.parametrize("metric", ["prob", "kl", "norm_ratio", "projection"])
def test_every_metric_runs_or_is_refused(planted, pairs_file, metric):
    """Each metric is normalised (clean = 1, corrupt = 0) where it separates the pairs, and refused
    in one line where it does not."""
    model, _ = planted
    cfg = ap.Config(model=MODEL, pairs=pairs_file, sites=("resid_pre",), metric=metric)
    try:
        sw = ap.run(cfg, model).cells("resid_pre")
    except ValueError as e:
        assert metric != "kl" and "does not separate" in str(e)
        return
    if metric == "kl":
        assert max(map(abs, sw.metric("kl").clean)) < 1e-6  # KL of the clean run to itself
    grid = sw.normalized(metric)
    assert grid[0, 0] == pytest.approx(0.0, abs=1e-5) or metric == "projection"  # same token


def test_cli_writes_cells_intervals_and_figures(pairs_file, tmp_path, capsys):
    argv = ["--model", MODEL, "--pairs", pairs_file, "--sites", "resid_pre", "attn_head_pattern"]
    argv += ["--head-positions", "each", "--out", str(tmp_path)]
    assert ap.main(argv) == 0
    out = capsys.readouterr().out
    assert "3 pairs; metric logit_diff: clean" in out and "reported on the other 1" in out
    run_dir = next((tmp_path / "activation_patching").iterdir())
    res = json.loads((run_dir / "result.json").read_text())
    assert res["claims"] == [] and res["n_searched"] > 0
    back = io.read_result(patching_pairs.PairsResult, run_dir)
    assert back.cells("attn_head_pattern").axes == ("layer", "pos", "head")
    assert {p.name for p in run_dir.glob("*.html")} >= {
        "pairs_resid_pre.html",
        "pairs_attn_head_pattern.html",
    }


def test_cli_refuses_bad_pairs_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(PAIRS[0]) + "\n" + json.dumps({"clean": "w1 w2", "corrupt": "w1"}) + "\n"
    )
    assert ap.main(["--model", MODEL, "--pairs", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: pairs line 2: clean and corrupt tokenise to different lengths")
    assert ap.main(["--model", MODEL, "--metric", "prob", "--out", str(tmp_path)]) == 2
    assert "--metric applies only with pairs" in capsys.readouterr().err


def test_head_sites_in_the_built_in_question(planted, tmp_path):
    """Per-head sweeps beside the claims: a heat map each, the claims untouched."""
    model, _ = planted
    cfg = ap.Config(model=MODEL, sites=("resid_pre", "attn_out", "mlp_out", "attn_head_out"))
    r = ap.run(cfg, model)
    (heads,) = [c for c in r.sweeps if c.site == "attn_head_out"]
    assert heads.heads == list(range(model.n_heads))
    figs = ap.figures(r)
    assert "patching_projection_attn_head_out" in figs
    assert "largest at" in ap.summary(r)


def test_method_both_reports_the_rank_agreement(planted, pairs_file):
    model, _ = planted
    cfg = ap.Config(
        model=MODEL, pairs=pairs_file, sites=("resid_pre", "attn_head_out"), method="both"
    )
    r = ap.run(cfg, model)
    assert [s.cells.site for s in r.sites] == ["resid_pre", "attn_head_out"]
    assert all(-1 <= s.agreement <= 1 for s in r.sites)
    assert r.sites[0].attribution.method == "attribution" and r.sites[0].cells.method == "exact"
    assert "Spearman rank correlation over cells" in patching_pairs.summary(r)
    only = ap.run(
        ap.Config(model=MODEL, pairs=pairs_file, sites=("resid_pre",), method="attribution"), model
    )
    assert only.cells("resid_pre").method == "attribution" and only.sites[0].agreement is None
    np.testing.assert_allclose(
        only.cells("resid_pre").values("logit_diff"), r.sites[0].attribution.values("logit_diff")
    )
