"""The four weight experiments: planted answers, metrics against hand computations, CLI smoke and bad inputs."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from me_interp import names
from me_interp.experiments import (
    ffn_svd_ablation,
    rmsnorm_permutation,
    weight_patching,
    weight_swap,
)
from me_interp.probes import Criterion

FIRST_KEYS = ["claim", "baseline", "intervened", "verdict"]


@pytest.fixture
def snap_hf():
    return lambda model: {k: v.detach().clone() for k, v in model.hf.state_dict().items()}


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    from me_interp import synthetic

    path = tmp_path_factory.mktemp("prompts") / "planted.txt"
    path.write_text("\n".join(synthetic.planted_prompts(5)) + "\n")
    return str(path)


def _check_result_dict(result):
    d = result.to_dict()
    assert list(d)[:4] == FIRST_KEYS
    assert "holds" in d["verdict"]
    json.dumps(d, default=str)
    return d


def _check_verdicts(vs):
    assert vs
    for v in vs:
        assert set(v) == {"claim", "measured", "holds"}
        assert v["holds"] in (True, False, None)
        assert isinstance(v["claim"], str) and isinstance(v["measured"], str)


# ---------------------------------------------------------------------------- measurement


def _grab(x, hook, *, store, key):
    store[key] = x.detach().clone()
    return x


def test_measure_matches_hand_computation(planted, prompt_file):
    """Ratio and sink of `measure` re-derived from raw residuals and attention patterns."""
    model, plant = planted
    cfg = weight_swap.Config(prompts=prompt_file, n_prompts=0, max_tokens=0)
    batch = weight_swap.short_batch(model, cfg.load_prompts(), 0, 0)
    positions = [[0]] * len(batch)
    m = weight_swap.measure(model, batch, Criterion(), positions)
    store: dict = {}
    hooks = []
    for L in range(model.n_layers):
        hooks.append((names.resid_post(L), partial(_grab, store=store, key=("r", L))))
        hooks.append((names.pattern(L), partial(_grab, store=store, key=("p", L))))
    model.run_with_hooks(batch, hooks)
    mask = batch.attention_mask.bool()
    for L in range(model.n_layers):
        norms = store[("r", L)].norm(dim=-1)  # [batch pos]
        ratios = []
        for b in range(len(batch)):
            n = norms[b, mask[b]]
            top = int(n.argmax())
            others = torch.cat([n[:top], n[top + 1 :]])
            ratios.append(float(n[top] / others.mean()))
        assert m.top_ratio[L] == pytest.approx(sorted(ratios)[len(ratios) // 2], rel=1e-5)
        A = store[("p", L)]  # [batch head q k]
        per_prompt = []
        for b in range(len(batch)):
            q = int(mask[b].sum())
            per_prompt.append(float(A[b, :, 1:q, 0].mean(-1).max()))
        assert m.sink[L] == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-5)
    # the construction: a massive activation from the planted layer on, the sink only after it
    assert m.me_layer == plant.layer
    assert all(s > 0.9 for s in m.sink[plant.layer + 1 :])
    assert all(s < 0.5 for s in m.sink[: plant.layer + 1])


def test_short_batch_cuts_prompts(planted, prompt_file):
    model, _ = planted
    cfg = weight_swap.Config(prompts=prompt_file)
    batch = weight_swap.short_batch(model, cfg.load_prompts(), 2, 3)
    assert len(batch) == 2 and batch.lengths == [3, 3]
    assert batch.tokens[0, 0] == model.bos_token_id


# ---------------------------------------------------------------------------- weight_swap


def test_weight_swap_planted(planted, prompt_file):
    model, plant = planted
    cfg = weight_swap.Config(prompts=prompt_file, n_prompts=0, max_tokens=0)
    res = weight_swap.run(cfg, model)
    L = plant.layer
    assert res.layer == L and res.partners == [0, 1, 3, 4]
    by = {(r["part"], r["partner"]): r for r in res.rows}
    for p in res.partners:
        assert by[("block", p)]["me_layer"] == p  # gain and neuron travel together: emergence moves
        assert by[("ffn", p)]["me_layer"] is None  # neuron without the large gains: too weak
        assert by[("ffn_norm", p)]["me_layer"] is None  # large gains without the neuron: nothing
        assert by[("attn", p)]["me_layer"] == L  # attention plays no part in the creation
    assert res.fractions("block") == {
        "moved": 1.0,
        "stayed": 0.0,
        "vanished": 0.0,
        "elsewhere": 0.0,
    }
    # the sink follows the massive activation: after moving it to layer 4, layer 3 has no sink
    moved = by[("block", 4)]
    assert moved["sink"][3] < 0.5 < res.baseline.sink[3]
    assert moved["ratio_at_partner"] > 100 and moved["ratio_at_layer"] < 10
    d = _check_result_dict(res)
    assert d["verdict"]["holds"] is True and d["verdict"]["part"] == "block"
    assert d["baseline"]["me_layer"] == L
    _check_verdicts(weight_swap.verdicts(res))
    assert set(weight_swap.figures(res)) == {"me_layer_after_swap", "ratio_at_partner"}
    assert "block" in weight_swap.summary(res)


def test_weight_swap_bad_inputs(planted, prompt_file):
    model, plant = planted
    with pytest.raises(ValueError, match="with itself"):
        weight_swap.run(weight_swap.Config(prompts=prompt_file, partners=(plant.layer,)), model)
    with pytest.raises(ValueError, match="out of range"):
        weight_swap.run(weight_swap.Config(prompts=prompt_file, partners=(0, 7)), model)
    with pytest.raises(ValueError, match="out of range"):
        weight_swap.run(weight_swap.Config(prompts=prompt_file, layer=5), model)
    with pytest.raises(ValueError, match="unknown component"):
        weight_swap.Config(parts=("mlp",))
    with pytest.raises(ValueError, match="max_tokens"):
        weight_swap.Config(max_tokens=1)


def test_no_me_layer_needs_explicit_layer(twin, prompt_file):
    model, _ = twin
    with pytest.raises(ValueError, match="no ME layer found"):
        weight_swap.run(weight_swap.Config(prompts=prompt_file, parts=("ffn",)), model)


def test_weight_swap_runs_on_qwen3_with_explicit_layer(tiny_qwen3, prompt_file, snap_hf):
    """A random tiny Qwen3 has no ME layer: --layer picks the layer; attn swaps include q/k norms."""
    before = snap_hf(tiny_qwen3)
    cfg = weight_swap.Config(prompts=prompt_file, layer=1, partners=(0, 3), parts=("attn", "block"))
    res = weight_swap.run(cfg, tiny_qwen3)
    assert res.layer == 1 and len(res.rows) == 4
    assert all(r["outcome"] == "vanished" for r in res.rows)  # there was nothing to move
    after = tiny_qwen3.hf.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


# ---------------------------------------------------------------------------- rmsnorm_permutation


def test_rmsnorm_permutation_planted(planted, prompt_file):
    model, plant = planted
    cfg = rmsnorm_permutation.Config(prompts=prompt_file, n_random=3, alphas=(0.0, 0.5), top_k=2)
    res = rmsnorm_permutation.run(cfg, model)
    assert set(res.top_dims["ffn"]) == set(plant.gain_dims)
    assert res.survival("ffn", "random") == 0.0
    assert res.survival("ffn", "top") == 0.0
    assert res.survival("attn", "random") == 1.0 and res.survival("attn", "top") == 1.0
    flat = {r["param"]: r for r in res.select("ffn", "flatten")}
    assert not flat[0.0]["survives"]
    base = res.baseline.ratio_at(plant.layer)
    assert flat[0.0]["ratio_at_layer"] < flat[0.5]["ratio_at_layer"] < base  # monotone in α
    d = _check_result_dict(res)
    assert d["verdict"]["holds"] is True
    _check_verdicts(rmsnorm_permutation.verdicts(res))
    assert set(rmsnorm_permutation.figures(res)) == {"ratio_after_edit", "flatten_sweep"}


def test_rmsnorm_permutation_bad_inputs(planted, prompt_file):
    model, _ = planted
    with pytest.raises(ValueError, match="top_k"):
        rmsnorm_permutation.run(rmsnorm_permutation.Config(prompts=prompt_file, top_k=17), model)
    with pytest.raises(ValueError, match="unknown norm"):
        rmsnorm_permutation.Config(norms=("ln3",))


# ---------------------------------------------------------------------------- ffn_svd_ablation


def test_neuron_scores_by_hand(planted, prompt_file):
    model, plant = planted
    batch = model.tokenize(rmsnorm_permutation.Config(prompts=prompt_file).load_prompts())
    L, dims = plant.layer, [plant.massive_dim]
    pos = torch.zeros(len(batch), dtype=torch.long)
    got = ffn_svd_ablation.neuron_scores(model, batch, L, pos, dims)
    store: dict = {}
    model.run_with_hooks(batch, [(names.ffn_in(L), partial(_grab, store=store, key="x"))])
    w = model.ffn_weights(L)
    x = store["x"][:, 0]  # [batch d_model] at the massive position 0
    act = torch.nn.functional.silu(x @ w.gate.detach().T) * (x @ w.up.detach().T)
    want = (act * w.down.detach()[plant.massive_dim]).abs().mean(0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert int(got.argmax()) == plant.neuron


def test_ffn_svd_ablation_planted(planted, prompt_file):
    model, plant = planted
    cfg = ffn_svd_ablation.Config(prompts=prompt_file, ks=(1, 4), n_neurons=2)
    res = ffn_svd_ablation.run(cfg, model)
    assert res.neurons[0] == plant.neuron
    assert plant.massive_dim in res.massive_dims
    assert res.kill_k("down") == res.kill_k("up") == res.kill_k("gate") == 1
    neu = {tuple(r["neurons"]): r for r in res.neuron_rows()}
    assert not neu[(plant.neuron,)]["survives"]
    assert neu[(res.neurons[1],)]["survives"]  # the runner-up neuron is not the mechanism
    assert res.singular_values["down"][0] == pytest.approx(plant.down_scale, rel=1e-4)
    d = _check_result_dict(res)
    assert d["verdict"]["holds"] is True
    _check_verdicts(ffn_svd_ablation.verdicts(res))
    assert set(ffn_svd_ablation.figures(res)) == {"svd_sweep", "neuron_ablation"}


def test_ffn_svd_ablation_bad_inputs(planted, prompt_file):
    model, _ = planted
    with pytest.raises(ValueError, match="exceeds the rank"):
        ffn_svd_ablation.run(ffn_svd_ablation.Config(prompts=prompt_file, ks=(33,)), model)
    with pytest.raises(ValueError, match="unknown FFN matrix"):
        ffn_svd_ablation.Config(matrices=("o",))
    with pytest.raises(ValueError, match=">= 1"):
        ffn_svd_ablation.Config(ks=(0,))


# ---------------------------------------------------------------------------- weight_patching


def test_weight_patching_second_model(planted, twin, prompt_file):
    model, plant = planted
    twin_model, _ = twin
    cfg = weight_patching.Config(prompts=prompt_file)
    res = weight_patching.run(cfg, twin_model, source_model=model)
    assert res.source_layer == plant.layer and res.targets == [plant.layer]
    by = {r["part"]: r for r in res.rows}
    assert by["block"]["outcome"] == "copied"
    for part in ("attn_norm", "ffn_norm", "ffn", "attn"):
        assert by[part]["outcome"] == "vanished"
    d = _check_result_dict(res)
    assert d["verdict"] == {**d["verdict"], "holds": True, "part": "block"}
    _check_verdicts(weight_patching.verdicts(res))


def test_weight_patching_within_planted(planted, prompt_file):
    model, plant = planted
    cfg = weight_patching.Config(prompts=prompt_file, parts=("block", "attn"))
    res = weight_patching.run(cfg, model)
    by = {(r["part"], r["target"]): r for r in res.rows}
    for t in (0, 1):  # the planted block copied before the planted layer: emergence starts there
        assert by[("block", t)]["outcome"] == "copied"
    for t in (3, 4):  # after it, the original layer already made it
        assert by[("block", t)]["outcome"] == "kept"
    assert all(by[("attn", t)]["outcome"] == "kept" for t in res.targets)
    assert "weight_patching" not in weight_patching.summary(res)  # a table, not a repr
    assert set(weight_patching.figures(res)) == {"me_layer_after_patch"}


def test_weight_patching_bad_inputs(planted, tiny_llama, prompt_file):
    model, plant = planted
    with pytest.raises(ValueError, match="onto itself"):
        weight_patching.run(
            weight_patching.Config(prompts=prompt_file, targets=(plant.layer,)), model
        )
    with pytest.raises(ValueError, match="same shape"):
        weight_patching.run(
            weight_patching.Config(prompts=prompt_file), model, source_model=tiny_llama
        )


# ---------------------------------------------------------------------------- command line

CLI = [
    (weight_swap, ["--parts", "block", "--partners", "0"]),
    (rmsnorm_permutation, ["--n-random", "1", "--alphas", "0", "--norms", "ffn"]),
    (ffn_svd_ablation, ["--ks", "1", "--n-neurons", "1", "--matrices", "down"]),
    (
        weight_patching,
        ["--model", "synthetic:twin", "--source-model", "synthetic:planted", "--parts", "block"],
    ),
]


@pytest.mark.parametrize("module,args", CLI, ids=[m.NAME for m, _ in CLI])
def test_cli_smoke(module, args, prompt_file, tmp_path, capsys):
    argv = [
        "--model",
        "synthetic:planted",
        "--prompts",
        prompt_file,
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
    ]
    rc = module.main(argv + args)  # a later --model overrides the first
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verdict: holds=True" in out
    run_dir = next((tmp_path / module.NAME).iterdir())
    result = json.loads((run_dir / "result.json").read_text())
    assert list(result)[:4] == FIRST_KEYS and result["verdict"]["holds"] is True
    assert (run_dir / "config.json").is_file() and (run_dir / "env.json").is_file()
    assert list(run_dir.glob("*.html"))


@pytest.mark.parametrize(
    "module", [weight_swap, rmsnorm_permutation, ffn_svd_ablation, weight_patching]
)
def test_cli_help(module, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    assert "--model" in capsys.readouterr().out


BAD = [
    (weight_swap, ["--layer", "9"], "out of range"),
    (weight_swap, ["--partners", "2"], "with itself"),
    (weight_swap, ["--parts", "mlp"], "unknown component"),
    (ffn_svd_ablation, ["--ks", "1000"], "exceeds the rank"),
    (weight_patching, ["--targets", "2"], "onto itself"),
    (weight_patching, ["--source-model", "synthetic:tiny-llama"], "same shape"),
]


@pytest.mark.parametrize("module,args,message", BAD, ids=[f"{m.NAME}:{a[0]}" for m, a, _ in BAD])
def test_cli_bad_inputs(module, args, message, prompt_file, tmp_path, capsys):
    argv = [
        "--model",
        "synthetic:planted",
        "--prompts",
        prompt_file,
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
    ]
    assert module.main(argv + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err
    assert not (tmp_path / module.NAME).exists() or not any((tmp_path / module.NAME).iterdir())


# ---------------------------------------------------------------------------- bundled model


@pytest.mark.slow
def test_weight_swap_bundled(bundled):
    """Real SmolLM2-135M (ME layer 11): the FFN moves the emergence only to a neighbouring layer, the
    pre-FFN gain of a distant layer does not stop it. Numbers from docs/weight_experiments.md."""
    cfg = weight_swap.Config(parts=("ffn_norm", "ffn"), partners=(12, 20))
    res = weight_swap.run(cfg, bundled)
    assert res.layer == 11
    assert 100 < res.baseline.ratio_at(11) < 250
    assert 3 < res.baseline.top_ratio[-1] < 15
    by = {(r["part"], r["partner"]): r for r in res.rows}
    assert by[("ffn", 12)]["me_layer"] == 12 and 20 < by[("ffn", 12)]["ratio_at_partner"] < 100
    assert by[("ffn", 20)]["me_layer"] is None and by[("ffn", 20)]["ratio_at_layer"] < 3
    assert (
        by[("ffn_norm", 20)]["me_layer"] == 11 and 60 < by[("ffn_norm", 20)]["ratio_at_layer"] < 200
    )
    assert 0.8 < res.baseline.sink_after(11) < 1.0
