"""weight_swap and weight_patching (and what they share in ``study.weights``): the verdicts the planted
construction implies, "not applicable" / "fails" on models without the mechanism, measurements against
hand computations, subsampling, CLI smoke and bad inputs, and the bundled model with two-sided bounds.

The claims are k-of-n counts over partner / target layers with exact Clopper–Pearson intervals: with
the 5-layer planted model (4 partners, 2 targets before its ME layer) no verdict can be decided
against ``moved_fraction`` = 0.5 (4 of 4 give [0.40, 1]), so the verdicts the construction implies
are checked on 8-layer planted models (7 partners; 6 targets before an ME layer 6)."""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import pytest
import torch

from me_interp import claims, io, load_model, names, synthetic
from me_interp.claims import FAILS, HOLDS, INCONCLUSIVE, NOT_APPLICABLE, NotApplicable
from me_interp.experiments import weight_patching, weight_swap
from me_interp.probes import Criterion, measurement
from me_interp.probes.attention import attention_stats
from me_interp.probes.measurement import EditRow
from me_interp.probes.site import locate
from me_interp.prompts import spread
from me_interp.study import roundtrip, weights

# What the planted construction implies (synthetic.planted_llama: layer 2's pre-FFN gain is 8 on the
# gain dims, neuron 5 reads them and writes the massive dim; no part of attention is involved).
PLANTED_SWAP = {
    "weight_swap.ffn_path": HOLDS,  # gain and neuron travel together: the emergence moves
    "weight_swap.ffn_norm": FAILS,  # the gain without the neuron: it vanishes
    "weight_swap.ffn": FAILS,  # the neuron without the gain: too weak, it vanishes
    "weight_swap.attn_path": FAILS,  # every layer has the same sink head: it stays
    "weight_swap.attn_norm": FAILS,
    "weight_swap.attn": FAILS,
    "weight_swap.block": HOLDS,  # a different claim: the whole layer, attention included
    "weight_swap.ffn_path_needed": HOLDS,  # without its own pair layer 2 is no longer the ME layer
}
PLANTED_SWAP_FEW = dict.fromkeys(PLANTED_SWAP, INCONCLUSIVE)  # 4 partners: [0.40, 1] / [0, 0.60]
PLANTED_PATCH = {
    "weight_patching.ffn_path": HOLDS,
    "weight_patching.ffn_norm": FAILS,
    "weight_patching.ffn": FAILS,
    "weight_patching.attn_path": FAILS,
    "weight_patching.attn_norm": FAILS,
    "weight_patching.attn": FAILS,
    "weight_patching.block": HOLDS,
}
PLANTED_PATCH_FEW = dict.fromkeys(PLANTED_PATCH, INCONCLUSIVE)  # 2 targets: [0.16, 1] / [0, 0.84]


def _load(**kw):
    hf, tok, plant = synthetic.planted_llama(**kw)
    return load_model(hf, tokenizer=tok, device="cpu"), plant


@pytest.fixture(scope="module")
def planted8():
    """The planted construction with 8 layers, ME layer 2: 7 partner layers."""
    return _load(n_layers=8)


@pytest.fixture(scope="module")
def twin8():
    return _load(n_layers=8, plant=False)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "planted.txt"
    path.write_text("\n".join(synthetic.planted_prompts(5)) + "\n")
    return str(path)


@pytest.fixture
def snap_hf():
    return lambda model: {k: v.detach().clone() for k, v in model.hf.state_dict().items()}


def _verdicts(cs):
    return {c.id: c.verdict for c in cs}


def _check_claims(cs, specs):
    """Every spec has exactly one claim, in order; judged claims carry an estimate and a rule."""
    assert [c.id for c in cs] == [s.id for s in specs]
    for c in cs:
        assert isinstance(c, claims.Claim)
        if c.verdict != NOT_APPLICABLE:
            assert c.estimate is not None and c.estimate.n >= 1 and "threshold" in c.rule
        assert c.id in c.line()


