"""The benchmark scripts: bench_scaling.py (cost curves, docs/scaling.md) and gpu.sh (docs/gpu.md).

The exponent fit is checked against least squares worked by hand; the recorder's memory per layer
against the buffers a real scan returns; ``--quick`` and ``gpu.sh --cpu`` are run end to end.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _module(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def scaling():
    return _module("bench_scaling")


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


# ---- the fit ----------------------------------------------------------------------------------


def test_growth_exponent_matches_hand_least_squares(scaling):
    # x = 1, 2, 4 and y = 1, 2, 8: u = log x = (0, l, 2l), v = log y = (0, l, 3l) with l = ln 2;
    # mean u = l, mean v = 4l/3; Σ(u-ū)(v-v̄) = l·4l/3 + 0 + l·5l/3 = 3l², Σ(u-ū)² = 2l²: slope 3/2
    assert scaling.growth_exponent([1, 2, 4], [1, 2, 8]) == pytest.approx(1.5, abs=1e-12)
    # an exact power law gives its exponent whatever the constant
    xs = [8, 16, 32, 64, 128]
    assert scaling.growth_exponent(xs, [3.7 * x**0.75 for x in xs]) == pytest.approx(0.75)
    # flat cost: exponent 0
    assert scaling.growth_exponent([2, 4, 8], [5.0, 5.0, 5.0]) == pytest.approx(0.0, abs=1e-12)


def test_growth_exponent_needs_two_positive_points(scaling):
    assert scaling.growth_exponent([4], [2.0]) is None
    assert scaling.growth_exponent([1, 2, 4], [0.0, -1.0, 3.0]) is None  # one usable point
    assert scaling.growth_exponent([1, 2, 4], [0.0, 2.0, 8.0]) == pytest.approx(2.0)  # 0 dropped


def test_linear_slope_matches_hand_least_squares(scaling):
    # x = 0, 1, 2, y = 1, 2, 6: x̄ = 1, ȳ = 3; Σ(x-x̄)(y-ȳ) = 2 + 0 + 3 = 5, Σ(x-x̄)² = 2: slope 2.5
    assert scaling.linear_slope([0, 1, 2], [1, 2, 6]) == pytest.approx(2.5)
    assert scaling.linear_slope([3, 3], [1, 2]) is None


def test_recorder_memory_per_layer_is_what_a_scan_returns(scaling, tiny_model):
    """The O(layers × prompts × tokens) statistics the scan keeps, counted from the shapes, equal
    the bytes of a real scan's outputs per layer (no activation cache)."""
    from me_interp import names
    from me_interp.probes import scan_norms

    model = tiny_model
    B, T = 3, 7
    batch = scaling.random_batch(model, B, T)
    s = scan_norms(model, batch, names.SITES)
    kept = [s.norms, s.top_abs, s.top_dims, s.median_abs, s.kept_resid]
    per_layer = sum(t.numel() * t.element_size() for t in kept) / model.n_layers
    want = scaling.statistics_bytes_per_layer(
        B, T, model.d_model, len(names.SITES), s.top_abs.shape[-1]
    )
    assert per_layer == want


@pytest.fixture(scope="module")
def tiny_model():
    from me_interp import load_model, synthetic

    hf, tok = synthetic.tiny_llama()
    return load_model(hf, tokenizer=tok, device="cpu", dtype="float32")


# ---- sections ---------------------------------------------------------------------------------


def test_replace_section_positive_and_negative(tmp_path):
    sections = _module("_sections")
    doc = tmp_path / "d.md"
    doc.write_text("head\n<!-- t -->\nold\n<!-- t -->\ntail\n", encoding="utf-8")
    sections.replace_section(doc, "t", "new | table")
    assert doc.read_text(encoding="utf-8") == "head\n<!-- t -->\nnew | table\n<!-- t -->\ntail\n"
    assert sections.section(doc, "t") == "new | table"
    doc.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="exactly twice"):
        sections.replace_section(doc, "t", "x")


def test_docs_have_their_marked_sections():
    sections = _module("_sections")
    assert sections.section(ROOT / "docs" / "gpu.md", "gpu-table")
    assert "| bench | varies |" in sections.section(ROOT / "docs" / "scaling.md", "scaling-tables")


# ---- end to end -------------------------------------------------------------------------------


