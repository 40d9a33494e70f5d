"""Batched activation patching: equality with transformer_lens.patching, fixed points, bad inputs."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from transformer_lens import patching as tl_patching

from me_interp import names
from me_interp.interventions import causal
from me_interp.models import Batch
from me_interp.patching import (
    STRICT_ENV,
    NormRatio,
    SinkMass,
    evaluate_metrics,
    normalized,
    patch_loop,
    patch_sweep,
    site_hook,
)


@pytest.fixture(scope="module")
def pair(planted):
    """Clean planted prompts (BOS first) and the corrupt copy with BOS replaced by the next word."""
    model, plant = planted
    clean = model.tokenize(["w1 w2 w3 w4 w5", "w7 w8 w9 w10 w11", "w20 w21 w22 w23 w24"])
    t = clean.tokens.clone()
    t[:, 0] = t[:, 1]
    return model, plant, clean, Batch(t, clean.attention_mask.clone())


def _metrics(plant, last=4):
    return {
        "ratio": NormRatio(last, 0),
        "sink": SinkMass(tuple(range(plant.layer + 1, last + 1)), 0),
    }


def _tl_sweep(model, clean, corrupt, tl_fn, metrics, metric_name, permanent=()):
    """transformer_lens.patching on the bridge; metrics read by permanent recording hooks."""
    store: dict = {}

    def rec(x, hook, key):
        store[key] = x.detach().clone()
        return x

    bridge = model.bridge
    _, cache = bridge.run_with_cache(clean.tokens)  # the clean run, no hooks
    mask = corrupt.attention_mask.bool()
    try:
        for name, fn in permanent:
            bridge.add_hook(name, fn, is_permanent=True)
        for m in metrics.values():
            for n in m.hook_names():
                bridge.add_hook(n, partial(rec, key=n), is_permanent=True)
        res = tl_fn(
            bridge,
            corrupt.tokens,
            cache,
            lambda logits: metrics[metric_name](store, mask),
            reduce="none",
        )
    finally:
        bridge.reset_hooks(including_permanent=True)
    return res.values  # [layer pos batch]


@pytest.mark.parametrize(
    "site,tl_fn",
    [
        ("resid_pre", tl_patching.get_act_patch_resid_pre),
        ("attn_out", tl_patching.get_act_patch_attn_out),
        ("mlp_out", tl_patching.get_act_patch_mlp_out),
    ],
)
def test_sweep_equals_transformer_lens(pair, site, tl_fn):
    model, plant, clean, corrupt = pair
    metrics = _metrics(plant)
    ours = patch_sweep(model, clean, corrupt, site, metrics, batch_size=16)
    assert ours.n_forwards <= 6  # at most 30 cells x 3 prompts in chunks of 5 cells
    for name in metrics:
        ref = _tl_sweep(model, clean, corrupt, tl_fn, metrics, name)
        torch.testing.assert_close(ours.values[name], ref.float(), rtol=1e-4, atol=1e-5)


def test_sweep_with_corruption_hooks_equals_transformer_lens(pair):
    """The remove_ffn corruption: row-wise hooks run before the patch, as TL permanent hooks do."""
    model, plant, clean, _ = pair
    hooks = causal.remove_massive(
        model, clean, plant.layer, [0], None, site="ffn_out", per_prompt=False
    )
    metrics = _metrics(plant)
    ours = patch_sweep(model, clean, clean, "mlp_out", metrics, corrupt_hooks=hooks, batch_size=32)
    ref = _tl_sweep(
        model, clean, clean, tl_patching.get_act_patch_mlp_out, metrics, "ratio", permanent=hooks
    )
    torch.testing.assert_close(ours.values["ratio"], ref.float(), rtol=1e-4, atol=1e-5)
    # patching the corrupted site itself undoes the corruption exactly
    assert ours.cell("ratio", plant.layer, 0) == pytest.approx(1.0, abs=1e-4)
    # the clean run, run from the corrupt run's prefix (same tokens, the hook later), equals a
    # full clean forward
    full = evaluate_metrics(model, clean, metrics)
    for k in metrics:
        torch.testing.assert_close(ours.clean[k], full[k], rtol=1e-5, atol=1e-6)


def test_ffn_in_sweep_equals_one_forward_per_cell_loop(pair):
    """TL's get_act_name cannot name ln2.hook_out, so ffn_in is checked against a hand loop."""
    model, plant, clean, corrupt = pair
    metrics = {"ratio": NormRatio(4, 0)}
    ours = patch_sweep(model, clean, corrupt, "ffn_in", metrics, layers=[1, 2, 3], batch_size=64)
    store: dict = {}

    def rec(x, hook, key):
        store[key] = x.detach().clone()
        return x

    for i, layer in enumerate([1, 2, 3]):
        name = names.ffn_in(layer)
        model.run_with_hooks(clean, [(name, partial(rec, key="clean"))])
        clean_act = store["clean"]
        for p in range(clean.tokens.shape[1]):

            def patch(x, hook, p=p, clean_act=clean_act):
                x = x.clone()
                x[:, p] = clean_act[:, p]
                return x

            model.run_with_hooks(
                corrupt, [(name, patch), (names.resid_post(4), partial(rec, key="out"))]
            )
            norms = store["out"].norm(dim=-1).numpy()
            ref = norms[:, 0] / norms[:, 1:].mean(-1)
            np.testing.assert_allclose(ours.values["ratio"][i, p].numpy(), ref, rtol=1e-4)