def _never_holds(cs):
    # was: every claim fails or is not applicable; with 2-4 partners 0 of n is [0, 0.60+] under
    # Clopper–Pearson, which is inconclusive (the old "fails" rested on a zero-width bootstrap
    # interval over 0/1 outcomes, issue 17 finding 4); test_*_fails_on_the_twin checks "fails".
    judged = [c for c in cs if c.kind == "claim"]
    assert judged and all(c.verdict != HOLDS for c in judged), _verdicts(cs)
    assert any(c.verdict != NOT_APPLICABLE for c in judged)


def _judge(module, res):
    return claims.judge(module.SPECS, res)


# ---------------------------------------------------------------------------- shared helpers


def test_spread_is_even_and_keeps_the_ends():
    assert spread(range(29), 15) == list(range(0, 29, 2))
    assert spread([1, 2, 3], 0) == [1, 2, 3]
    assert spread([1, 2, 3], 5) == [1, 2, 3]
    assert spread("abcdef", 1) == ["a"]
    assert spread("abcdef", 2) == ["a", "f"]
    with pytest.raises(ValueError, match=">= 0"):
        spread([1], -1)


def test_short_batch_spreads_and_cuts(planted, prompt_file):
    model, _ = planted
    prompts = weight_swap.Config(prompts=prompt_file).load_prompts()
    batch = measurement.short_batch(model, prompts, 2, 3)
    assert batch.prompts == (prompts[0], prompts[-1])  # spread over the set, not the first two
    assert batch.lengths == [3, 3] and batch.tokens[0, 0] == model.bos_token_id


def _grab(x, hook, *, store, key):
    store[key] = x.detach().clone()
    return x