def test_quick_run_end_to_end(tmp_path, scaling):
    doc = tmp_path / "doc.md"
    doc.write_text("x\n<!-- scaling-tables -->\n<!-- scaling-tables -->\n", encoding="utf-8")
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_scaling.py"), "--quick", "--out", str(out),
         "--doc", str(doc), "--figure", str(tmp_path / "fig.svg")],
        capture_output=True, text=True, env=_env(), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / scaling.JSON_FILE).read_text(encoding="utf-8"))
    assert res["meta"]["quick"] is True and res["meta"]["repeats"] == 2
    curves = res["curves"]
    want = [(c.bench, c.vary, list(c.xs)) for c in scaling.plan(quick=True)]
    assert [(c["bench"], c["vary"], [p["x"] for p in c["points"]]) for c in curves] == want
    for c in curves:
        for p in c["points"]:
            assert len(p["runs"]) == 2
            assert p["seconds"] == min(run["seconds"] for run in p["runs"]) > 0
            assert p["cpu_seconds"] == min(run["cpu_seconds"] for run in p["runs"]) > 0
            assert p["peak_rss_mib"] > p["weight_mib"] >= 0
            assert p["params"] > 0
        xs = [p["x"] for p in c["points"]]
        # the reported exponent is the fit of the reported points
        assert c["cpu_time_exponent"] == pytest.approx(
            scaling.growth_exponent(xs, [p["cpu_seconds"] for p in c["points"]])
        )
        assert c["time_exponent"] == pytest.approx(
            scaling.growth_exponent(xs, [p["seconds"] for p in c["points"]])
        )
    layers = next(c for c in curves if (c["bench"], c["vary"]) == ("scan", "layers"))
    params = [p["params"] for p in layers["points"]]
    assert params == sorted(params) and len(set(params)) == len(params)  # layers really added
    mem = res["memory_vs_layers"]
    assert mem["layers"] == [p["x"] for p in layers["points"]]
    assert mem["weight_mib_per_layer"] > 0
    assert math.isfinite(mem["slope_above_weights_mib_per_layer"])
    text = doc.read_text(encoding="utf-8")
    assert "| bench | varies |" in text and text.count("<!-- scaling-tables -->") == 2
    assert (tmp_path / "fig.svg").read_text(encoding="utf-8").startswith("<svg")
    assert (out / scaling.TABLES_FILE).read_text(encoding="utf-8") in text
    # the tables and figure are re-drawn from the JSON alone
    again = tmp_path / "again"
    assert scaling.main(["--from-json", str(out / scaling.JSON_FILE), "--out", str(again)]) == 0
    for f in (scaling.TABLES_FILE, scaling.SVG_FILE):
        assert (again / f).read_text(encoding="utf-8") == (out / f).read_text(encoding="utf-8")


def test_point_mode_writes_one_measurement(tmp_path, scaling):
    path = tmp_path / "p.json"
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_scaling.py"), "--point", "scan", "--d-model", "32",
         "--n-layers", "2", "--vocab", "128", "--prompts", "2", "--tokens", "8", "--json", str(path)],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(path.read_text(encoding="utf-8"))
    assert res["shape"]["d_model"] == 32 and res["shape"]["n_layers"] == 2
    assert res["prompts"] == 2 and res["tokens"] == 8 and len(res["runs"]) == 2
    assert res["peak_cuda_mib"] is None  # on the CPU
    # a cache of 7 sites x 2 layers x 2 x 8 tokens x 32 dims in fp32
    assert res["full_cache_mib"] == pytest.approx(7 * 2 * 2 * 8 * 32 * 4 / 2**20)


def test_bad_flags_exit_2():
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_scaling.py"), "--repeats", "0"],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "--repeats" in r.stderr


def test_gpu_table_marks_a_failed_step(tmp_path):
    gpu_table = _module("gpu_table")
    (tmp_path / "steps.tsv").write_text("me_layer\t3.5\t1\n", encoding="utf-8")
    rows = gpu_table.rows(tmp_path)
    assert rows[0][1] == "4 s" and "**failed** (exit 1" in rows[0][2]
    assert all(r[1] == "not run" for r in rows[1:])
    assert gpu_table.main([str(tmp_path)]) == 1


@pytest.mark.slow
def test_gpu_sh_cpu_runs_every_step(tmp_path):
    """``gpu.sh --cpu`` runs the five steps on tiny sizes and writes the table."""
    out = tmp_path / "gpu"
    env = {**_env(), "PYTHON": sys.executable}
    r = subprocess.run(
        ["bash", str(BENCH / "gpu.sh"), "--cpu", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    gpu_table = _module("gpu_table")
    steps = gpu_table.steps(out)
    assert list(steps) == list(gpu_table.STEPS)
    assert all(rc == 0 for _, rc in steps.values())
    for f in ("me_layer.json", "patching.json", "scan_8b.json"):
        assert json.loads((out / f).read_text(encoding="utf-8"))
    for key in gpu_table.BATTERIES:
        state = json.loads((out / f"battery_{key}" / "battery.json").read_text(encoding="utf-8"))
        assert all(e["status"] in ("done", "not applicable") for e in state["experiments"].values())
    table = (out / gpu_table.TABLE_FILE).read_text(encoding="utf-8")
    assert table.count("\n| ") == 2 + len(gpu_table.STEPS)  # header, rule, one row per step
    assert "failed" not in table and "no output" not in table and "not run" not in table
    assert "synthetic:planted" in table and "synthetic:planted-gemma3" in table