def test_chunking_does_not_change_values(pair):
    model, plant, clean, corrupt = pair
    metrics = _metrics(plant)
    a = patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=3, skip_shared=False)
    b = patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=1000)
    c = patch_loop(model, clean, corrupt, "resid_pre", metrics)
    d = patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=3)
    # layer 0, positions 1..5: the same token embeddings in clean and corrupt -> skipped; layer 0,
    # position 0: patched, the stream is the clean one -> the clean run's values, not run; the 24
    # other cells run grouped by position (b: one chunk per position), d in chunks of at most
    # 3 x 6 row-positions: 4 + 4 + 4 cells of one each at positions 0..2, then 2 + 2 + 1 chunks
    assert (a.n_forwards, b.n_forwards, c.n_forwards, d.n_forwards) == (30, 6, 30, 17)
    assert (b.n_cells_run, b.n_cells_clean, d.n_cells_clean, a.n_cells_clean) == (24, 1, 1, 0)
    assert (a.prefix_skipped, b.prefix_skipped, c.prefix_skipped, d.prefix_skipped) == (
        False,
        True,
        False,
        True,
    )
    for k in metrics:
        torch.testing.assert_close(a.values[k], b.values[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c.values[k], b.values[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d.values[k], b.values[k], rtol=1e-5, atol=1e-6)


def test_fixed_points_clean_one_corrupt_zero(pair):
    model, plant, clean, corrupt = pair
    metrics = {"ratio": NormRatio(plant.layer, 0)}
    sw = patch_sweep(model, clean, corrupt, "resid_pre", metrics)
    # normalisation itself
    c, k = sw.clean["ratio"].mean(), sw.corrupt["ratio"].mean()
    assert float(normalized(torch.tensor([float(c)]), c, k)) == pytest.approx(1.0)
    assert float(normalized(torch.tensor([float(k)]), c, k)) == pytest.approx(0.0)
    # patching the whole corrupted difference (token 0's embedding) restores the clean run
    assert sw.cell("ratio", 0, 0) == pytest.approx(1.0, abs=1e-5)
    # patches after the metric layer cannot change it: exactly 0
    grid = sw.normalized("ratio")
    assert torch.all(grid[plant.layer + 1 :] == 0)
    # positions > 0 are identical in clean and corrupt at layer 0: patching them is a no-op
    assert torch.all(grid[0, 1:] == 0)


def test_planted_mlp_out_restores_massive_and_sink(pair):
    """The construction: layer 2's FFN writes the massive dim at the BOS token; heads 0 read it."""
    model, plant, clean, corrupt = pair
    sw = patch_sweep(model, clean, corrupt, "mlp_out", _metrics(plant))
    assert sw.cell("ratio", plant.layer, 0) > 0.99
    assert sw.cell("sink", plant.layer, 0) > 0.99
    others = sw.normalized("ratio").clone()
    others[plant.layer, 0] = 0
    assert others.abs().max() < 0.01
    attn = patch_sweep(model, clean, corrupt, "attn_out", _metrics(plant))
    assert attn.normalized("ratio").abs().max() < 0.01


def test_metrics_match_hand_computation(pair):
    model, plant, clean, _ = pair
    _, cache = model.bridge.run_with_cache(clean.tokens)
    vals = evaluate_metrics(model, clean, _metrics(plant))
    h = cache[names.resid_post(4)].numpy()
    n = np.linalg.norm(h, axis=-1)
    np.testing.assert_allclose(vals["ratio"].numpy(), n[:, 0] / n[:, 1:].mean(-1), rtol=1e-5)
    sinks = []
    for layer in range(plant.layer + 1, 5):
        a = cache[names.pattern(layer)].numpy()  # [b h q k]
        sinks.append(a[:, :, 1:, 0].mean(-1).mean(-1))
    np.testing.assert_allclose(vals["sink"].numpy(), np.mean(sinks, 0), rtol=1e-5)


def test_patching_clean_into_clean_is_a_no_op(pair):
    """Negative test: a patch that copies the same values leaves every metric bit-identical."""
    model, plant, clean, _ = pair
    sw = patch_sweep(model, clean, clean, "attn_out", {"ratio": NormRatio(4, 0)}, layers=[0, 3])
    base = evaluate_metrics(
        model,
        Batch(clean.tokens.repeat(10, 1), clean.attention_mask.repeat(10, 1)),
        {"ratio": NormRatio(4, 0)},
    )["ratio"][:3]
    for li in range(2):
        for p in range(6):
            torch.testing.assert_close(sw.values["ratio"][li, p], base, rtol=0, atol=0)


def test_bad_inputs(pair):
    model, plant, clean, corrupt = pair
    m = {"ratio": NormRatio(4, 0)}
    with pytest.raises(ValueError, match="unknown patching site"):
        patch_sweep(model, clean, corrupt, "mlp_in", m)
    with pytest.raises(ValueError, match="out of range"):
        patch_sweep(model, clean, corrupt, "resid_pre", m, layers=[7])
    with pytest.raises(ValueError, match="position 9 out of range"):
        patch_sweep(model, clean, corrupt, "resid_pre", m, positions=[9])
    short = model.tokenize(["w1 w2", "w3 w4", "w5 w6"])
    with pytest.raises(ValueError, match="same shape"):
        patch_sweep(model, clean, short, "resid_pre", m)
    with pytest.raises(ValueError, match="at least one metric"):
        patch_sweep(model, clean, corrupt, "resid_pre", {})
    with pytest.raises(ValueError, match="batch_size"):
        patch_sweep(model, clean, corrupt, "resid_pre", m, batch_size=0)
    with pytest.raises(ValueError, match="at least one layer"):
        SinkMass((), 0)
    with pytest.raises(ValueError, match="unknown patching site"):
        site_hook("bogus", 0)
    assert site_hook("mlp_out", 3) == names.ffn_out(3)


def test_padded_prompts_fast_path_equals_full_forwards(planted):
    """Right-padded prompts: the block-suffix runs reuse the corrupt run's 4-D mask correctly."""
    model, plant = planted
    clean = model.tokenize(["w1 w2 w3 w4 w5 w6", "w7 w8 w9", "w20 w21 w22 w23"])
    assert clean.padded
    t = clean.tokens.clone()
    t[:, 0] = t[:, 1]
    corrupt = Batch(t, clean.attention_mask.clone())
    metrics = _metrics(plant)
    fast = patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=12)
    full = patch_loop(model, clean, corrupt, "resid_pre", metrics)
    assert fast.prefix_skipped and not full.prefix_skipped
    for k in metrics:
        torch.testing.assert_close(fast.values[k], full.values[k], rtol=1e-4, atol=1e-5)


def test_per_prompt_corruption_hooks_tile_and_equal_transformer_lens(pair):
    """Per-prompt corruption values (causal.remove_massive, per_prompt=True) tile over the n*B
    rows of a chunk: the sweep equals TL's one-forward-per-cell patching with the same hooks."""
    model, plant, clean, _ = pair
    hooks = causal.remove_massive(model, clean, plant.layer, [0], None, site="resid_pre")
    metrics = _metrics(plant)
    ours = patch_sweep(model, clean, clean, "mlp_out", metrics, corrupt_hooks=hooks, batch_size=9)
    ref = _tl_sweep(
        model, clean, clean, tl_patching.get_act_patch_mlp_out, metrics, "ratio", permanent=hooks
    )
    torch.testing.assert_close(ours.values["ratio"], ref.float(), rtol=1e-4, atol=1e-5)
    # the corruption removed the massive activation upstream; the ME layer's FFN output restores it
    assert ours.corrupt["ratio"].mean() < 2 < 100 < ours.clean["ratio"].mean()
    assert ours.cell("ratio", plant.layer, 0) > 0.99
    loop = patch_loop(model, clean, clean, "mlp_out", metrics, corrupt_hooks=hooks)
    torch.testing.assert_close(ours.values["sink"], loop.values["sink"], rtol=1e-4, atol=1e-5)


def test_per_prompt_values_in_to_dict(pair):
    model, plant, clean, corrupt = pair
    sw = patch_sweep(model, clean, corrupt, "attn_out", _metrics(plant), layers=[1, 3])
    d = sw.to_dict()["per_prompt"]
    assert d["clean"]["ratio"] == sw.clean["ratio"].tolist()
    assert d["corrupt"]["sink"] == sw.corrupt["sink"].tolist()
    assert np.asarray(d["patched"]["ratio"]).shape == (2, clean.tokens.shape[1], len(clean))
    assert torch.equal(sw.cell_values("ratio", 3, 2), sw.values["ratio"][1, 2])


def test_evaluate_metrics_stop_at_layer_is_exact(pair):
    model, plant, clean, _ = pair
    metrics = {"ratio": NormRatio(plant.layer, 0), "sink": SinkMass((plant.layer,), 0)}
    full = evaluate_metrics(model, clean, metrics)
    early = evaluate_metrics(model, clean, metrics, stop_at_layer=plant.layer + 1)
    for k in metrics:
        assert torch.equal(full[k], early[k])


def _noisy(x, hook):
    """A corruption that is not reproducible (fresh noise each call): the block-suffix check fails."""
    return x + torch.randn_like(x)


def _fallback_sweep(model, plant, clean):
    hooks = [(names.resid_pre(plant.layer), _noisy)]
    return patch_sweep(model, clean, clean, "resid_pre", _metrics(plant), corrupt_hooks=hooks)


def test_fallback_to_full_forwards_is_recorded_and_warned(pair, monkeypatch):
    model, plant, clean, _ = pair
    monkeypatch.delenv(STRICT_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="fall back to full forwards.*away from"):
        sw = _fallback_sweep(model, plant, clean)
    assert not sw.prefix_skipped
    assert "away from the full forward" in sw.prefix_fallback
    assert sw.to_dict()["prefix_fallback"] == sw.prefix_fallback
    ok = patch_sweep(model, clean, pair[3], "resid_pre", _metrics(plant))
    assert ok.prefix_skipped and ok.prefix_fallback is None


def test_fallback_after_an_error_is_recorded(pair, monkeypatch):
    from me_interp.patching import suffix

    model, plant, clean, corrupt = pair
    monkeypatch.delenv(STRICT_ENV, raising=False)

    def broken(*args, **kwargs):
        raise TypeError("unexpected keyword argument 'position_embeddings'")

    monkeypatch.setattr(suffix, "_run_blocks", broken)  # every position
    monkeypatch.setattr(suffix, "_block", broken)  # the position suffix
    with pytest.warns(RuntimeWarning, match="TypeError: unexpected keyword"):
        sw = patch_sweep(model, clean, corrupt, "resid_pre", _metrics(plant))
    assert not sw.prefix_skipped and sw.prefix_fallback.startswith("running blocks")
    monkeypatch.undo()
    ref = patch_sweep(model, clean, corrupt, "resid_pre", _metrics(plant))
    for k in ref.values:  # the fallback gives the same values, by full forwards
        torch.testing.assert_close(sw.values[k], ref.values[k], rtol=1e-4, atol=1e-5)


def test_fallback_raises_when_strict(pair, monkeypatch):
    model, plant, clean, _ = pair
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="fall back to full forwards"):
        _fallback_sweep(model, plant, clean)
    monkeypatch.setenv(STRICT_ENV, "0")
    with pytest.warns(RuntimeWarning):
        _fallback_sweep(model, plant, clean)


