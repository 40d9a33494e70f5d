"""The mask-rate experiment: run() on the planted model, the CLI, and a small bundled sweep."""

from __future__ import annotations

import json

import pytest

from me_interp import io
from me_interp.experiments import wemask as exp


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("texts") / "texts.txt"
    p.write_text("w1 w2 w3 w4 w5 w6\nw7 w8 w9 w10 w11\nw12 w13 w14 w15 w16 w17 w18\n")
    return str(p)


@pytest.fixture(scope="module")
def planted_result(planted, texts_file):
    model, _ = planted
    cfg = exp.Config(
        prompts=texts_file, texts=texts_file, rates=(0.0, 0.5, 1.0), alphas=(0.5, 1.0), mc=True
    )
    return exp.run(cfg, model)


def test_result_layout_and_fixed_points(planted_result, planted):
    _, plant = planted
    r = planted_result
    d = r.to_dict()
    assert list(d)[:4] == ["claim", "baseline", "intervened", "verdict"]
    assert "holds" in d["verdict"]
    assert r.me_layer == plant.layer and r.layers == [2, 3, 4]
    # r = 0 rows are the baseline; r = 1 rows agree across variants (all dims masked)
    for row in r.rows:
        if row["kind"] == "wemask" and row["rate"] == 0:
            assert all(row[m] == r.baseline[m] for m in exp.METRICS)
    full = [row for row in r.rows if row["kind"] == "wemask" and row["rate"] == 1.0]
    assert len(full) == 4
    for row in full[1:]:
        assert row["perplexity"] == pytest.approx(full[0]["perplexity"], rel=1e-6)
    # the planted sink head reads the masked attention input: masking lowers attention to position 0
    assert full[0]["sink"] < r.baseline["sink"]
    assert r.baseline["kl"] == 0.0 and r.baseline["top1"] == 1.0
    assert "mc_accuracy" in r.baseline
    json.dumps(io.to_jsonable(d))


def test_sink_metric_matches_attention_probe(planted, texts_file):
    from me_interp.probes import attention_stats

    model, _ = planted
    batch = model.tokenize(exp.Config(texts=texts_file).load_texts())
    m, _ = exp._measure(model, batch, [], [3, 4], 4, None)
    st = attention_stats(model, batch)
    want = float(st.to_positions[3:5].mean())
    assert m["sink"] == pytest.approx(want, rel=1e-5)
    assert m["entropy"] == pytest.approx(float(st.entropy[3:5].mean()), rel=1e-5)


def test_verdicts_and_figures(planted_result):
    vs = exp.verdicts(planted_result)
    assert vs and all(set(v) == {"claim", "measured", "holds"} for v in vs)
    figs = exp.figures(planted_result)
    assert set(figs) == {"mask_rate", "soft_alpha"}
    assert "baseline" in exp.summary(planted_result)


def test_bad_config():
    with pytest.raises(ValueError, match="rate must be in"):
        exp.Config(rates=(0.1, 2.0))
    with pytest.raises(ValueError, match="alpha must be in"):
        exp.Config(alphas=(-1.0,))
    with pytest.raises(ValueError, match="unknown variant"):
        exp.Config(variants=("top",))
    with pytest.raises(ValueError, match="start must be"):
        exp.Config(start="gte")


def test_cli_smoke(tmp_path, texts_file, capsys):
    rc = exp.main(
        [
            "--model", "synthetic:planted", "--prompts", texts_file, "--texts", texts_file,
            "--rates", "0", "1", "--variants", "weight", "random", "--alphas", "1",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert rc == 0
    run_dir = next((tmp_path / "wemask").iterdir())
    run = io.load_run(run_dir)
    assert list(run["result"])[:4] == ["claim", "baseline", "intervened", "verdict"]
    assert (run_dir / "mask_rate.html").is_file()
    assert exp.main(["--model", "synthetic:planted", "--rates", "3", "--out", str(tmp_path)]) == 2


def test_bundled_small_sweep(bundled):
    """Two-sided bounds on the real model: r=0.1 weight WeMask is mild, r=1 is not, magnitude hurts."""
    cfg = exp.Config(rates=(0.1, 1.0), variants=("weight", "magnitude"), alphas=(), me_layer=None)
    r = exp.run(cfg, bundled)
    assert r.me_layer == 11
    base = r.baseline["perplexity"]
    w01 = r.row("wemask", "weight", 0.1)["perplexity"] / base
    w1 = r.row("wemask", "weight", 1.0)["perplexity"] / base
    m01 = r.row("wemask", "magnitude", 0.1)["perplexity"] / base
    assert 0.97 < w01 < 1.05
    assert 1.3 < w1 < 4.0
    assert 1.2 < m01 < 3.0


def test_finetune_script_on_planted(tmp_path):
    """The example fine-tuning script: loss goes down, the mask is active every step, it reloads."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments" / "finetune_wemask.py"
    spec = importlib.util.spec_from_file_location("finetune_wemask", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ft"
    rc = mod.main(["--model", "synthetic:planted", "--me-layer", "2", "--steps", "3", "--lr", "1e-2",
                   "--out", str(out)])  # fmt: skip
    assert rc == 0
    m = json.loads((out / "finetune_metrics.json").read_text())
    assert all(m["checks"].values())
    assert m["final_loss"] < m["losses"][0]
    assert m["masked_layers"] == [2, 3, 4]
    assert all(v == m["n_examples"] for step in m["edited_tokens_per_step"] for v in step.values())


def test_massive_positions_option(planted, texts_file):
    model, _ = planted
    cfg = exp.Config(
        prompts=texts_file, texts=texts_file, rates=(1.0,), variants=("weight",), alphas=(),
        positions="massive",
    )  # fmt: skip
    r = exp.run(cfg, model)
    assert r.positions == [[0], [0], [0]]  # the planted massive token is the BOS at position 0
    first = exp.run(
        exp.Config(
            prompts=texts_file, texts=texts_file, rates=(1.0,), variants=("weight",), alphas=()
        ),
        model,
    )
    assert r.rows[0]["perplexity"] == first.rows[0]["perplexity"]
    with pytest.raises(ValueError, match="positions must be"):
        exp.Config(positions="all")
