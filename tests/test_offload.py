"""Sharded and offloaded models (``--device-map`` / ``--max-memory`` / ``--offload-folder``,
``me_interp.loading.placement``) and the fused attention kernel (``me_interp.loading.attention``).

An offloaded model gives the same scan as the plain load (accelerate moves the weights in for each
forward); an experiment that reads or edits weights is refused on it, naming itself; the flags are
parsed with one-line errors. The fused kernel agrees with the eager reconstruction within
:data:`SDPA_RTOL`, refuses hooks it does not fire, and is recorded in ``env.json``.
"""

from __future__ import annotations

import json

import pytest
import torch

from me_interp import load_model, names, study, synthetic
from me_interp.experiments import attention_sinks, me_layer, weight_input_cross, weight_swap
from me_interp.loading.attention import FusedAttentionError, fusable, kernel
from me_interp.loading.errors import PlacementError
from me_interp.loading.placement import (
    Placement,
    parse_device_map,
    parse_max_memory,
    parse_size,
    refuse_mixed,
)
from me_interp.probes import locate_me_layer, scan_norms
from me_interp.prompts import builtin_prompts

SDPA_RTOL = 1e-4
"""Scan statistics under the fused kernel vs eager, relative (fp32 reordering; measured 4.6e-5 on
the bundled model at 64 tokens, 2.2e-5 at 256: ``benchmarks/bench_attention.py``)."""

OFFLOAD_RTOL = 1e-5
"""Scan statistics of an offloaded load vs the plain load, relative (measured: bit-identical)."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b| / |b|`` over entries where ``b`` is finite and not zero (padding is NaN
    in both: checked equal)."""
    a, b = a.double(), b.double()
    assert torch.equal(a.isnan(), b.isnan())
    nz = (b != 0) & b.isfinite()
    return float(((a - b).abs()[nz] / b.abs()[nz]).max()) if nz.any() else 0.0


def _scan_rel(x, y) -> float:
    return max(_rel(x.norms, y.norms), _rel(x.top_abs, y.top_abs), _rel(x.median_abs, y.median_abs))


def _weight_bytes(hf) -> int:
    return sum(p.numel() * p.element_size() for p in hf.parameters())


@pytest.fixture(scope="module")
def planted_dir(tmp_path_factory):
    """The planted tiny Llama (ME layer 2) saved by ``save_pretrained``, and its weights' bytes."""
    hf, tok, plant = synthetic.planted_llama()
    path = tmp_path_factory.mktemp("planted")
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path, _weight_bytes(hf), plant


# -- parsing ---------------------------------------------------------------------------------


def test_sizes_and_memory_budgets_parse():
    assert parse_size("1GiB") == 2**30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("123") == 123
    assert parse_max_memory("cpu=200GiB") == {"cpu": 200 * 2**30}
    assert parse_max_memory(("cpu=1GiB,", "mps=2MB")) == {"cpu": 2**30, "mps": 2 * 10**6}
    assert parse_max_memory({"cpu": "3MiB"}) == {"cpu": 3 * 2**20}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("cpu", "not DEVICE=SIZE"),
        ("cpu=lots", "not a size"),
        ("cpu=0", "above 0"),
        ("gpu=1GiB", "not a device"),
        ("cpu=1GiB cpu=2GiB", "twice"),
        ("", "empty"),
        (f"{torch.cuda.device_count()}=1GiB", "not on this machine"),
    ],
)
def test_bad_memory_budgets_are_refused_naming_the_flag(value, says):
    with pytest.raises(ValueError, match="max_memory") as e:
        parse_max_memory(value)
    assert says in str(e.value)


def test_device_maps_parse(tmp_path):
    for s in ("auto", "balanced", "balanced_low_0", "sequential"):
        assert parse_device_map(s) == s
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"model.embed_tokens": "cpu", "model.layers": 0, "lm_head": "disk"}))
    assert parse_device_map(str(f)) == {
        "model.embed_tokens": "cpu",
        "model.layers": 0,
        "lm_head": "disk",
    }


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ("{}", "empty"),
        ('{"model": "meta"}', "meta"),
        ('{"model": "nodevice"}', "nodevice"),
        ('{"model": true}', "not a device"),
    ],
)
def test_bad_device_map_files_are_refused_naming_the_flag(tmp_path, content, says):
    f = tmp_path / "map.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match="device_map") as e:
        parse_device_map(str(f))
    assert says in str(e.value)
    with pytest.raises(ValueError, match="neither"):
        parse_device_map("everywhere")