def test_fast_path_on_gemma3_with_sliding_and_global_layers():
    """Gemma 3 gives its sliding-window and global layers their own mask and rotary embedding: the
    block-suffix runs must use each block's own inputs (before, the first block's were reused, and
    the sweep fell back to full forwards on the real Gemma-3-270m). Checked under strict mode
    against one full forward per cell, with a window short enough to cut the prompts."""
    import transformers as T

    from me_interp import load_model, synthetic

    cfg = synthetic.tiny_config("gemma3", n_layers=4)
    cfg.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    cfg.sliding_window = 3
    cfg.rope_local_base_freq = 100.0
    torch.manual_seed(0)
    hf = T.Gemma3ForCausalLM(cfg).eval()
    hf.config.architectures = ["Gemma3ForCausalLM"]
    model = load_model(hf, tokenizer=synthetic.word_tokenizer(True), dtype="float32", device="cpu")
    blocks = model.bridge.blocks
    assert len(blocks) == 4
    clean = model.tokenize(["w1 w2 w3 w4 w5 w6 w7", "w8 w9 w10 w11", "w20 w21 w22 w23 w24"])
    t = clean.tokens.clone()
    t[:, 0] = t[:, 1]
    corrupt = Batch(t, clean.attention_mask.clone())
    metrics = {"ratio": NormRatio(3, 0), "sink": SinkMass((2, 3), 0)}
    fast = patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=12)
    full = patch_loop(model, clean, corrupt, "resid_pre", metrics)
    assert fast.prefix_skipped and fast.prefix_fallback is None
    for k in metrics:
        torch.testing.assert_close(fast.values[k], full.values[k], rtol=1e-4, atol=1e-5)


