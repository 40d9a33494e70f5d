"""The four causal experiments: planted answers, result.json layout, verdicts, CLI smoke, bad inputs."""

from __future__ import annotations

import json

import pytest

from me_interp import io
from me_interp.experiments import (
    activation_patching,
    component_ablation,
    sink_causality,
    transplant,
)

MODULES = [activation_patching, transplant, component_ablation, sink_causality]
LEAD_KEYS = ["claim", "baseline", "intervened", "verdict"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "planted.txt"
    path.write_text(
        "w1 w2 w3 w4 w5 w6 w7\nw9 w10 w11 w12 w13 w14 w15\nw30 w31 w32 w33 w34 w35 w36\n"
    )
    return str(path)


def _cfg(module, prompt_file, **kw):
    return module.Config(model="synthetic:planted", prompts=prompt_file, **kw)


def _check_layout(result):
    d = result.to_dict()
    assert list(d)[:4] == LEAD_KEYS
    assert "holds" in d["verdict"]
    json.dumps(io.to_jsonable(d), allow_nan=False)
    return d


def _check_verdicts(module, result):
    vs = module.verdicts(result)
    assert vs
    for v in vs:
        assert set(v) == {"claim", "measured", "holds"}
        assert v["holds"] in (True, False, None)
        assert isinstance(v["claim"], str) and isinstance(v["measured"], str)
    return vs


def test_activation_patching_planted(planted, prompt_file):
    model, plant = planted
    r = activation_patching.run(_cfg(activation_patching, prompt_file), model)
    assert r.corruption == "first_token"  # replacing BOS removes the planted massive activation
    assert r.site.layer == plant.layer
    mlp = r.sweeps["mlp_out"]
    assert mlp.cell("norm_ratio", plant.layer, 0) > 0.99
    assert mlp.cell("sink", plant.layer, 0) > 0.99
    assert r.sweeps["resid_pre"].cell("norm_ratio", 0, 0) == pytest.approx(1.0, abs=1e-5)
    assert r.sweeps["attn_out"].normalized("norm_ratio").abs().max() < 0.01
    d = _check_layout(r)
    assert d["verdict"]["holds"] is True
    assert d["baseline"]["clean"]["norm_ratio"] > 100 > 2 > d["baseline"]["corrupt"]["norm_ratio"]
    vs = _check_verdicts(activation_patching, r)
    assert [v["holds"] for v in vs] == [True, True, True]
    assert set(activation_patching.figures(r)) == {"patching_norm_ratio", "patching_sink"}


def test_activation_patching_remove_ffn_corruption(planted, prompt_file):
    model, plant = planted
    cfg = _cfg(activation_patching, prompt_file, corruption="remove_ffn", sites=("mlp_out",))
    r = activation_patching.run(cfg, model)
    assert r.corruption == "remove_ffn"
    # upstream of the corrupted site clean == corrupt: patches there do nothing
    grid = r.sweeps["mlp_out"].normalized("norm_ratio")
    assert grid[: plant.layer].abs().max() < 1e-6
    assert r.sweeps["mlp_out"].cell("norm_ratio", plant.layer, 0) == pytest.approx(1.0, abs=1e-4)


def test_transplant_moves_the_sink(planted, prompt_file):
    model, plant = planted
    r = transplant.run(_cfg(transplant, prompt_file, dst=3), model)
    d = _check_layout(r)
    assert d["verdict"]["holds"] is True
    old, new = r.sink_to("move")
    assert new > 0.9 and old < 0.05
    b_old, b_new = r.sink_to("baseline")
    assert b_old > 0.9 and b_new < 0.05
    assert r.ratios["move"]["new"] > 100 and r.ratios["move"]["old"] < 1
    assert [v["holds"] for v in _check_verdicts(transplant, r)] == [True, True]
    rd = transplant.run(
        _cfg(transplant, prompt_file, dst=2, mode="direction", component="full"), model
    )
    assert rd.holds() is True
    assert set(transplant.figures(r)) == {"attention_old_new"}


def test_component_ablation_planted(planted, prompt_file):
    model, plant = planted
    r = component_ablation.run(_cfg(component_ablation, prompt_file), model)
    d = _check_layout(r)
    assert d["verdict"]["holds"] is True  # capping the FFN output removes it
    removed = {c: r.removed(c) for c in component_ablation.CONDITIONS}
    assert removed == {
        "flatten_gain": True,  # the planted gain dims are what the neuron reads
        "cap_ffn": True,
        "scale_product": False,  # x0.1 leaves a ratio of ~40
        "normalize_product": True,
        "zero_dims": True,
        "mean_dims": False,
    }
    m = r.measures
    assert m["scale_product"]["me_ratio"] == pytest.approx(
        0.1 * m["baseline"]["me_ratio"], rel=0.05
    )
    assert r.ppl_ratio("mean_dims") == pytest.approx(1.0, abs=0.01)
    _check_verdicts(component_ablation, r)
    assert set(component_ablation.figures(r)) == {"norm_ratios", "perplexity"}


def test_sink_causality_planted(planted, prompt_file):
    model, plant = planted
    r = sink_causality.run(_cfg(sink_causality, prompt_file), model)
    d = _check_layout(r)
    assert d["verdict"]["holds"] is True
    assert all(layer > plant.layer for layer, _ in r.sink_heads())
    assert (plant.layer + 1, plant.sink_head) in r.sink_heads()
    # head 0 of the later layers loses its sink; before the ME layer nothing changes
    # the control: every planted prompt starts with BOS, so the swapped-in state is the same one
    assert r.holds("patch_other") is False
    assert r.head_attention["patch_other"] == r.head_attention["baseline"]
    for c in set(sink_causality.CONDITIONS) - set(sink_causality.CONTROLS):
        assert r.holds(c) is True
        for layer in range(plant.layer + 1):
            assert r.head_attention[c][layer] == pytest.approx(
                r.head_attention["baseline"][layer], abs=1e-6
            )
        assert r.head_attention[c][plant.layer + 1][plant.sink_head] < 0.5
    assert r.downstream_entropy("remove_ffn") > r.downstream_entropy("baseline")
    _check_verdicts(sink_causality, r)
    assert set(sink_causality.figures(r)) == {
        "attention_to_massive",
        "sink_rate",
        "attention_entropy",
    }


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.NAME)
def test_cli_smoke(module, prompt_file, tmp_path, capsys):
    argv = ["--model", "synthetic:planted", "--prompts", prompt_file, "--out", str(tmp_path)]
    if module is activation_patching:
        argv += ["--sites", "mlp_out", "--max-tokens", "5"]
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "results:" in out
    (run_dir,) = (tmp_path / module.NAME).iterdir()
    loaded = io.load_run(run_dir)
    assert list(loaded["result"])[:4] == LEAD_KEYS
    assert loaded["config"]["model"] == "synthetic:planted"
    assert list(run_dir.glob("*.html"))


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.NAME)
def test_cli_help(module, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    assert "--model" in capsys.readouterr().out


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.NAME)
def test_cli_bad_inputs(module, prompt_file, tmp_path, capsys):
    base = ["--model", "synthetic:planted", "--out", str(tmp_path)]
    layer_flag = ["--layer", "9"] if module is not activation_patching else ["--metric-layer", "9"]
    assert module.main([*base, "--prompts", prompt_file, *layer_flag]) == 2
    assert "out of range" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert module.main([*base, "--prompts", str(empty)]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    assert module.main([*base, "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_errors():
    with pytest.raises(ValueError, match="unknown site"):
        activation_patching.Config(sites=("mlp_in",))
    with pytest.raises(ValueError, match="max_tokens"):
        activation_patching.Config(max_tokens=1)
    with pytest.raises(ValueError, match="unknown condition"):
        sink_causality.Config(conditions=("explode",))
    with pytest.raises(ValueError, match="primary"):
        sink_causality.Config(conditions=("remove_dims",))
    with pytest.raises(ValueError, match="control"):
        sink_causality.Config(primary="patch_other")
    with pytest.raises(ValueError, match="unknown condition"):
        component_ablation.Config(conditions=("cap",))
    with pytest.raises(ValueError, match="layer must be >= 0"):
        component_ablation.Config(layer=-1)
    # Literal fields: a ValueError from __post_init__, or the runtime type checker's TypeError first
    with pytest.raises((ValueError, TypeError), match="mode|Literal"):
        transplant.Config(mode="copy")
    with pytest.raises((ValueError, TypeError), match="corruption|Literal"):
        activation_patching.Config(corruption="shuffle")
    with pytest.raises(ValueError, match="dst"):
        transplant.Config(dst=-2)


def test_transplant_dst_checks(planted, prompt_file):
    model, _ = planted
    with pytest.raises(ValueError, match="must differ"):
        transplant.run(_cfg(transplant, prompt_file, dst=0), model)
    with pytest.raises(ValueError, match="no query after it"):
        transplant.run(_cfg(transplant, prompt_file, dst=7), model)


# ------------------------------------------------------------------------------------------
# the bundled real model (two-sided bounds on measured facts)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_prompts(tmp_path_factory):
    from me_interp.prompts import builtin_prompts

    path = tmp_path_factory.mktemp("bundled") / "prompts.txt"
    path.write_text("\n".join(p.replace("\n", "\\n") for p in builtin_prompts()[:4]) + "\n")
    return str(path)


@pytest.mark.slow
def test_bundled_component_ablation(bundled, bundled_prompts):
    r = component_ablation.run(component_ablation.Config(prompts=bundled_prompts), bundled)
    assert r.site.layer == 11 and r.site.position == 0 and 507 in r.site.dims
    m = r.measures
    assert 80 < m["baseline"]["me_ratio"] < 300
    assert m["cap_ffn"]["me_ratio"] < 3 and r.removed("cap_ffn")
    assert m["normalize_product"]["me_ratio"] < 3
    assert not r.removed("flatten_gain")  # SmolLM2: flattening the gain does not stop it
    assert 0.9 < r.ppl_ratio("mean_dims") < 1.1  # Sun et al.
    assert r.ppl_ratio("zero_dims") > 100  # zeroing ruins this model
    assert m["cap_ffn"]["sink"] < 0.5 * m["baseline"]["sink"]


@pytest.mark.slow
def test_bundled_activation_patching_remove_ffn(bundled, bundled_prompts):
    cfg = activation_patching.Config(
        prompts=bundled_prompts, sites=("mlp_out",), max_tokens=6, max_prompts=2
    )
    r = activation_patching.run(cfg, bundled)
    # the massive activation appears at position 0 whatever the first token: auto falls back
    assert r.corruption == "remove_ffn"
    sw = r.sweeps["mlp_out"]
    assert sw.cell("norm_ratio", 11, 0) == pytest.approx(1.0, abs=1e-3)
    assert sw.clean["norm_ratio"].mean() > 3 > 1.5 > sw.corrupt["norm_ratio"].mean()
    assert r.holds() is True