def test_placement_defaults_to_auto_and_makes_the_folder(tmp_path):
    assert Placement.parse() is None
    p = Placement.parse(max_memory="cpu=1GiB", offload_folder=tmp_path / "a" / "b")
    assert p.device_map == "auto" and p.max_memory == {"cpu": 2**30}
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="offload_folder.*is a file"):
        Placement.parse(offload_folder=tmp_path / "file")


def test_device_and_placement_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="device.*not both"):
        load_model("synthetic:planted", device="cpu", max_memory="cpu=1GiB")
    with pytest.raises(ValueError, match="not both"):
        me_layer.Config(model="synthetic:planted", device="cpu", max_memory=("cpu=1GiB",))
    cfg = me_layer.Config(max_memory=("cpu=1GiB",), offload_folder=str(tmp_path))
    assert study.placement_kwargs(cfg) == {
        "max_memory": ("cpu=1GiB",),
        "offload_folder": str(tmp_path),
    }


def test_a_map_mixing_gpus_with_offload_is_refused_before_loading(tmp_path):
    """TransformerLens 4.3 does not boot GPU + CPU/disk maps: said first, naming what to do."""
    refuse_mixed({"model.layers.0": 0, "model.layers.1": 1})  # all GPU: fine
    refuse_mixed({"model.layers.0": "cpu", "model.layers.1": "disk"})  # all offload: fine
    with pytest.raises(PlacementError, match="mixes GPUs with CPU/disk"):
        refuse_mixed({"model.layers.0": 0, "model.layers.1": "cpu"})
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"model.embed_tokens": "cuda:0", "model.layers": "disk"}))
    with pytest.raises(PlacementError, match="mixes GPUs"):
        load_model("synthetic:planted", device_map=str(f))


# -- offloaded models ------------------------------------------------------------------------


def _planted_scan(model):
    batch = model.tokenize(synthetic.planted_prompts())
    scan = scan_norms(model, batch, names.SITES)
    return scan, locate_me_layer(scan)


def test_a_model_larger_than_its_budget_runs_the_scan_to_the_end(planted_dir, tmp_path):
    """Saved to a directory, loaded with a CPU budget of half its weights: the rest goes to disk,
    and the scan equals the plain load's (same ME layer, dims; statistics within 1e-5)."""
    path, size, plant = planted_dir
    plain = load_model(str(path), device="cpu")
    off = load_model(str(path), max_memory=f"cpu={size // 2}", offload_folder=tmp_path / "off")
    assert "disk" in set(off.hf.hf_device_map.values())
    assert off.offloaded, "some weights should be meta placeholders"
    # (safetensors weights offloaded to disk are read from the checkpoint itself, not copied)
    s0, loc0 = _planted_scan(plain)
    s1, loc1 = _planted_scan(off)
    assert loc1.me_layer == loc0.me_layer == plant.layer
    assert loc1.massive_dims == loc0.massive_dims
    assert _scan_rel(s1, s0) <= OFFLOAD_RTOL
    assert off.info()["placement"]["offload_folder"] == str(tmp_path / "off")
    assert off.info()["hf_device_map"]


def test_a_model_built_in_memory_is_dispatched_too(tmp_path):
    """``synthetic:`` (built in memory) goes through accelerate's dispatch_model, same result."""
    plain = load_model("synthetic:planted", device="cpu")
    size = _weight_bytes(plain.hf)
    off = load_model("synthetic:planted", max_memory=f"cpu={size // 2}", offload_folder=tmp_path)
    assert off.offloaded
    s0, loc0 = _planted_scan(plain)
    s1, loc1 = _planted_scan(off)
    assert loc1.me_layer == loc0.me_layer and loc1.massive_dims == loc0.massive_dims
    assert _scan_rel(s1, s0) <= OFFLOAD_RTOL


