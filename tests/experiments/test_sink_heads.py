"""The sink-heads question of activation_patching (experiments.patching_heads, patching.heads):
head sets patched together equal a hand loop with plain TransformerLens hooks; the selection, the
random draws and the statistics equal hand computations; the claims hold on a model whose sink's
effect is carried by one head per layer (planted-needsink) and fail on one where every head carries
a part (decoy-sinkspread)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from me_interp import claims, falsifiability, load_model, names, synthetic
from me_interp.experiments import activation_patching as ap
from me_interp.patching import KLToClean
from me_interp.patching import sinkheads as ph
from me_interp.patching.cells import restore_stat
from me_interp.patching.corrupt import corrupt_for, first_token_corrupt
from me_interp.patching.heads import patch_head_sets
from me_interp.study.result import roundtrip

CONCENTRATED, SPREAD = "synthetic:planted-needsink", "synthetic:decoy-sinkspread"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def needsink():
    return load_model(CONCENTRATED, device="cpu")


def _pair(model, prompts):
    clean = model.tokenize(prompts)
    return clean, first_token_corrupt(clean)


def _kl(clean_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p = clean_logits.double().log_softmax(-1)
    q = logits.double().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


@pytest.mark.parametrize("site", ["attn_head_out", "attn_head_pattern"])
def test_head_sets_equal_a_hand_loop_with_plain_hooks(needsink, site):
    """Each set's heads patched together, prompt by prompt, with plain TL hooks on unpadded
    prompts: the same KL to the clean last-token distribution."""
    model = needsink
    prompts = synthetic.planted_prompts(4, 8)
    clean, corrupt = _pair(model, prompts)
    mask = clean.attention_mask.bool()
    full = model.run_with_hooks(clean)
    idx = mask.long().sum(-1) - 1
    clean_last = full[torch.arange(len(prompts)), idx]
    sets = [[(3, 0), (4, 0)], [(2, 1)], [(3, 2), (3, 3), (4, 1)]]
    got = patch_head_sets(
        model, clean, corrupt, site, sets, {"kl": KLToClean(clean_last)}, batch_size=8
    )
    what = "z" if site == "attn_head_out" else "pattern"
    bridge = model.bridge
    for j, s in enumerate(sets):
        for b in range(len(prompts)):
            n = int(mask[b].sum())
            tok_c, tok_x = clean.tokens[b : b + 1, :n], corrupt.tokens[b : b + 1, :n]
            with torch.no_grad():
                _, cache = bridge.run_with_cache(tok_c)

            def fn(x, hook, layer, src, heads=s):
                x = x.clone()
                for la, h in heads:
                    if la == layer:
                        if site == "attn_head_pattern":
                            x[:, h] = src[:, h]
                        else:
                            x[:, :, h] = src[:, :, h]
                return x

            hooks = []
            for la in sorted({la for la, _ in s}):
                name = names.site(what, la)
                hooks.append((name, lambda x, hook, la=la, src=cache[name]: fn(x, hook, la, src)))
            with torch.no_grad():
                logits = bridge.run_with_hooks(tok_x, fwd_hooks=hooks)
            want = _kl(clean_last[b], logits[0, -1])
            assert float(got.values["kl"][j, b]) == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert got.n_forwards == 2  # 3 sets of 4 prompts, 2 sets (8 rows) per forward


def test_head_sets_refuse_bad_input(needsink):
    clean, corrupt = _pair(needsink, synthetic.planted_prompts(2, 6))
    m = {"kl": KLToClean(torch.zeros(2, 64))}
    with pytest.raises(ValueError, match="per-head site"):
        patch_head_sets(needsink, clean, corrupt, "resid_pre", [[(0, 0)]], m)
    with pytest.raises(ValueError, match="at least one head"):
        patch_head_sets(needsink, clean, corrupt, "attn_head_out", [[]], m)
    with pytest.raises(ValueError, match="out of range"):
        patch_head_sets(needsink, clean, corrupt, "attn_head_out", [[(0, 99)]], m)


def test_random_draws_come_from_the_non_sink_heads_and_are_seeded():
    """Issue 29 item 6: the control's heads attend to p below sink_attention and are not chosen."""
    att = np.array([[0.9, 0.1, 0.5, 0.2], [0.8, 0.05, 0.1, 0.31]])  # [layer head]
    top = [(3, 0), (4, 0)]
    pool = ph.non_sink_pool(att, [3, 4], top)
    assert pool == [(3, 1), (3, 3), (4, 1), (4, 2)]  # 0.5 and 0.31 are sink heads: left out
    draws = ph.draw_random(pool, 2, 20, seed=3)
    assert draws == ph.draw_random(pool, 2, 20, seed=3)
    assert all(set(d) <= set(pool) and len(set(d)) == 2 for d in draws)
    assert len({tuple(d) for d in draws}) > 1
    assert ph.draw_random(pool, 5, 20, seed=3) == []  # too few non-sink heads


