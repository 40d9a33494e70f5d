"""The survey: the ME-layer scan over several models, one at a time, with failed loads as rows."""

from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pytest
import torch

from me_interp import claims, io, load_model, synthetic
from me_interp.experiments import survey
from me_interp.study import roundtrip

MISSING = "no-such-org/no-such-model"


@pytest.fixture()
def word_prompts(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("w1 w2 w3 w4 w5 w6\nw9 w8 w7\nw30 w31 w32 w33 w34\nw11 w12 w13 w14\n")
    return str(p)


class RecordingLoader:
    """``load_model`` that records, at every call, which model it loaded before is still alive."""

    def __init__(self):
        self.loaded: list[tuple[str, weakref.ref]] = []
        self.alive_at_next_load: list[str] = []

    def __call__(self, spec, **kw):
        # no gc.collect() here: a loaded model holds reference cycles, so it is only gone if the
        # survey collected it
        self.alive_at_next_load += [s for s, ref in self.loaded if ref() is not None]
        m = load_model(spec, **kw)
        self.loaded.append((spec, weakref.ref(m)))
        return m


@pytest.fixture(scope="module")
def surveyed(tmp_path_factory):
    p = tmp_path_factory.mktemp("survey") / "prompts.txt"
    # an odd number of prompts: the median is the middle value in every convention
    p.write_text("w1 w2 w3 w4 w5 w6\nw9 w8 w7\nw30 w31 w32 w33 w34\nw11 w12 w13 w14\nw40 w41 w42\n")
    cfg = survey.Config(
        models=("synthetic:planted", MISSING, "synthetic:twin"), prompts=str(p), device="cpu"
    )
    loader = RecordingLoader()
    return cfg, survey.run(cfg, load=loader), loader


def test_rows_planted_missing_twin(surveyed):
    cfg, res, _ = surveyed
    plant = synthetic.planted_llama()[2]
    planted, missing, twin = res.rows
    assert [r.model for r in res.rows] == list(cfg.models)
    assert planted.ok and planted.me_layer == plant.layer
    assert planted.event.layer_1based == plant.layer + 1
    assert planted.dims == [plant.massive_dim] and planted.positions == [0]
    assert planted.event.site == "ffn" and planted.event.persists_to_end
    assert planted.other_positions == 0
    assert planted.architecture == "LlamaForCausalLM" and planted.n_layers == 5
    assert planted.bos_rule() == "auto: BOS prepended"
    assert planted.verdict("me_layer.sudden_birth") == claims.HOLDS
    # the twin: scanned, no massive activation, the existence claim fails
    assert twin.ok and twin.me_layer is None and twin.dims == [] and twin.event is None
    assert twin.verdict("me_layer.sudden_birth") == claims.FAILS
    # the model that cannot be loaded is a row with the error, not a crash
    assert missing.status == survey.LOAD_FAILED and not missing.ok
    assert missing.error.startswith("ModelLoadError:") and MISSING in missing.error
    assert res.failed == [missing]
    assert planted.super_weight.super_weight.layer == plant.layer  # the planted neuron's weight
    assert planted.super_weight.super_weight.in_me_layer and twin.super_weight.super_weight is None


def test_result_round_trip(surveyed):
    _, res, _ = surveyed
    back = roundtrip(res)
    assert io.to_jsonable(back) == io.to_jsonable(res)
    assert [r.verdict("me_layer.sudden_birth") for r in back.rows] == ["holds", None, "fails"]
    assert survey.table(back) == survey.table(res)


def test_each_model_is_freed_before_the_next_is_loaded(surveyed):
    _, _, loader = surveyed
    assert [s for s, _ in loader.loaded] == ["synthetic:planted", "synthetic:twin"]
    assert loader.alive_at_next_load == []
    gc.collect()
    assert all(ref() is None for _, ref in loader.loaded)


def test_given_models_are_used_and_not_freed(planted, word_prompts):
    model, plant = planted
    cfg = survey.Config(models=("synthetic:planted",), prompts=word_prompts)

    def no_load(spec, **kw):
        raise AssertionError(f"{spec} was given and must not be loaded")

    res = survey.run(cfg, {"synthetic:planted": model}, load=no_load)
    assert res.rows[0].me_layer == plant.layer and model.n_layers == 5  # still usable


def test_ratio_column_equals_hf_hidden_states(surveyed):
    """The per-layer ratio (massive token's layer-output norm over the mean of the other tokens,
    median over prompts) from HF ``output_hidden_states`` of a fresh copy of the planted model."""
    cfg, res, _ = surveyed
    hf, tok, _ = synthetic.planted_llama()
    prompts = cfg.load_prompts()
    per_prompt = []
    for p in prompts:
        ids = torch.tensor([tok(p)["input_ids"]])
        with torch.no_grad():
            hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
        n = torch.stack([h[0].norm(dim=-1) for h in hs[1:]])  # [layer pos]
        per_prompt.append((n[:, 0] / n[:, 1:].mean(-1)).numpy())
    want = np.median(np.stack(per_prompt), axis=0)
    got = np.asarray(res.rows[0].ratio)
    # HF's last hidden state is after the final norm; the scan's is the last block's output
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=1e-4)
    assert res.rows[0].peak_layer == int(np.argmax(got))