def test_position_suffix_runs_only_later_positions_and_equals_full_forwards(planted):
    """Pairs that differ at one late position: chunks start at their first patched position (the
    earlier keys and values from the corrupt run's cache) and give the plain loop's values, for
    metrics that read earlier positions (norm ratio, sink) and the last token's logits."""
    from me_interp.patching import LogitDiff

    model, plant = planted
    clean = model.tokenize(["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11 w12"])
    t = clean.tokens.clone()
    t[:, 4] = t.flip(0)[:, 4]
    corrupt = Batch(t, clean.attention_mask.clone())
    metrics = {
        **_metrics(plant),
        "ld": LogitDiff(torch.tensor([3, 4]), torch.tensor([5, 6])),
    }
    for site in ("resid_pre", "attn_out", "attn_head_pattern"):
        fast = patch_sweep(model, clean, corrupt, site, metrics, batch_size=6)
        assert fast.positions_skipped and fast.positions_fallback is None
        ref = patch_loop(model, clean, corrupt, site, metrics)
        for k in metrics:
            torch.testing.assert_close(fast.values[k], ref.values[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]
)
def test_position_suffix_on_every_architecture(arch):
    """Running later positions from cached keys and values (rotary embeddings, sliding windows,
    q/k norms, sandwich norms, soft-capping) equals the plain loop on every supported block."""
    from me_interp import load_model
    from me_interp.patching import LogitDiff

    model = load_model(f"synthetic:planted-{arch}")
    clean = model.tokenize(["w1 w2 w3 w4 w5 w6 w7", "w7 w8 w9 w10 w11 w12 w13"])
    t = clean.tokens.clone()
    t[:, 4] = t.flip(0)[:, 4]
    corrupt = Batch(t, clean.attention_mask.clone())
    last = model.n_layers - 1
    metrics = {
        "ratio": NormRatio(last, 0),
        "sink": SinkMass((last,), 0),
        "ld": LogitDiff(torch.tensor([3, 4]), torch.tensor([5, 6])),
    }
    fast = patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=6)
    assert fast.positions_skipped
    ref = patch_loop(model, clean, corrupt, "resid_pre", metrics)
    for k in metrics:
        torch.testing.assert_close(fast.values[k], ref.values[k], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("site", ["resid_pre", "attn_head_out", "attn_head_pattern", "v"])
def test_cells_patching_every_position_run_from_the_first_changed_one(planted, monkeypatch, site):
    """Pairs that differ from position 4 on: a cell patching every position changes nothing
    before 4 (clean == corrupt there), so its rows run positions 4.. only, and the values equal the
    plain loop; grouped by start position, no chunk runs earlier positions."""
    import me_interp.patching.sweep as sweep_mod
    from me_interp.patching import LogitDiff

    model, plant = planted
    clean = model.tokenize(["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11 w12"])
    t = clean.tokens.clone()
    t[:, 4] = t.flip(0)[:, 4]
    corrupt = Batch(t, clean.attention_mask.clone())
    metrics = {**_metrics(plant), "ld": LogitDiff(torch.tensor([3, 4]), torch.tensor([5, 6]))}
    starts: list[int] = []
    real = sweep_mod._run_suffix

    def spy(model, suffix, entry, last, p, B, hooks):
        starts.append(p)
        return real(model, suffix, entry, last, p, B, hooks)

    monkeypatch.setattr(sweep_mod, "_run_suffix", spy)
    fast = patch_sweep(model, clean, corrupt, site, metrics, per_position=False)
    # no chunk runs two positions or fewer: the control rows run alone at the last two (5, 6)
    assert fast.positions_skipped and starts[0] == 5 and set(starts[1:]) == {4}
    ref = patch_loop(model, clean, corrupt, site, metrics, per_position=False)
    for k in metrics:
        torch.testing.assert_close(fast.values[k], ref.values[k], rtol=1e-4, atol=1e-5)


def test_cells_that_repeat_the_clean_run_take_its_values(pair):
    """The massive token's FFN output removed at the planted layer: one block later the clean and
    corrupt streams differ only at position 0, so patching resid_pre there makes the stream the
    clean one, and that cell takes the clean run's values without running. Not where a metric reads
    an earlier block (the patched run keeps the corrupt values there), and not for a cell at or
    below the corruption's block. The values equal one forward per cell either way."""
    model, plant, clean, _ = pair
    hooks = causal.remove_massive(
        model, clean, plant.layer, [0], None, site="ffn_out", per_prompt=False
    )
    after = plant.layer + 1
    late = {"ratio": NormRatio(4, 0), "sink": SinkMass(tuple(range(after, 5)), 0)}
    early = {**late, "sink": SinkMass(tuple(range(plant.layer, 5)), 0)}
    for metrics, n_clean in ((late, 1), (early, 0)):
        fast = patch_sweep(model, clean, clean, "resid_pre", metrics, corrupt_hooks=hooks)
        ref = patch_loop(model, clean, clean, "resid_pre", metrics, corrupt_hooks=hooks)
        assert fast.n_cells_clean == n_clean
        for k in metrics:
            torch.testing.assert_close(fast.values[k], ref.values[k], rtol=1e-4, atol=1e-5)
            if n_clean:
                assert torch.equal(fast.cell_values(k, after, 0), fast.clean[k])
    # every position patched: every cell above the corruption's block up to the first block a
    # metric reads repeats the clean run; the later ones run
    whole = patch_sweep(
        model, clean, clean, "resid_pre", late, corrupt_hooks=hooks, per_position=False
    )
    ref = patch_loop(
        model, clean, clean, "resid_pre", late, corrupt_hooks=hooks, per_position=False
    )
    assert whole.n_cells_clean == 1 and whole.n_cells_run == 4 - after
    for k in late:
        torch.testing.assert_close(whole.values[k], ref.values[k], rtol=1e-4, atol=1e-5)


def _late_pair(planted):
    """Planted prompts whose corrupt copy differs at position 4 only."""
    model, plant = planted
    clean = model.tokenize(["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11 w12"])
    t = clean.tokens.clone()
    t[:, 4] = t.flip(0)[:, 4]
    return model, plant, clean, Batch(t, clean.attention_mask.clone())


def test_control_rows_in_the_first_chunk_check_the_position_suffix(planted, monkeypatch):
    """No separate check run where a chunk runs at most two positions: the first chunk carries the
    unpatched corrupt prompts (control rows, joining at the first block) next to its cells, and
    every run of the suffix is a chunk. Where
    the control rows do not reproduce the corrupt run (here the cached keys and values of the
    earlier positions are lost), the sweep warns and runs every position, with the loop's values;
    under STRICT_ENV it raises."""
    import me_interp.patching.sweep as sweep_mod
    from me_interp.patching import suffix

    model, plant, clean, corrupt = _late_pair(planted)
    metrics = _metrics(plant)
    entries: list[list[int]] = []
    real = sweep_mod._run_suffix

    def spy(model, suffix_, entry, last, p, B, hooks):
        entries.append(list(entry))
        return real(model, suffix_, entry, last, p, B, hooks)

    monkeypatch.setattr(sweep_mod, "_run_suffix", spy)
    fast = patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=4)
    assert fast.positions_skipped and len(entries) == fast.n_forwards
    # the control rows join first, at the lowest block any chunk starts from
    assert entries[0][0] == min(e[0] for e in entries[1:]) and len(entries[0]) >= 2
    ref = patch_loop(model, clean, corrupt, "resid_pre", metrics)
    for k in metrics:
        torch.testing.assert_close(fast.values[k], ref.values[k], rtol=1e-4, atol=1e-5)

    join = suffix._PrefixKV._join

    def forget(past, new):  # the earlier positions' keys and values lost
        return join(torch.zeros_like(past), new)

    monkeypatch.setattr(suffix._PrefixKV, "_join", staticmethod(forget))
    monkeypatch.delenv(STRICT_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="runs every position"):
        slow = patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=4)
    assert not slow.positions_skipped and slow.prefix_skipped
    assert "away from the full run" in slow.positions_fallback
    for k in metrics:
        torch.testing.assert_close(slow.values[k], ref.values[k], rtol=1e-4, atol=1e-5)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="runs every position"):
        patch_sweep(model, clean, corrupt, "resid_pre", metrics, batch_size=4)
