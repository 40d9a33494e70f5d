"""The public API from a notebook: every entry point takes a string, a list of strings or a Batch
(one coercion, ``loading.loaded.as_batch``) with the same answer; short reprs with the headline
numbers; WeMask on a string against an independent perplexity; ``load_run`` gives the typed Result;
``py.typed`` ships."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
import torch

import me_interp
from me_interp import evaluation, io
from me_interp.experiments import me_layer
from me_interp.loading.inputs import as_batch
from me_interp.loading.loaded import Batch

TEXT = "the quick brown fox jumps over the lazy dog"
TEXTS = [TEXT, "a b c d e f g"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(planted):
    return planted[0]


@pytest.mark.parametrize(
    "given, rows",
    [(TEXT, 1), (TEXTS, 2), (tuple(TEXTS), 2), ("batch", 2)],
    ids=["str", "list", "tuple", "Batch"],
)
def test_as_batch_positive(model, given, rows):
    batch = model.tokenize(TEXTS)
    got = as_batch(model, batch if given == "batch" else given)
    assert isinstance(got, Batch) and len(got) == rows
    if given == "batch":
        assert got is batch  # returned as it is
    want = model.tokenize([given] if rows == 1 else TEXTS)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(
        got.attention_mask, want.attention_mask
    )


@pytest.mark.parametrize(
    "given, message",
    [
        (3, "expected a str, a list of str or a Batch, got int"),
        ([TEXT, 3], "got list"),
        (torch.tensor([[1, 2]]), "token ids: use model.batch_from_ids"),
        (None, "got NoneType"),
    ],
)
def test_as_batch_negative(model, given, message):
    with pytest.raises(TypeError, match=message.replace("(", r"\(")):
        as_batch(model, given)


def _same(a, b):
    if isinstance(a, torch.Tensor):  # bit for bit, NaN (padding) where NaN
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    if hasattr(a, "__dataclass_fields__"):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)  # NaN equals NaN here


ENTRY_POINTS = {
    "find_me_layer": lambda m, x: me_interp.find_me_layer(m, x),
    "locate": lambda m, x: me_interp.locate(m, x).location,
    "attention_stats": lambda m, x: me_interp.attention_stats(m, x),
    "attention_probe": lambda m, x: me_interp.attention_probe(m, x),
    "geometry_scan": lambda m, x: me_interp.geometry_scan(m, x),
    "scan_norms": lambda m, x: me_interp.scan_norms(m, x).norms,
    "we_mask_effect": lambda m, x: me_interp.we_mask_effect(m, x, me_layer=2).masked,
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_entry_points_take_str_list_or_batch(model, name):
    fn = ENTRY_POINTS[name]
    from_batch = fn(model, model.tokenize(TEXTS))
    assert _same(fn(model, TEXTS), from_batch)
    assert _same(fn(model, TEXT), fn(model, model.tokenize([TEXT])))


def test_reprs_are_one_short_line_with_the_headline(model, twin):
    loc = me_interp.find_me_layer(model, TEXTS)
    site = me_interp.locate(model, TEXTS)
    effect = me_interp.we_mask_effect(model, TEXTS, rate=0.5)
    for obj, want in [
        (loc, "MELocation(me_layer=2 (1-based 3) of 5, made by the ffn"),
        (site, "Site(layer=2 (the detected ME layer; ME layer 2), position 0, dims [7]"),
        (effect, "WeMaskEffect(weight r=0.5, layers 2..4, positions [0]; 2 text(s)"),
    ]:
        text = repr(obj)
        assert text.startswith(want) and "\n" not in text and len(text) < 300, text
    assert f"perplexity {effect.baseline.perplexity:.4g} -> {effect.masked.perplexity:.4g}" in repr(
        effect
    )
    none = me_interp.find_me_layer(twin[0], TEXTS)
    assert repr(none) == "MELocation(me_layer=None: no massive activation in 5 layers)"
    assert "not applicable: no massive activation" in repr(me_interp.locate(twin[0], TEXTS))


def test_we_mask_effect_against_an_independent_perplexity(model):
    effect = me_interp.we_mask_effect(model, TEXTS, rate=0.5, variant="random", seed=3)
    batch = model.tokenize(TEXTS)
    hooks = me_interp.we_mask(model, 0.5, "random", layers=[2, 3, 4], seed=3)
    assert effect.layers == (2, 3, 4)  # from the detected ME layer to the last
    assert effect.masked.perplexity == pytest.approx(
        evaluation.perplexity(model, batch, hooks), rel=1e-5
    )
    assert effect.baseline.perplexity == pytest.approx(
        evaluation.perplexity(model, batch), rel=1e-5
    )
    assert effect.n_tokens == int(batch.attention_mask.sum()) and effect.n_texts == 2
    assert effect.baseline.kl == 0.0 and effect.baseline.top1 == 1.0


def test_we_mask_effect_at_rate_zero_changes_nothing(model):
    effect = me_interp.we_mask_effect(model, TEXT, rate=0.0)
    assert effect.masked == effect.baseline  # the identity: every statistic equal


def test_we_mask_effect_needs_a_massive_activation(twin):
    from me_interp.claims import NotApplicable

    with pytest.raises(NotApplicable, match="pass layers= or me_layer="):
        me_interp.we_mask_effect(twin[0], TEXTS)


def test_load_run_gives_the_typed_result(tmp_path, planted_prompts):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(planted_prompts[:4]))
    argv = ["--model", "synthetic:planted", "--prompts", str(prompts), "--out", str(tmp_path)]
    assert me_layer.main(argv) == 0
    (run_dir,) = (tmp_path / "me_layer").iterdir()
    result = me_interp.load_run(run_dir)
    assert isinstance(result, me_layer.Result) and result.me_layer == 2
    assert result == io.read_result(me_layer.Result, run_dir)
    assert me_interp.load_run(str(run_dir), experiment="me_layer") == result
    assert io.read_run(run_dir)["result"]["header"]["me_layer"] == 2  # the JSON, explicitly


def test_load_run_negative(tmp_path):
    odd = tmp_path / "somewhere" / "run1"
    odd.mkdir(parents=True)
    with pytest.raises(ValueError, match="not in a folder named after an experiment"):
        me_interp.load_run(odd)
    na = io.new_run_dir(tmp_path, "wemask")
    for f in (io.CONFIG_FILE, io.ENV_FILE):
        io.write_json(na / f, {})
    with pytest.raises(FileNotFoundError, match="did not finish"):
        me_interp.load_run(na)
    io.write_json(na / io.RESULT_FILE, {"not_applicable": "no massive activation", "claims": []})
    with pytest.raises(ValueError, match="not applicable: no massive activation"):
        me_interp.load_run(na)


def test_public_api_and_py_typed():
    assert (ROOT / "me_interp" / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in data["tool"]["setuptools"]["package-data"]["me_interp"]
    assert all(hasattr(me_interp, name) for name in me_interp.__all__)
    assert me_interp.load_run is me_interp.battery.load_run  # imported on first use
    for name in ("find_me_layer", "locate", "we_mask_effect", "patch_sweep", "load_run"):
        assert name in me_interp.__all__