def test_measure_matches_hand_computation(planted, prompt_file):
    """Per-prompt ratios and the sink of `measure` (one chunked forward) re-derived from raw residuals
    and attention patterns, and the sink equal to probes.attention_stats."""
    model, plant = planted
    batch = measurement.short_batch(model, synthetic.planted_prompts(5), 0, 0)
    positions = [[0]] * len(batch)
    m = measurement.measure(model, batch, Criterion(), positions)
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
        assert m.prompt_ratio[L] == pytest.approx(ratios, rel=1e-5)
        assert m.top_ratio[L] == pytest.approx(sorted(ratios)[len(ratios) // 2], rel=1e-5)
        A = store[("p", L)]  # [batch head q k]
        per_prompt = []
        for b in range(len(batch)):
            q = int(mask[b].sum())
            per_prompt.append(float(A[b, :, 1:q, 0].mean(-1).max()))
        assert m.sink[L] == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-5)
    ref = attention_stats(model, batch, positions).to_positions.amax(-1).mean(-1).tolist()
    assert m.sink == pytest.approx(ref, abs=1e-6)
    assert m.me_layer == plant.layer
    assert all(s > 0.9 for s in m.sink[plant.layer + 1 :])
    assert all(s < 0.5 for s in m.sink[: plant.layer + 1])


def test_prompt_me_layers_match_one_prompt_batches(planted, twin):
    """The per-prompt ME layer of `measure` equals the ME layer located on a batch of that prompt
    alone (a separate forward per prompt)."""
    prompts = synthetic.planted_prompts(4)
    for model, want in ((planted[0], planted[1].layer), (twin[0], None)):
        batch = measurement.short_batch(model, prompts, 0, 0)
        got = measurement.measure(model, batch, Criterion(), sink=False).prompt_me_layer
        alone = [
            locate(model, model.tokenize([p]), criterion=Criterion()).me_layer for p in prompts
        ]
        assert got == alone == [want] * 4


def test_depth_label_and_majority():
    assert weights.depth_label(3, 11) == "layer 3 (m-8)"
    assert weights.depth_label(12, 11) == "layer 12 (m+1)"
    assert weights.majority([True, True, False]) and not weights.majority([True, False])
    assert not weights.majority([])


def test_setup_on_a_model_without_massive_activation_is_not_applicable(twin, prompt_file):
    with pytest.raises(NotApplicable, match="no massive activation on this model"):
        weights.setup(weight_swap.EXPERIMENT, weight_swap.Config(prompts=prompt_file), twin[0])
    s = weights.setup(
        weight_swap.EXPERIMENT, weight_swap.Config(prompts=prompt_file, layer=2), twin[0]
    )
    assert s.layer == 2 and s.layer_given and s.baseline.me_layer is None


# ---------------------------------------------------------------------------- weight_swap


def test_weight_swap_planted(planted, prompt_file):
    model, plant = planted
    res = weight_swap.run(weight_swap.Config(prompts=prompt_file, n_prompts=0, max_tokens=0), model)
    L = plant.layer
    assert res.layer == L and res.partners == [0, 1, 3, 4] and not res.layer_given
    by = {(r.part, r.partner): r for r in res.rows}
    for p in res.partners:
        assert by[("ffn_path", p)].me_layer == p  # the pair moves the emergence
        assert by[("ffn_path", p)].prompt_me_layer == [p] * 5  # on every prompt alone too
        assert by[("block", p)].me_layer == p
        assert by[("ffn", p)].outcome == "vanished"  # either half alone makes it vanish
        assert by[("ffn_norm", p)].outcome == "vanished"
        assert by[("ffn_norm", p)].prompt_me_layer == [None] * 5
        for part in ("attn_path", "attn_norm", "attn"):
            assert by[(part, p)].outcome == "stayed"
    moved = by[("ffn_path", 4)]
    assert moved.ratio_at_partner > 100 and moved.ratio_at_layer < 10
    assert len(moved.ratio_at_partner_per_prompt) == res.n_prompts == 5
    assert moved.sink[3] < 0.5 < res.baseline.sink[3]  # the sink follows the activation
    cs = _judge(weight_swap, res)
    _check_claims(cs, weight_swap.SPECS)
    assert _verdicts(cs) == PLANTED_SWAP_FEW
    head = cs[0]
    assert head.id == "weight_swap.ffn_path" and head.estimate.unit == "partner layers"
    assert head.estimate.method == "clopper-pearson" and head.estimate.n == 4
    assert head.estimate.value == 1 and head.estimate.lo == pytest.approx(0.025 ** (1 / 4))
    assert head.outcomes == {
        "layer 0 (m-2)": True,
        "layer 1 (m-1)": True,
        "layer 3 (m+1)": True,
        "layer 4 (m+2)": True,
    }
    assert "layer 0 (m-2) 5/5" in head.details and "more than half" in head.statistic
    assert head.threshold == claims.threshold("moved_fraction")
    d = io.to_jsonable(res)
    assert "claims" not in d  # the CLI / battery add them (study.Outcome)
    assert [p.moved for p in res.per_partner("ffn_path")] == [True] * 4
    assert [p.moved_prompts for p in res.per_partner("ffn_path")] == [5] * 4
    assert [p.left_layer for p in res.per_partner("ffn_norm")] == [True] * 4
    assert res.partners_with("ffn", "vanished") == [0, 1, 3, 4]
    json.dumps(d)
    assert io.to_jsonable(roundtrip(res)) == d  # result.json reads back as the typed Result
    assert set(weight_swap.figures(res)) == {
        "me_layer_after_swap",
        "ratio_at_partner",
        "moved_fraction",
    }
    assert "ffn_path" in weight_swap.summary(res) and "[holds]" not in weight_swap.summary(res)


def test_weight_swap_planted_with_enough_partners(planted8, prompt_file):
    """7 partners: 7 of 7 is [0.59, 1] (holds) and 0 of 7 is [0, 0.41] (fails)."""
    model, plant = planted8
    res = weight_swap.run(weight_swap.Config(prompts=prompt_file), model)
    assert res.layer == plant.layer == 2 and len(res.partners) == 7
    cs = _judge(weight_swap, res)
    assert _verdicts(cs) == PLANTED_SWAP
    head = cs[0]
    assert head.estimate.lo == pytest.approx(0.025 ** (1 / 7), abs=1e-6)
    assert list(head.outcomes)[-1] == "layer 7 (m+5)"
    ffn_norm = next(c for c in cs if c.id == "weight_swap.ffn_norm")
    assert ffn_norm.estimate.hi == pytest.approx(1 - 0.025 ** (1 / 7), abs=1e-6)


def test_weight_swap_majority_over_prompts_by_hand(planted8, prompt_file):
    """A partner's outcome is the majority of its prompts' own ME layers: rewrite the per-prompt
    ME layers of one row and count by hand."""
    model, _ = planted8
    cfg = weight_swap.Config(prompts=prompt_file, partners=(0, 5, 7), parts=("ffn_path",))
    res = weight_swap.run(cfg, model)
    n = res.n_prompts
    half = [0] * (n // 2) + [2] * (n - n // 2)  # half: no majority
    res.rows[0] = dataclasses.replace(res.rows[0], prompt_me_layer=half)
    more = [5] * (n // 2 + 1) + [None] * (n - n // 2 - 1)
    res.rows[1] = dataclasses.replace(res.rows[1], prompt_me_layer=more)
    pp = res.per_partner("ffn_path")
    assert [p.moved_prompts for p in pp] == [n // 2, n // 2 + 1, n]
    assert [p.moved for p in pp] == [False, True, True]
    assert [p.left_layer for p in pp] == [
        False,
        True,
        True,
    ]  # row 0: half its prompts still at m = 2
    o = res.partner_outcomes("ffn_path")
    assert list(o.outcomes) == [False, True, True]
    assert list(o.labels) == ["layer 0 (m-2)", "layer 5 (m+3)", "layer 7 (m+5)"]
    c = _judge(weight_swap, res)[0]
    assert c.estimate.value == pytest.approx(2 / 3) and c.verdict == INCONCLUSIVE


def test_weight_swap_partner_subsample_and_parts(planted, prompt_file):
    model, _ = planted
    cfg = weight_swap.Config(prompts=prompt_file, max_partners=2, parts=("ffn_path", "ffn"))
    res = weight_swap.run(cfg, model)
    assert res.partners == [0, 4]  # spread: first and last of the other layers
    cs = {c.id: c for c in _judge(weight_swap, res)}
    # was HOLDS / FAILS on a zero-width bootstrap over 2 partners (issue 17 finding 4): 2 of 2 is
    # [0.16, 1] and 0 of 2 is [0, 0.84]
    assert cs["weight_swap.ffn_path"].verdict == INCONCLUSIVE
    assert cs["weight_swap.ffn_path"].outcomes == {"layer 0 (m-2)": True, "layer 4 (m+2)": True}
    assert cs["weight_swap.ffn"].verdict == INCONCLUSIVE
    assert cs["weight_swap.ffn"].outcomes == {"layer 0 (m-2)": False, "layer 4 (m+2)": False}
    assert cs["weight_swap.block"].verdict == NOT_APPLICABLE  # not swapped in this run
    assert cs["weight_swap.ffn_path_needed"].estimate.value == 1
    res = weight_swap.run(weight_swap.Config(prompts=prompt_file, parts=("block",)), model)
    assert _verdicts(_judge(weight_swap, res))["weight_swap.ffn_path_needed"] == NOT_APPLICABLE


def test_weight_swap_me_layer_at_the_last_layer(prompt_file):
    """An ME layer at the last layer: every partner is earlier, nothing needs a later layer."""
    model, plant = _load(layer=4)
    res = weight_swap.run(weight_swap.Config(prompts=prompt_file, parts=("ffn_path",)), model)
    assert res.layer == 4 and res.partners == [0, 1, 2, 3]
    assert [p.moved for p in res.per_partner("ffn_path")] == [True] * 4
    c = _judge(weight_swap, res)[0]
    assert list(c.outcomes) == [f"layer {p} (m{p - 4})" for p in range(4)]
    assert weight_swap.summary(res) and weight_swap.figures(res)


def test_weight_swap_fails_on_the_twin(twin8, prompt_file):
    """--layer 2 of the 8-layer twin: nothing moves on any of 7 partners, so the claims fail."""
    model, _ = twin8
    cfg = weight_swap.Config(prompts=prompt_file, layer=2, parts=("ffn_path", "block"))
    v = _verdicts(_judge(weight_swap, weight_swap.run(cfg, model)))
    assert v["weight_swap.ffn_path"] == v["weight_swap.block"] == FAILS
    assert v["weight_swap.ffn_path_needed"] == NOT_APPLICABLE  # no emergence to remove


@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_weight_swap_without_massive_activation(fixture, request, prompt_file, snap_hf):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    with pytest.raises(NotApplicable, match="no massive activation on this model"):
        weight_swap.run(weight_swap.Config(prompts=prompt_file), model)
    before = snap_hf(model)
    cfg = weight_swap.Config(prompts=prompt_file, layer=2, max_partners=2)
    res = weight_swap.run(cfg, model)  # --layer: judged, and nothing can move
    cs = _judge(weight_swap, res)
    _never_holds(cs)
    assert _verdicts(cs)["weight_swap.ffn_path_needed"] == NOT_APPLICABLE  # no emergence to remove
    after = model.hf.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_weight_swap_runs_on_qwen3_with_explicit_layer(tiny_qwen3, prompt_file, snap_hf):
    """A random tiny Qwen3 has no ME layer: --layer picks the layer; attn swaps include q/k norms."""
    before = snap_hf(tiny_qwen3)
    cfg = weight_swap.Config(
        prompts=prompt_file, layer=1, partners=(0, 3), parts=("attn_path", "ffn_path")
    )
    res = weight_swap.run(cfg, tiny_qwen3)
    assert res.layer == 1 and len(res.rows) == 4
    assert all(r.outcome == "vanished" for r in res.rows)  # there was nothing to move
    _never_holds(_judge(weight_swap, res))
    after = tiny_qwen3.hf.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_weight_swap_bad_inputs(planted, prompt_file):
    model, plant = planted
    with pytest.raises(ValueError, match="with itself"):
        weight_swap.run(weight_swap.Config(prompts=prompt_file, partners=(plant.layer,)), model)
    with pytest.raises(ValueError, match="out of range"):
        weight_swap.run(weight_swap.Config(prompts=prompt_file, partners=(0, 7)), model)
    with pytest.raises(ValueError, match="out of range"):
        weight_swap.run(weight_swap.Config(prompts=prompt_file, layer=5), model)
    with pytest.raises(ValueError, match="unknown parts 'mlp'"):
        weight_swap.Config(parts=("mlp",))
    with pytest.raises(ValueError, match="repeats"):
        weight_swap.Config(parts=("ffn", "ffn"))
    with pytest.raises(ValueError, match="max_tokens"):
        weight_swap.Config(max_tokens=1)
    with pytest.raises(ValueError, match="max_partners"):
        weight_swap.Config(max_partners=-1)


# ---------------------------------------------------------------------------- weight_patching


def test_weight_patching_within_planted(planted, prompt_file):
    model, plant = planted
    res = weight_patching.run(weight_patching.Config(prompts=prompt_file), model)
    assert res.source_layer == plant.layer and res.targets == [0, 1] == res.eligible
    by = {(r.part, r.target): r for r in res.rows}
    for t in res.targets:  # copied before the planted layer, the pair makes the emergence there
        assert by[("ffn_path", t)].outcome == "copied"
        assert by[("ffn_path", t)].prompt_me_layer == [t] * 5
        assert by[("block", t)].outcome == "copied"
        assert by[("ffn_norm", t)].outcome == "kept"  # the gain without the neuron: nothing new
        assert by[("ffn", t)].outcome == "vanished"  # its write to dim 7 raises the RMS at layer 2
        assert by[("attn_path", t)].outcome == "kept"
    cs = _judge(weight_patching, res)
    _check_claims(cs, weight_patching.SPECS)
    assert _verdicts(cs) == PLANTED_PATCH_FEW  # 2 targets: 2 of 2 is [0.16, 1]
    assert cs[0].estimate.unit == "target layers" and cs[0].estimate.n == 2
    assert cs[0].estimate.lo == pytest.approx(0.025**0.5)
    assert cs[0].outcomes == {"layer 0 (m-2)": True, "layer 1 (m-1)": True}
    d = io.to_jsonable(res)
    assert [t.copied for t in res.per_target("ffn_path")] == [True, True]
    assert [t.copied_prompts for t in res.per_target("ffn_path")] == [5, 5]
    json.dumps(d)
    assert io.to_jsonable(roundtrip(res)) == d  # result.json reads back as the typed Result
    assert set(weight_patching.figures(res)) == {"me_layer_after_patch"}
    assert "ffn_path" in weight_patching.summary(res)


def test_weight_patching_within_planted_with_enough_targets(prompt_file):
    """ME layer 6 of 8: six targets before it, so 6 of 6 is [0.54, 1] and 0 of 6 is [0, 0.46]."""
    model, plant = _load(layer=6, n_layers=8)
    res = weight_patching.run(weight_patching.Config(prompts=prompt_file), model)
    assert res.source_layer == 6 and res.eligible == [0, 1, 2, 3, 4, 5]
    cs = _judge(weight_patching, res)
    assert _verdicts(cs) == PLANTED_PATCH
    assert list(cs[0].outcomes) == [f"layer {t} (m{t - 6})" for t in range(6)]


def test_weight_patching_majority_over_prompts_by_hand(planted, prompt_file):
    model, _ = planted
    cfg = weight_patching.Config(prompts=prompt_file, targets=(0, 1, 3), parts=("ffn_path",))
    res = weight_patching.run(cfg, model)
    n = res.n_prompts
    res.rows[1] = dataclasses.replace(  # not a majority
        res.rows[1], prompt_me_layer=[1] * (n // 2) + [None] * (n - n // 2)
    )
    pp = res.per_target("ffn_path")
    assert [t.copied_prompts for t in pp][:2] == [n, n // 2]
    assert [t.copied for t in pp] == [True, False, False]
    o = res.target_outcomes("ffn_path")  # target 3 (after the ME layer) is not judged
    assert list(o.outcomes) == [True, False] and list(o.labels) == [
        "layer 0 (m-2)",
        "layer 1 (m-1)",
    ]


def test_weight_patching_later_targets_are_reported_not_judged(planted, prompt_file):
    model, plant = planted
    cfg = weight_patching.Config(prompts=prompt_file, targets=(0, 3, 4), parts=("ffn_path",))
    res = weight_patching.run(cfg, model)
    assert res.eligible == [0]
    assert [r.outcome for r in res.rows] == ["copied", "kept", "kept"]
    c = _judge(weight_patching, res)[0]
    # was HOLDS on one target (a zero-width bootstrap interval); 1 of 1 is [0.025, 1]
    assert c.verdict == INCONCLUSIVE and c.estimate.n == 1 and "[3, 4]" in c.details
    assert c.outcomes == {"layer 0 (m-2)": True}
    cfg = weight_patching.Config(prompts=prompt_file, targets=(3, 4), parts=("ffn_path",))
    cs = _judge(weight_patching, weight_patching.run(cfg, model))
    assert {c.verdict for c in cs} == {NOT_APPLICABLE}


def test_weight_patching_second_model(planted, twin, prompt_file):
    """Twin ← planted: every target of a model without the emergence is eligible, and only the pair
    (or the whole block) carries the mechanism over."""
    model, plant = planted
    twin_model, _ = twin
    res = weight_patching.run(
        weight_patching.Config(prompts=prompt_file), twin_model, source_model=model
    )
    assert res.source_layer == plant.layer and res.targets == res.eligible == [0, 1, 2, 3, 4]
    assert res.baseline.me_layer is None
    for part, want in (("ffn_path", "copied"), ("block", "copied"), ("ffn", "vanished")):
        assert {r.outcome for r in res.part_rows(part)} == {want}
    # 5 targets: 5 of 5 is [0.48, 1], just short of moved_fraction
    assert _verdicts(_judge(weight_patching, res)) == PLANTED_PATCH_FEW


def test_weight_patching_second_model_with_enough_targets(planted8, twin8, prompt_file):
    res = weight_patching.run(
        weight_patching.Config(prompts=prompt_file), twin8[0], source_model=planted8[0]
    )
    assert res.eligible == list(range(8))
    assert _verdicts(_judge(weight_patching, res)) == PLANTED_PATCH


def test_weight_patching_without_massive_activation(twin, tiny_llama, prompt_file):
    with pytest.raises(NotApplicable, match="no massive activation on this model"):
        weight_patching.run(weight_patching.Config(prompts=prompt_file), twin[0])
    with pytest.raises(NotApplicable, match="no massive activation on this model"):
        weight_patching.run(weight_patching.Config(prompts=prompt_file), tiny_llama)
    for model in (twin[0], tiny_llama):
        cfg = weight_patching.Config(prompts=prompt_file, layer=2, max_targets=2)
        res = weight_patching.run(cfg, model)
        assert len(res.targets) == 2 and res.targets[0] == 0 and 2 not in res.targets
        _never_holds(_judge(weight_patching, res))


def test_weight_patching_me_layer_zero_has_no_default_target(prompt_file):
    hf, tok, _ = synthetic.planted_llama(layer=0)
    model = load_model(hf, tokenizer=tok, device="cpu")
    with pytest.raises(NotApplicable, match="no earlier layer"):
        weight_patching.run(weight_patching.Config(prompts=prompt_file), model)


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
    with pytest.raises(ValueError, match="max_targets"):
        weight_patching.Config(max_targets=-1)


# ---------------------------------------------------------------------------- command line

CLI = [  # one partner / 5 targets: decided by no k of n, so the verdict is inconclusive
    (weight_swap, ["--parts", "ffn_path", "block", "--partners", "0"], "weight_swap.ffn_path"),
    (
        weight_patching,
        ["--model", "synthetic:twin", "--source-model", "synthetic:planted", "--parts", "ffn_path"],
        "weight_patching.ffn_path",
    ),
]


@pytest.mark.parametrize("module,args,headline", CLI, ids=[m.NAME for m, _, _ in CLI])
def test_cli_smoke(module, args, headline, prompt_file, tmp_path, capsys):
    argv = ["--model", "synthetic:planted", "--prompts", prompt_file, "--out", str(tmp_path)]
    rc = module.main(
        [*argv, "--device", "cpu", "--verbose", *args]
    )  # a later --model overrides the first
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"[inconclusive] {headline}" in out and "per unit: layer" in out
    run_dir = next((tmp_path / module.NAME).iterdir())
    result = json.loads((run_dir / "result.json").read_text())
    assert [c["id"] for c in result["claims"]] == [s.id for s in module.SPECS]
    head = next(c for c in result["claims"] if c["id"] == headline)
    assert head["verdict"] == INCONCLUSIVE and head["estimate"]["n"] >= 1
    assert head["outcomes"] and all(head["outcomes"].values())  # every unit moved / copied
    assert (run_dir / "config.json").is_file() and (run_dir / "env.json").is_file()
    assert list(run_dir.glob("*.html"))


@pytest.mark.parametrize("module", [weight_swap, weight_patching])
def test_cli_on_the_twin_is_not_applicable(module, prompt_file, tmp_path, capsys):
    argv = ["--model", "synthetic:twin", "--prompts", prompt_file, "--out", str(tmp_path)]
    assert module.main([*argv, "--device", "cpu"]) == 0
    assert "no massive activation on this model" in capsys.readouterr().out
    run_dir = next((tmp_path / module.NAME).iterdir())
    result = json.loads((run_dir / "result.json").read_text())
    assert {c["verdict"] for c in result["claims"]} == {NOT_APPLICABLE}
    assert len(result["claims"]) == len(module.SPECS)


def test_edit_row_per_prompt(planted, prompt_file):
    model, plant = planted
    batch = measurement.short_batch(model, synthetic.planted_prompts(5), 0, 0)
    m = measurement.measure(model, batch, Criterion(), sink=False)
    assert m.sink == []
    row = EditRow.measured(m, m, plant.layer)
    assert row.ratio_at_layer_per_prompt == m.prompt_ratio[plant.layer]
    assert len(row.ratio_last_per_prompt) == 5 and row.change == pytest.approx(1.0)  # unedited
    assert row.cells() == (m.me_layer, "yes", m.top_ratio[plant.layer], m.top_ratio[-1])


@pytest.mark.parametrize("module", [weight_swap, weight_patching])
def test_cli_help(module, capsys):
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--parts" in out


BAD = [
    (weight_swap, ["--layer", "9"], "out of range"),
    (weight_swap, ["--partners", "2"], "with itself"),
    (weight_swap, ["--parts", "mlp"], "invalid choice: 'mlp'"),
    (weight_patching, ["--targets", "2"], "onto itself"),
    (weight_patching, ["--source-model", "synthetic:tiny-llama"], "same shape"),
]


@pytest.mark.parametrize("module,args,message", BAD, ids=[f"{m.NAME}:{a[0]}" for m, a, _ in BAD])
def test_cli_bad_inputs(module, args, message, prompt_file, tmp_path, capsys):
    argv = ["--model", "synthetic:planted", "--prompts", prompt_file, "--out", str(tmp_path)]
    try:
        rc = module.main([*argv, "--device", "cpu", *args])
    except SystemExit as e:  # a value outside the flag's choices: argparse's one line
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err
    assert not (tmp_path / module.NAME).exists() or not any((tmp_path / module.NAME).iterdir())


# ---------------------------------------------------------------------------- bundled model


@pytest.mark.slow
def test_weight_swap_bundled(bundled):
    """Real SmolLM2-135M (ME layer 11): the RMSNorm–FFN pair moves the emergence only to nearby
    partners and it vanishes for distant ones; the pre-FFN gain alone never moves it. Numbers from
    docs/weight_experiments.md (8 built-in prompts cut to 16 tokens)."""
    cfg = weight_swap.Config(parts=("ffn_path", "ffn_norm"), partners=(10, 12, 20))
    res = weight_swap.run(cfg, bundled)
    assert res.layer == 11
    assert 100 < res.baseline.ratio_at(11) < 250
    assert 3 < res.baseline.top_ratio[-1] < 15
    assert 0.8 < res.baseline.sink_after(11) < 1.0
    by = {(r.part, r.partner): r for r in res.rows}
    for p, lo, hi in ((10, 20, 150), (12, 20, 150)):
        assert by[("ffn_path", p)].outcome == "moved"
        assert lo < by[("ffn_path", p)].ratio_at_partner < hi
    assert by[("ffn_path", 20)].outcome == "vanished"
    assert by[("ffn_path", 20)].ratio_at_layer < 3
    assert by[("ffn_norm", 20)].outcome == "stayed"
    assert 60 < by[("ffn_norm", 20)].ratio_at_layer < 250
    v = _verdicts(_judge(weight_swap, res))
    # was FAILS / HOLDS on a zero-width bootstrap over 3 partners (issue 17 finding 4): 0 of 3 is
    # [0, 0.71] and 3 of 3 [0.29, 1] under Clopper–Pearson
    assert v["weight_swap.ffn_norm"] == v["weight_swap.ffn_path_needed"] == INCONCLUSIVE
    assert [p.label for p in res.per_partner("ffn_path")] == [
        "layer 10 (m-1)",
        "layer 12 (m+1)",
        "layer 20 (m+9)",
    ]


@pytest.mark.slow
def test_weight_patching_bundled(bundled):
    """Layer 11's RMSNorm–FFN pair copied into layer 10 makes it the ME layer; copied into layer 9 it
    pre-empts layer 11's own emergence and nothing is massive; the pre-FFN gain alone changes nothing.
    Numbers from docs/weight_experiments.md."""
    cfg = weight_patching.Config(parts=("ffn_path", "ffn_norm"), targets=(9, 10))
    res = weight_patching.run(cfg, bundled)
    assert res.source_layer == 11 and res.eligible == [9, 10]
    by = {(r.part, r.target): r for r in res.rows}
    assert by[("ffn_path", 10)].outcome == "copied"
    assert 20 < by[("ffn_path", 10)].ratio_at_target < 100  # measured 39.9
    assert by[("ffn_path", 9)].outcome == "vanished"
    assert by[("ffn_path", 9)].ratio_at_me_before < 20  # measured 7.3 (unpatched 159)
    assert {by[("ffn_norm", t)].outcome for t in (9, 10)} == {"kept"}
    v = _verdicts(_judge(weight_patching, res))
    # was FAILS on a zero-width bootstrap over 2 targets: 0 of 2 is [0, 0.84]
    assert v["weight_patching.ffn_norm"] == INCONCLUSIVE
    assert v["weight_patching.ffn_path"] == INCONCLUSIVE  # one of two targets
