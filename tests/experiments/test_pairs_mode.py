"""activation_patching --pairs: the user's own pairs through the experiment, the CLI and the files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from me_interp import claims
from me_interp.experiments import activation_patching as ap
from me_interp.experiments import patching_pairs
from me_interp.patching import LogitDiff, patch_sweep
from me_interp.patching.pairs import read_pairs, tokenize_pairs

MODEL = "synthetic:planted"
PAIRS = [
    {"clean": "w1 w2 w3 w4 w5", "corrupt": "w1 w2 w9 w4 w5", "answer": "w6", "wrong": "w7"},
    {"clean": "w8 w9 w10 w11", "corrupt": "w8 w9 w3 w11", "answer": "w12", "wrong": "w2"},
    {
        "clean": "w13 w14 w15 w16 w17",
        "corrupt": "w13 w14 w4 w16 w17",
        "answer": "w18",
        "wrong": "w1",
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
    pb = tokenize_pairs(model, read_pairs(pairs_file))
    direct = patch_sweep(
        model, pb.clean, pb.corrupt, "resid_pre", {"x": LogitDiff(pb.answer, pb.wrong)}
    )
    torch.testing.assert_close(r.sweeps["resid_pre"].values["logit_diff"], direct.values["x"])
    assert r.sweeps["attn_head_out"].axes == ("layer", "head")  # all positions at once by default
    # the interval of one cell, bootstrapped by hand with the same draws
    sw = r.sweeps["resid_pre"]
    rng = np.random.default_rng(3)
    idx = rng.integers(0, len(pb), size=(claims.N_BOOTSTRAP, len(pb)))
    vals = sw.values["logit_diff"][2, 1].double().numpy()
    clean, corrupt = (
        sw.clean["logit_diff"].double().numpy(),
        sw.corrupt["logit_diff"].double().numpy(),
    )
    boot = (vals[idx].mean(1) - corrupt[idx].mean(1)) / (clean[idx].mean(1) - corrupt[idx].mean(1))
    lo, hi = np.nanquantile(boot, [0.025, 0.975])
    assert r.lo["resid_pre"][2, 1] == pytest.approx(lo) and r.hi["resid_pre"][
        2, 1
    ] == pytest.approx(hi)
    assert (
        r.lo["resid_pre"][2, 1]
        <= float(sw.normalized("logit_diff")[2, 1])
        <= r.hi["resid_pre"][2, 1]
    )
    # the one position where the pairs differ: patching it at layer 0 is the clean run
    (where,) = (pb.clean.tokens != pb.corrupt.tokens).any(0).nonzero()[:, 0].tolist()
    assert float(sw.normalized("logit_diff")[0, where]) == pytest.approx(1.0, abs=1e-5)
    top = r.top_cells()
    assert {t["site"] for t in top} == {"resid_pre", "attn_head_out"}
    assert len(top) == 2 * patching_pairs.TOP and top[0]["cell"].startswith("L")


@pytest.mark.parametrize("metric", ["prob", "kl", "norm_ratio", "projection"])
def test_every_metric_runs_and_is_normalised(planted, pairs_file, metric):
    model, _ = planted
    cfg = ap.Config(model=MODEL, pairs=pairs_file, sites=("resid_pre",), metric=metric)
    sw = ap.run(cfg, model).sweeps["resid_pre"]
    if metric == "kl":
        assert float(sw.clean["kl"].abs().max()) < 1e-6  # KL of the clean run to itself
    grid = sw.normalized(metric)
    assert float(grid[0, 0]) == pytest.approx(0.0, abs=1e-5) or metric == "projection"  # same token


def test_cli_writes_cells_intervals_and_figures(pairs_file, tmp_path, capsys):
    argv = ["--model", MODEL, "--pairs", pairs_file, "--sites", "resid_pre", "attn_head_pattern"]
    argv += ["--head-positions", "each", "--out", str(tmp_path)]
    assert ap.main(argv) == 0
    out = capsys.readouterr().out
    assert "3 pairs; metric logit_diff" in out and "95% CI over pairs" in out
    run_dir = next((tmp_path / "activation_patching").iterdir())
    res = json.loads((run_dir / "result.json").read_text())
    assert res["mode"] == "pairs" and res["claims"] == []
    assert res["sweeps"]["attn_head_pattern"]["axes"] == ["layer", "pos", "head"]
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
    assert r.sweeps["attn_head_out"].heads == list(range(model.n_heads))
    figs = ap.figures(r)
    assert "patching_projection_attn_head_out" in figs
    assert "largest at" in ap.summary(r)


def test_method_both_reports_the_rank_agreement(planted, pairs_file):
    model, _ = planted
    cfg = ap.Config(
        model=MODEL, pairs=pairs_file, sites=("resid_pre", "attn_head_out"), method="both"
    )
    r = ap.run(cfg, model)
    assert set(r.agreement) == {"resid_pre", "attn_head_out"}
    assert all(-1 <= v <= 1 for v in r.agreement.values())
    assert (
        r.attribution["resid_pre"].method == "attribution"
        and r.sweeps["resid_pre"].method == "exact"
    )
    assert "Spearman rank correlation over cells" in patching_pairs.summary(r)
    only = ap.run(
        ap.Config(model=MODEL, pairs=pairs_file, sites=("resid_pre",), method="attribution"), model
    )
    assert only.sweeps["resid_pre"].method == "attribution" and only.agreement is None
    torch.testing.assert_close(
        only.sweeps["resid_pre"].values["logit_diff"],
        r.attribution["resid_pre"].values["logit_diff"],
    )