@pytest.fixture(scope="module")
def runs():
    """The experiment (resid_pre only, for speed) on the concentrated and the spread model."""
    out = {}
    for name in (CONCENTRATED, SPREAD):
        prompts = falsifiability.prompts(name)
        model = load_model(name, device="cpu")
        import tempfile
        from pathlib import Path

        path = Path(tempfile.mkdtemp()) / "prompts.txt"
        path.write_text("\n".join(prompts) + "\n", encoding="utf-8")
        cfg = ap.Config(model=name, prompts=str(path), sites=("resid_pre",))
        out[name] = (model, ap.run(cfg, model))
    return out


def test_selection_and_statistics_equal_hand_computations(runs):
    model, r = runs[CONCENTRATED]
    sh = r.sink_heads
    clean = model.tokenize(falsifiability.prompts(CONCENTRATED))
    p = r.header.position
    # attention to p by hand, from the cache
    with torch.no_grad():
        _, cache = model.bridge.run_with_cache(clean.tokens, attention_mask=clean.attention_mask)
    att = np.zeros((len(clean), len(sh.layers), sh.n_heads))
    for b, n in enumerate(clean.lengths):
        for i, la in enumerate(sh.layers):
            a = cache[names.pattern(la)][b].double()  # [head q k]
            att[b, i] = a[:, p + 1 : n, p].mean(-1).numpy()
    np.testing.assert_allclose(np.asarray(sh.attention), att, atol=1e-6)
    sel, test = claims.halves(len(clean), r.seed)
    assert sh.select == sel.tolist() and sh.test == test.tolist()
    flat = att[sel].mean(0).flatten()
    top = sorted(
        (sh.layers[i // sh.n_heads], int(i % sh.n_heads)) for i in np.argsort(-flat)[: sh.k]
    )
    assert sh.top == top and sh.k == len(sh.layers)
    assert sh.pool == ph.non_sink_pool(att[sel].mean(0), sh.layers, top)
    assert all(set(d) <= set(sh.pool) for d in sh.random_sets)
    assert roundtrip(r) == r and roundtrip(sh) == sh
    # the claims' statistics
    c, x, s = (np.asarray(v) for v in (sh.kl_clean, sh.kl_corrupt, sh.kl_top))
    assert len(c) == len(test)  # the head sets are patched on the held-out prompts only
    want = (s.mean() - x.mean()) / (c.mean() - x.mean())
    assert restore_stat(sh.rows()) == pytest.approx(want)
    rand = np.asarray(sh.kl_random)
    gap = np.mean([(x.mean() - rand[:, j].mean()) / (x.mean() - c.mean()) for j in range(10)])
    assert float(sh.excess().mean()) == pytest.approx(want - gap)


def test_every_head_after_the_me_layer_is_a_sink_head_only_on_the_spread_model(runs):
    conc = np.asarray(runs[CONCENTRATED][1].sink_heads.attention).mean(0)  # [layer head]
    spread = np.asarray(runs[SPREAD][1].sink_heads.attention).mean(0)
    assert (spread > 0.9).all()
    assert (conc[:, 0] > 0.9).all() and (conc[:, 1:] < 0.5).all()


def _verdicts(r):
    return {c.id.split(".")[1]: c for c in claims.judge(ap.SPECS, r)}


def test_the_claims_hold_where_one_head_per_layer_carries_the_sink(runs):
    v = _verdicts(runs[CONCENTRATED][1])
    assert v["sink_heads_restore"].verdict == claims.HOLDS
    assert v["sink_heads_beat_random"].verdict == claims.HOLDS
    assert "held-out prompts × random draws" in v["sink_heads_beat_random"].estimate.unit


def test_the_claims_fail_where_every_head_carries_a_part(runs):
    """Every head after the ME layer is a sink head: the restore fails, and the control has no
    non-sink head to draw (not applicable, with the one reason)."""
    v = _verdicts(runs[SPREAD][1])
    assert v["sink_heads_restore"].verdict == claims.FAILS
    assert v["sink_heads_beat_random"].verdict == claims.NOT_APPLICABLE
    assert v["sink_heads_beat_random"].why.startswith("only 0 non-sink heads")


def test_not_applicable_without_enough_draws_and_figure(runs):
    _, r = runs[CONCENTRATED]
    figs = ap.figures(r)
    assert "sink_heads" in figs and len(figs["sink_heads"].data) == 4  # 2 maps, 2 marker sets
    # the per-head restore panel: symmetric at the largest |single-head restore|
    restore = [t for t in figs["sink_heads"].data if t.type == "heatmap"][1]
    top = max(float(np.nanmax(np.abs(np.asarray(r.sink_heads.single, dtype=float)))), 0.05)
    assert (restore.zmin, restore.zmax) == pytest.approx((-top, top))
    import dataclasses

    few = dataclasses.replace(
        r, sink_heads=dataclasses.replace(r.sink_heads, random_sets=r.sink_heads.random_sets[:3])
    )
    assert _verdicts(few)["sink_heads_beat_random"].verdict == claims.NOT_APPLICABLE
    none = dataclasses.replace(r, sink_heads=None, sink_heads_why="not measured (--n-random 0)")
    assert _verdicts(none)["sink_heads_restore"].why == "not measured (--n-random 0)"
    assert "to_dict" not in vars(ap.Result) and roundtrip(r).sink_heads.k == 2


def test_held_out_corruption_equals_the_full_batch_rows(needsink):
    """The head sets run on the held-out prompts alone, with the corruption rebuilt for them
    (remove_input's per-prompt means): their corrupt KL equals the full batch's corrupt run at those
    rows, by hand."""
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "prompts.txt"
    path.write_text("\n".join(falsifiability.prompts(CONCENTRATED)) + "\n", encoding="utf-8")
    cfg = ap.Config(
        model=CONCENTRATED, prompts=str(path), sites=("resid_pre",), corruption="remove_input"
    )
    r = ap.run(cfg, needsink)
    sh, clean = r.sink_heads, needsink.tokenize(falsifiability.prompts(CONCENTRATED))
    _, hooks = corrupt_for(needsink, "remove_input", r.layer, r.header.position, clean)
    mask = clean.attention_mask.bool()
    idx = mask.long().sum(-1) - 1
    rows = torch.arange(len(clean))
    clean_last = needsink.run_with_hooks(clean)[rows, idx]
    corrupt_last = needsink.run_with_hooks(clean, hooks)[rows, idx]
    want = [_kl(clean_last[b], corrupt_last[b]) for b in sh.test]
    np.testing.assert_allclose(sh.kl_corrupt, want, rtol=1e-4, atol=1e-6)
    assert min(want) > 0.1  # the removal changes the prediction (nats)