def test_an_offloaded_weight_is_refused_and_a_resident_one_is_not(planted_dir, tmp_path):
    path, size, _ = planted_dir
    off = load_model(str(path), max_memory=f"cpu={size // 2}", offload_folder=tmp_path)
    layers = range(off.n_layers)
    meta = [i for i in layers if off.bridge.blocks[i].ln2.w.device.type == "meta"]
    resident = [i for i in layers if i not in meta]
    assert meta, "the budget should offload some layer"
    with pytest.raises(PlacementError, match="offloaded"):
        off.ffn_weights(meta[0])
    with pytest.raises(PlacementError, match="offloaded"):
        off.ffn_norm_gain(meta[0])
    if resident:
        assert off.ffn_weights(resident[0]).down.device.type == "cpu"
    assert off.d_mlp == load_model(str(path), device="cpu").d_mlp


def test_weight_experiments_are_refused_by_name_on_offloaded_weights(planted_dir, tmp_path, capsys):
    """An in-place edit of an offloaded (meta) weight would not reach the forward: weight_swap is
    refused through the API and on the command line (exit 2, one line naming it), not run wrong."""
    path, size, _ = planted_dir
    off = load_model(str(path), max_memory=f"cpu={size // 2}", offload_folder=tmp_path / "o")
    cfg = weight_swap.Config(model=str(path), out=str(tmp_path / "runs"))
    with pytest.raises(PlacementError, match="weight_swap is refused"):
        study.execute(weight_swap.EXPERIMENT, cfg, off)
    argv = ["--model", str(path), "--max-memory", f"cpu={size // 2}"]
    argv += ["--offload-folder", str(tmp_path / "o2"), "--out", str(tmp_path / "runs")]
    rc = weight_swap.main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "weight_swap is refused" in err[0], err


@pytest.mark.slow
def test_the_battery_on_offloaded_weights_gives_the_plain_verdicts_or_refuses(
    planted_dir, tmp_path
):
    """Every experiment of the battery on the planted model with blocks on disk: the plain load's
    verdicts, or a PlacementError naming the experiment (never a silently different answer); the
    weight-edit experiments are refused."""
    from me_interp.battery import BY_NAME as _BY_NAME
    from me_interp.battery import NAMES as EXPERIMENTS

    path, size, _ = planted_dir
    plain = load_model(str(path), device="cpu")
    off = load_model(str(path), max_memory=f"cpu={size // 2}", offload_folder=tmp_path / "o")
    refused = []
    for name in EXPERIMENTS:
        module = _BY_NAME[name]
        cfg = module.config(model=str(path), out=str(tmp_path / "runs"))
        try:
            b = study.execute(module, cfg, off, figures=False)
        except PlacementError as e:
            assert str(e).startswith(f"{name} is refused on ")
            refused.append(name)
            continue
        a = study.execute(module, cfg, plain, figures=False)
        assert [(c.id, c.verdict) for c in b.claims] == [(c.id, c.verdict) for c in a.claims], name
    assert {"weight_swap", "weight_patching", "rmsnorm_permutation", "ffn_svd_ablation"} <= set(
        refused
    )
    assert {"me_layer", "attention_sinks", "activation_patching"}.isdisjoint(refused)


@pytest.mark.slow
def test_the_bundled_model_offloaded_to_disk_equals_the_plain_load(bundled, tmp_path):
    """SmolLM2-135M with a CPU budget of ~half its weights (the rest on disk): the same ME layer,
    dims and jump (statistics within 1e-5 relative), and the same verdicts of me_layer and
    attention_sinks, as the plain load."""
    size = _weight_bytes(bundled.hf)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(list(builtin_prompts()[:10])), encoding="utf-8")
    off = load_model(
        max_memory=f"cpu={size // 2}", offload_folder=tmp_path / "off", dtype="float32"
    )
    assert "disk" in set(off.hf.hf_device_map.values()) and off.offloaded
    for module in (me_layer, attention_sinks):
        cfg = module.Config(prompts=str(prompts), out=str(tmp_path / "runs"))
        a = study.execute(module.EXPERIMENT, cfg, bundled, figures=False)
        b = study.execute(module.EXPERIMENT, cfg, off, figures=False)
        assert [(c.id, c.verdict) for c in b.claims] == [(c.id, c.verdict) for c in a.claims]
        if module is me_layer:
            ra, rb = a.result, b.result
            assert rb.me_layer == ra.me_layer is not None
            assert rb.location.massive_dims == ra.location.massive_dims
            assert rb.location.massive_positions == ra.location.massive_positions
            ja, jb = torch.tensor(ra.log_jumps()), torch.tensor(rb.log_jumps())
            assert _rel(jb, ja) <= OFFLOAD_RTOL
            assert (
                _rel(torch.tensor(rb.location.top_ratio), torch.tensor(ra.location.top_ratio))
                <= OFFLOAD_RTOL
            )


