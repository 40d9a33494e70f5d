"""The ME-layer experiment: run(), result keys, figures, CLI, bad inputs."""

from __future__ import annotations

import json

import pytest

from me_interp import io
from me_interp.experiments import me_layer


@pytest.fixture()
def word_prompts(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("w1 w2 w3 w4 w5 w6\nw9 w8 w7\nw30 w31 w32 w33 w34\n")
    return str(p)


def test_run_on_planted(planted, word_prompts):
    model, plant = planted
    res = me_layer.run(me_layer.Config(prompts=word_prompts), model)
    d = res.to_dict()
    for key in (
        "model",
        "bos",
        "me_layer",
        "me_layer_1based",
        "events",
        "massive_positions",
        "massive_dims",
        "layers",
    ):
        assert key in d
    assert d["me_layer"] == plant.layer and d["me_layer_1based"] == plant.layer + 1
    assert d["massive_dims"] == [plant.massive_dim] and d["me_site"] == "ffn"
    assert len(d["layers"]) == model.n_layers
    for key in ("resid_norm_ratio", "ffn_out_norm_ratio", "max_over_median"):
        assert all(isinstance(layer[key], float) for layer in d["layers"])
    assert d["layers"][plant.layer]["ffn_out_norm_ratio"] > 100
    assert d["layers"][plant.layer - 1]["resid_norm_ratio"] < 2
    figs = me_layer.figures(res)
    assert set(figs) == {"norms_by_site", "me_layer_tokens_by_dim", "ratios"}
    heat = figs["me_layer_tokens_by_dim"].data[0]
    row0 = list(heat.z[0])
    assert row0.index(max(row0)) == plant.massive_dim  # the massive dim lights up on token 0
    assert "ME layer" in me_layer.summary(res)


def test_cli_writes_a_complete_run(tmp_path, word_prompts, capsys):
    out = tmp_path / "runs"
    rc = me_layer.main(
        [
            "--model",
            "synthetic:planted",
            "--prompts",
            word_prompts,
            "--out",
            str(out),
            "--bos",
            "auto",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ME layer: 2 (0-based) = 3 (1-based)" in printed
    (run_dir,) = (out / "me_layer").iterdir()
    for f in ("config.json", "env.json", "result.json", "norms_by_site.html", "norms_by_site.json"):
        assert (run_dir / f).is_file(), f
    assert (out / io.PLOTLY_JS).is_file()
    html = (run_dir / "norms_by_site.html").read_text()
    assert "../../plotly.min.js" in html and len(html) < 500_000  # plotly.js shared, not embedded
    run = io.load_run(run_dir)
    assert run["result"]["me_layer"] == 2
    assert run["config"]["prompts"] == word_prompts and run["config"]["bos"] == "auto"
    assert run["env"]["bos"] == "auto" and run["env"]["dtype"] == "float32"
    assert "torch" in run["env"] and "layer_index" in run["env"]
    assert not list(run_dir.glob(".*.tmp"))


def test_cli_on_twin_reports_no_me_layer(tmp_path, word_prompts, capsys):
    rc = me_layer.main(
        ["--model", "synthetic:twin", "--prompts", word_prompts, "--out", str(tmp_path)]
    )
    assert rc == 0
    assert "none found" in capsys.readouterr().out
    (run_dir,) = (tmp_path / "me_layer").iterdir()
    assert json.loads((run_dir / "result.json").read_text())["me_layer"] is None


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "holds no prompts"),
        ("w1\nw2 w3\n", "single token"),  # with --bos no, "w1" is one token
    ],
)
def test_cli_bad_prompts(tmp_path, capsys, content, message):
    p = tmp_path / "p.txt"
    p.write_text(content)
    rc = me_layer.main(
        ["--model", "synthetic:planted", "--prompts", str(p), "--bos", "no", "--out", str(tmp_path)]
    )
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_bad_arguments(tmp_path, capsys):
    assert (
        me_layer.main(["--model", "synthetic:planted", "--prompts", str(tmp_path / "missing.txt")])
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert (
        me_layer.main(
            ["--model", "synthetic:planted", "--criterion", "loud", "--out", str(tmp_path)]
        )
        == 2
    )
    assert "criterion" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        me_layer.main(["--bos", "sometimes"])
    with pytest.raises(SystemExit):
        me_layer.main(["--dtype", "float8"])


def test_help_lists_the_common_flags(capsys):
    with pytest.raises(SystemExit) as e:
        me_layer.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--prompts", "--bos", "--dtype", "--device", "--seed", "--out"):
        assert flag in text


@pytest.mark.slow
def test_cli_on_bundled_model(tmp_path, capsys, bundled):
    res = me_layer.run(me_layer.Config(out=str(tmp_path)), bundled)
    d = res.to_dict()
    assert d["me_layer"] == 11 and d["me_layer_1based"] == 12
    assert d["bos"] == "auto" and d["bos_prepended"] is False
    assert 507 in d["massive_dims"]
    assert 100 < d["layers"][11]["resid_norm_ratio"] < 300