def test_table_has_a_row_per_model_and_the_error(surveyed):
    _, res, _ = surveyed
    lines = survey.table(res).splitlines()
    assert len(lines) == 2 + len(res.rows)
    cols = lines[0].count("|")
    assert all(line.count("|") == cols for line in lines)  # no | inside a cell breaks the table
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for want in ("ME layer (0-based)", "ME layer (1-based)", "site", "dims", "BOS rule"):
        assert want in header
    planted = dict(zip(header, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert planted["ME layer (0-based)"] == "2" and planted["ME layer (1-based)"] == "3"
    assert planted["persists to last layer"] == "yes" and planted["sudden_birth"] == "holds"
    assert "load failed: ModelLoadError" in lines[3]
    twin = dict(zip(header, (c.strip() for c in lines[4].strip("|").split("|"))))
    assert twin["ME layer (0-based)"] == "none" and twin["sudden_birth"] == "fails"


def test_figure_one_subplot_per_scanned_model(surveyed):
    _, res, _ = surveyed
    fig = survey.figures(res)["ratios_by_model"]
    assert [t.name for t in fig.data] == ["synthetic:planted", "synthetic:twin"]
    assert list(fig.data[0].y) == pytest.approx(res.rows[0].ratio)
    assert fig.layout.xaxis.anchor != fig.layout.xaxis2.anchor  # side by side, own axes


def test_cli_writes_table_json_figure_and_exit_codes(tmp_path, word_prompts, capsys):
    out = tmp_path / "runs"
    args = ["--prompts", word_prompts, "--out", str(out), "--device", "cpu"]
    assert survey.main(["--models", "synthetic:planted", "synthetic:twin", *args]) == 0
    (run_dir,) = (out / "survey").iterdir()
    for f in ("config.json", "env.json", "result.json", "survey.md", "ratios_by_model.html"):
        assert (run_dir / f).is_file(), f
    result = io.read_run(run_dir)["result"]
    assert [r["me_layer"] for r in result["rows"]] == [2, None]
    assert result["rows"][0]["claims"][0]["id"] == "me_layer.sudden_birth"
    env = json.loads((run_dir / "env.json").read_text())
    assert [m["model"] for m in env["models"]] == ["synthetic:planted", "synthetic:twin"]
    printed = capsys.readouterr().out
    assert "| synthetic:planted | LlamaForCausalLM | 5 | 2 | 3 | ffn |" in printed
    # a model that does not load: its row says why, the others are scanned, exit 1
    assert survey.main(["--models", MISSING, "synthetic:planted", *args]) == 1
    newest = max((out / "survey").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    table = (newest / "survey.md").read_text()
    assert "load failed" in table and "| synthetic:planted |" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "bundled"], "--models"),
        (["--models", "synthetic:twin", "synthetic:twin"], "--models repeats a value"),
        (["--models", "synthetic:twin", "--prompts", "/no/such/file.txt"], "no/such/file"),
        (["--models", "synthetic:twin", "--criterion", "loud"], "criterion"),
    ],
)
def test_cli_bad_input_exits_2(argv, message, tmp_path, capsys):
    try:
        rc = survey.main([*argv, "--out", str(tmp_path)])
    except SystemExit as e:  # a value outside the flag's choices: argparse's one line
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err


def test_scan_crash_is_a_row_and_the_survey_goes_on(word_prompts, monkeypatch):
    real_run = survey.me_layer.run

    def crash_on_twin(cfg, model):
        if cfg.model == "synthetic:twin":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real_run(cfg, model)

    monkeypatch.setattr(survey.me_layer, "run", crash_on_twin)
    cfg = survey.Config(models=("synthetic:twin", "synthetic:planted"), prompts=word_prompts)
    twin, planted = survey.run(cfg).rows
    assert twin.status == survey.FAILED and "out of memory" in twin.error
    assert "RuntimeError" in twin.traceback and twin.architecture == "LlamaForCausalLM"
    assert planted.ok and planted.me_layer == 2


def test_loader_errors_other_than_model_load_are_rows_too(word_prompts):
    def flaky(spec, **kw):
        if spec == "synthetic:twin":
            raise MemoryError("simulated")
        return load_model(spec, **kw)

    cfg = survey.Config(models=("synthetic:twin", "synthetic:planted"), prompts=word_prompts)
    twin, planted = survey.run(cfg, load=flaky).rows
    assert twin.status == survey.LOAD_FAILED and twin.error == "MemoryError: simulated"
    assert planted.ok


def test_help_documents_every_flag(capsys):
    import dataclasses

    from me_interp.study import field_docs

    docs = field_docs(survey.Config)
    fields = [f.name for f in dataclasses.fields(survey.Config)]
    assert [f for f in fields if f != "model" and not docs.get(f)] == []
    with pytest.raises(SystemExit) as e:
        survey.main(["--help"])
    assert e.value.code == 0 and "--models" in capsys.readouterr().out