# -- the fused attention kernel --------------------------------------------------------------


def test_the_fused_kernel_agrees_with_eager_and_restores(bundled):
    """The bundled model's scan under sdpa equals the eager one within SDPA_RTOL (same ME layer and
    dims), and afterwards the bridge runs its eager reconstruction again (patterns exist)."""
    assert fusable(bundled)
    batch = bundled.tokenize(list(builtin_prompts()[:4]))
    eager = scan_norms(bundled, batch, names.SITES)
    with kernel(bundled, "sdpa") as ran:
        assert ran == "sdpa" == bundled.attention
        assert bundled.hf.config._attn_implementation == "sdpa"
        fused = scan_norms(bundled, batch, names.SITES)
    assert bundled.attention == "eager" and bundled.hf.config._attn_implementation == "eager"
    assert "forward" not in bundled.bridge.blocks[0].attn.__dict__
    assert 0 < _scan_rel(fused, eager) <= SDPA_RTOL  # > 0: the fused kernel did run
    assert locate_me_layer(fused).me_layer == locate_me_layer(eager).me_layer
    assert locate_me_layer(fused).massive_dims == locate_me_layer(eager).massive_dims
    seen = []
    bundled.run_with_hooks(
        batch, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda a, hook: seen.append(1))]
    )
    assert seen


def test_hf_attn_implementation_alone_changes_nothing_that_runs(tiny_llama):
    """Why the kernel exists: TL's bridge recomputes attention itself, so HF's sdpa setting alone
    gives bit-identical logits; the kernel does change the computation (not bit-identical)."""
    batch = tiny_llama.tokenize(["one two three four five six", "seven eight nine ten"])
    eager = tiny_llama.run_with_hooks(batch)
    config = tiny_llama.hf.config
    config._attn_implementation = "sdpa"
    try:
        assert torch.equal(tiny_llama.run_with_hooks(batch), eager)
    finally:
        config._attn_implementation = "eager"
    with kernel(tiny_llama, "sdpa"):
        fused = tiny_llama.run_with_hooks(batch)
    real = batch.attention_mask.bool()
    assert not torch.equal(fused[real], eager[real])
    torch.testing.assert_close(fused[real], eager[real], rtol=SDPA_RTOL, atol=1e-5)


def test_the_fused_kernel_refuses_hooks_it_does_not_fire(tiny_llama):
    batch = tiny_llama.tokenize(["one two three four five", "six seven eight nine"])
    fired = []
    with kernel(tiny_llama, "sdpa"):
        tiny_llama.run_with_hooks(
            batch, fwd_hooks=[("blocks.0.attn.hook_z", lambda a, hook: fired.append(1))]
        )  # hook_z (o's input) still fires
        with pytest.raises(FusedAttentionError, match="hook_pattern"):
            tiny_llama.run_with_hooks(
                batch, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda a, hook: a)]
            )
    assert fired
    with pytest.raises(ValueError, match="attention must be"):
        with kernel(tiny_llama, "flash"):
            pass


def test_the_record_says_which_attention_ran(tmp_path, capsys):
    """me_layer and weight_input_cross declare sdpa; env.json says it ran; attention_sinks (reads
    patterns) stays eager."""
    assert me_layer.EXPERIMENT.attention == weight_input_cross.EXPERIMENT.attention == "sdpa"
    assert attention_sinks.EXPERIMENT.attention == "eager"
    for module, want in ((me_layer, "sdpa"), (attention_sinks, "eager")):
        assert module.main(["--model", "synthetic:planted", "--out", str(tmp_path), "--quiet"]) == 0
        env = next((tmp_path / module.NAME).glob("*/env.json"))
        assert json.loads(env.read_text())["attn_implementation"] == want
    capsys.readouterr()
