"""Massive-activation detection and ME-layer localisation: hand-built scans, planted models, real model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from me_interp.probes import massive
from me_interp.probes.massive import Criterion, locate_me_layer, massive_tokens
from me_interp.probes.norms import NormScan, scan_norms


def _scan(
    resid_norms: torch.Tensor, top: torch.Tensor, median: torch.Tensor, mask=None
) -> NormScan:
    """A NormScan from per-layer resid norms [layer batch pos] and top-1 |a| [layer batch pos]."""
    L, B, T = resid_norms.shape
    mask = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    pre = torch.cat([torch.ones(1, B, T), resid_norms[:-1]])
    norms = torch.stack(
        [pre, resid_norms, resid_norms]
    )  # resid_pre, resid_mid (= pre: FFN made it), post
    norms[1] = pre
    return NormScan(
        sites=("resid_pre", "resid_mid", "resid_post"),
        norms=norms,
        top_abs=top[..., None].expand(L, B, T, 2).clone(),
        top_dims=torch.tensor([5, 9]).expand(L, B, T, 2).clone(),
        median_abs=median,
        mask=mask,
        kept_prompt=0,
        kept_resid=torch.zeros(L, T, 3),
    )


def _precursor_then_me():
    """6 layers, 2 prompts, 4 tokens: a precursor at layer 1 that dies at 3, the real event at 4."""
    L, B, T = 6, 2, 4
    norms = torch.ones(L, B, T)
    top = torch.full((L, B, T), 0.5)
    median = torch.full((L, B), 0.3)
    norms[1:3, :, 0] = 20.0  # precursor: ratio 20
    top[1:3, :, 0] = 400.0  # 400 > 100 and >= 1000 * 0.3
    norms[4:, :, 0] = 2000.0  # ME: ratio 2000
    top[4:, :, 0] = 1500.0
    return _scan(norms, top, median)


def test_events_include_a_vanishing_precursor():
    loc = locate_me_layer(_precursor_then_me())
    assert [(e.layer, e.last_layer, e.persists_to_end) for e in loc.events] == [
        (1, 2, False),
        (4, 5, True),
    ]
    assert loc.me_layer == 4 and loc.me_layer_1based == 5
    assert loc.events[0].jump == pytest.approx(20.0) and loc.events[1].jump == pytest.approx(2000.0)
    assert loc.me_event.site == "ffn"
    assert loc.massive_positions == [[0], [0]] and loc.massive_dims == [5, 9]


def test_sun_criterion_thresholds_are_both_needed():
    scan = _precursor_then_me()
    # raise the relative threshold so the precursor (400 / 0.3 = 1333x) no longer counts
    loc = locate_me_layer(scan, Criterion(rel_threshold=2000.0))
    assert [e.layer for e in loc.events] == [4]
    # raise the absolute threshold above 1500: nothing is massive
    assert locate_me_layer(scan, Criterion(abs_threshold=1600.0)).me_layer is None


def test_norm_criterion_and_combinations():
    scan = _precursor_then_me()
    by_norm = massive_tokens(scan, Criterion(kind="norm", norm_ratio=50.0))
    assert by_norm[:, 0, 0].tolist() == [False, False, False, False, True, True]
    either = massive_tokens(scan, Criterion(kind="either", norm_ratio=50.0))
    both = massive_tokens(scan, Criterion(kind="both", norm_ratio=50.0))
    assert either[:, 0, 0].tolist() == [False, True, True, False, True, True]
    assert both[:, 0, 0].tolist() == by_norm[:, 0, 0].tolist()


def test_min_prompt_fraction():
    scan = _precursor_then_me()
    scan.top_abs[1:3, 1] = 0.5  # precursor only in prompt 0
    assert [e.layer for e in locate_me_layer(scan, Criterion(min_prompt_fraction=0.5)).events] == [
        1,
        4,
    ]
    assert [e.layer for e in locate_me_layer(scan, Criterion(min_prompt_fraction=1.0)).events] == [
        4
    ]


def test_detection_covers_all_positions():
    scan = _precursor_then_me()
    scan.top_abs[4:, 1, 2] = 1500.0  # a second massive token at position 2 of prompt 1
    loc = locate_me_layer(scan)
    assert loc.massive_positions == [[0], [0, 2]]


def test_bad_criterion():
    with pytest.raises(ValueError, match="criterion kind"):
        Criterion(kind="loud")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_prompt_fraction"):
        Criterion(min_prompt_fraction=0.0)
    with pytest.raises(ValueError, match="abs_threshold"):
        Criterion(abs_threshold=-1.0)


def _without(scan: NormScan, *drop: str) -> NormScan:
    """``scan`` without the sites ``drop`` (as a scan that never recorded them)."""
    keep = [i for i, s in enumerate(scan.sites) if s not in drop]
    return dataclasses.replace(
        scan, sites=tuple(scan.sites[i] for i in keep), norms=scan.norms[keep].clone()
    )


def _born_at_0_and_at_4():
    """An event at layer 0 that dies at 2 (jump 10 against the embeddings), the real one at 4."""
    L, B, T = 6, 2, 4
    norms = torch.ones(L, B, T)
    top = torch.full((L, B, T), 0.5)
    norms[0:2, :, 0] = 10.0
    top[0:2, :, 0] = 400.0
    norms[4:, :, 0] = 2000.0
    top[4:, :, 0] = 1500.0
    return _scan(norms, top, torch.full((L, B), 0.3))


def test_site_is_unknown_without_the_sub_layer_sites():
    full = locate_me_layer(_precursor_then_me())
    for drop in (("resid_pre", "resid_mid"), ("resid_mid",), ("resid_pre",)):
        loc = locate_me_layer(_without(_precursor_then_me(), *drop))
        assert [e.site for e in loc.events] == ["unknown", "unknown"], drop
        assert all(math.isnan(e.attn_log_gain) and math.isnan(e.ffn_log_gain) for e in loc.events)
        # the jumps after layer 0 need only the layer outputs: unchanged, and so is the ME layer
        assert [e.jump for e in loc.events] == [e.jump for e in full.events]
        assert loc.me_layer == full.me_layer == 4


def test_jump_at_layer_0_is_nan_without_the_embeddings():
    full = locate_me_layer(_born_at_0_and_at_4())
    assert [e.layer for e in full.events] == [0, 4] and full.me_layer == 4
    assert full.events[0].jump == pytest.approx(10.0) and full.events[0].site == "ffn"

    loc = locate_me_layer(_without(_born_at_0_and_at_4(), "resid_pre"))
    first, me = loc.events
    assert math.isnan(first.jump) and first.site == "unknown"  # not inf, not "ffn"
    assert me.jump == pytest.approx(2000.0)
    assert loc.me_layer == 4  # a measured jump outranks an unknown one

    # resid_pre alone measures the jump; the site needs resid_mid too
    only_pre = locate_me_layer(_without(_born_at_0_and_at_4(), "resid_mid"))
    assert only_pre.events[0].jump == pytest.approx(10.0) and only_pre.events[0].site == "unknown"


def test_only_an_unknown_jump_event_is_still_the_me_layer():
    scan = _born_at_0_and_at_4()
    scan.top_abs[4:] = 0.5  # only the layer-0 event is massive
    scan.norms[:, 4:] = 1.0
    loc = locate_me_layer(_without(scan, "resid_pre", "resid_mid"))
    assert [e.layer for e in loc.events] == [0] and loc.me_layer == 0
    assert math.isnan(loc.me_event.jump) and loc.me_event.site == "unknown"


def _gains_at_layer_0(pre: float, mid: float, post: float) -> NormScan:
    """4 layers, 2 prompts, 4 tokens: token 0's norm is ``pre`` at the block input of layer 0,
    ``mid`` after its attention and ``post`` at its output (and there on); the others' are 1."""
    L, B, T = 4, 2, 4
    norms = torch.ones(3, L, B, T)
    for i, v in enumerate((pre, mid, post)):
        norms[i, 0, :, 0] = v
    norms[:, 1:, :, 0] = post
    top = torch.full((L, B, T), 0.5)
    top[:, :, 0] = 1500.0  # massive (Sun) at every layer output
    return NormScan(
        sites=("resid_pre", "resid_mid", "resid_post"),
        norms=norms,
        top_abs=top[..., None].expand(L, B, T, 2).clone(),
        top_dims=torch.tensor([5, 9]).expand(L, B, T, 2).clone(),
        median_abs=torch.full((L, B), 0.3),
        mask=torch.ones(B, T, dtype=torch.bool),
        kept_prompt=0,
        kept_resid=torch.zeros(L, T, 3),
    )


def test_site_is_none_when_neither_sub_layer_makes_the_jump():
    # massive at the block input (the embeddings): the old tie-break said "ffn; jump x1"
    (ev,) = locate_me_layer(_gains_at_layer_0(1000.0, 1000.0, 1000.0)).events
    assert ev.layer == 0 and ev.jump == pytest.approx(1.0)
    assert ev.attn_log_gain == pytest.approx(0.0) and ev.ffn_log_gain == pytest.approx(0.0)
    assert ev.site == "none"
    # the rule is a factor of SITE_MIN_FACTOR (2) on the norm ratio, by hand: R = norm / 1
    assert massive.SITE_MIN_FACTOR == 2.0
    below = locate_me_layer(_gains_at_layer_0(600.0, 600.0, 1140.0)).events[0]  # x1.9: none
    assert below.ffn_log_gain == pytest.approx(math.log(1.9)) and below.site == "none"
    above = locate_me_layer(_gains_at_layer_0(500.0, 500.0, 1050.0)).events[0]  # x2.1: the FFN
    assert above.ffn_log_gain == pytest.approx(math.log(2.1)) and above.site == "ffn"
    attn = locate_me_layer(_gains_at_layer_0(300.0, 1000.0, 1000.0)).events[0]
    assert attn.site == "attention"
    # and without the sub-layer sites it is still "unknown", not "none"
    for drop in (("resid_pre",), ("resid_mid",)):
        scan = _without(_gains_at_layer_0(1000.0, 1000.0, 1000.0), *drop)
        assert locate_me_layer(scan).events[0].site == "unknown"


def test_decoy_embedding_event_site_is_none():
    from me_interp import load_model, synthetic

    model = load_model("synthetic:decoy-embedding", device="cpu")
    loc = locate_me_layer(scan_norms(model, model.tokenize(synthetic.distinct_first_prompts())))
    assert [e.layer for e in loc.events] == [0] and loc.me_layer == 0
    ev = loc.me_event
    assert ev.site == "none" and ev.jump == pytest.approx(1.0, abs=0.05)
    assert max(abs(ev.attn_log_gain), abs(ev.ffn_log_gain)) < 0.05


# -- planted models: the answer is known by construction -----------------------------------


def test_planted_me_layer_is_found_exactly(planted, planted_prompts):
    model, plant = planted
    loc = locate_me_layer(scan_norms(model, model.tokenize(planted_prompts)))
    assert loc.me_layer == plant.layer and loc.me_layer_1based == plant.layer + 1
    assert len(loc.events) == 1
    ev = loc.events[0]
    assert ev.site == "ffn" and ev.persists_to_end
    assert loc.massive_dims == [plant.massive_dim]
    assert loc.massive_positions == [[0]] * len(planted_prompts)
    # before the planted layer nothing is massive; after it the ratio stays put (carried unchanged)
    assert max(loc.top_ratio[: plant.layer]) < 2.0
    assert min(loc.top_ratio[plant.layer :]) > 100.0


def test_unplanted_twin_has_no_me_layer(twin, planted_prompts):
    model, _ = twin
    for kind in ("sun", "norm", "either"):
        loc = locate_me_layer(
            scan_norms(model, model.tokenize(planted_prompts)), Criterion(kind=kind)
        )
        assert loc.me_layer is None and loc.events == [] and loc.massive_dims == []


def test_planted_sink_token_found_at_every_position(planted):
    model, plant = planted
    batch = model.tokenize(["w1 w2 <s> w3 w4", "w5 w6 w7 w8"])  # <s> is the planted sink token
    loc = locate_me_layer(scan_norms(model, batch))
    assert loc.massive_positions == [[0, 3], [0]]


def test_planted_without_bos_has_no_massive_activation(planted, planted_prompts):
    from me_interp.models import LoadedModel

    model, _ = planted
    no_bos = LoadedModel(
        model.bridge, model.hf, model.tokenizer, "p", "no", model.dtype, model.device
    )
    loc = locate_me_layer(scan_norms(no_bos, no_bos.tokenize(planted_prompts)))
    assert loc.me_layer is None


def test_one_token_prompt_is_rejected(planted):
    model, _ = planted
    scan = scan_norms(model, model.tokenize(["w1 w2 w3", "w4"]))  # "w4" -> [<s>, w4]; fine
    locate_me_layer(scan)
    from me_interp.models import LoadedModel

    no_bos = LoadedModel(
        model.bridge, model.hf, model.tokenizer, "p", "no", model.dtype, model.device
    )
    scan = scan_norms(no_bos, no_bos.tokenize(["w1 w2 w3", "w4"]))
    with pytest.raises(ValueError, match="single token"):
        locate_me_layer(scan)


# -- the bundled real model ------------------------------------------------------------------


@pytest.mark.slow
def test_bundled_me_event(bundled):
    from me_interp.prompts import builtin_prompts

    loc = locate_me_layer(scan_norms(bundled, bundled.tokenize(builtin_prompts())))
    me = loc.me_layer
    assert me is not None and 5 <= me <= 20  # measured: 11
    assert me == 11
    assert [e.layer for e in loc.events] == [11]
    ev = loc.me_event
    assert ev.site == "ffn" and ev.last_layer == 27
    assert 50 < ev.jump < 500  # measured (82 built-in prompts): ~127
    assert 507 in loc.massive_dims[:2]
    assert all(0 in ps for ps in loc.massive_positions)
    assert 0.5 < loc.site_ratios["resid_post"][me - 1] < 3.0  # measured: ~1.0
    assert 100 < loc.site_ratios["resid_post"][me] < 300  # measured: ~167
    assert 300 < loc.site_ratios["ffn_out"][me] < 2000  # measured: ~700
    assert 2000 < loc.max_over_median[me] < 50000  # measured: ~12700
    assert loc.site_ratios["resid_post"][-1] < 30  # decays in the last layers (~7)


# -- helpers ---------------------------------------------------------------------------------


def test_others_median_matches_a_loop_with_ties_and_single_tokens():
    from me_interp.probes.massive import others_median

    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        x = torch.rand(3, 4, 7, generator=gen)
        if trial % 3 == 0:
            x = (4 * x).round()  # ties
        mask = torch.rand(4, 7, generator=gen) > 0.3
        mask[:, 0] = True
        if trial % 2:
            mask[0, 1:] = False  # a single-token prompt: NaN
        want = torch.full_like(x, float("nan"))
        for t in range(7):
            others = mask.clone()
            others[:, t] = False
            want[..., t] = x.masked_fill(~others, float("nan")).nanmedian(-1).values
        got = others_median(x, mask)
        real = mask.expand_as(x)
        torch.testing.assert_close(got[real], want[real], equal_nan=True)


def test_massive_reference_at_a_given_layer(planted):
    from me_interp.models import LoadedModel
    from me_interp.probes.massive import massive_reference

    model, plant = planted
    no_bos = LoadedModel(
        model.bridge, model.hf, model.tokenizer, "p", "no", model.dtype, model.device
    )
    scan = scan_norms(no_bos, no_bos.tokenize(["w1 w2 <s> w3 w4", "w5 <s> w6 w7", "w8 w9 w10"]))
    assert massive_reference(scan, None, plant.layer) == [2, 1, 0]  # none in prompt 2: position 0
    assert massive_reference(scan, None, 0) == [0, 0, 0]  # nothing massive before the plant
    assert locate_me_layer(scan).reference_positions == [2, 1, 0]
    with pytest.raises(ValueError, match="out of range"):
        massive_reference(scan, None, 9)


@pytest.mark.parametrize(
    "spec",
    [
        "synthetic:planted",
        "synthetic:decoy-gradual",
        "synthetic:decoy-erased",
        "synthetic:twin-nobos",
    ],
)
@pytest.mark.parametrize("kind", ["sun", "norm", "either"])
def test_prompt_me_layers_equal_locate_me_layer_on_each_prompt_alone(spec, kind):
    """The vectorised per-prompt ME layer equals locate_me_layer on each prompt's scan rows."""
    from me_interp import load_model, synthetic
    from me_interp.probes.massive import prompt_me_layers

    model = load_model(spec, device="cpu")
    prompts = synthetic.distinct_first_prompts(6) + synthetic.planted_prompts(4)
    scan = scan_norms(model, model.tokenize(prompts), ("resid_pre", "resid_mid", "resid_post"))
    crit = Criterion(kind=kind, norm_ratio=20.0)
    alone = []
    for b in range(len(prompts)):
        one = dataclasses.replace(
            scan,
            norms=scan.norms[:, :, b : b + 1],
            top_abs=scan.top_abs[:, b : b + 1],
            top_dims=scan.top_dims[:, b : b + 1],
            median_abs=scan.median_abs[:, b : b + 1],
            mask=scan.mask[b : b + 1],
        )
        alone.append(locate_me_layer(one, crit).me_layer)
    assert prompt_me_layers(scan, crit) == alone
    if spec == "synthetic:twin-nobos":
        assert set(alone) == {None}
    elif spec == "synthetic:planted":
        assert None not in alone


def test_row_medians_equal_one_median_per_row():
    """``_medians`` (one ``nanmedian`` over the last dim) gives each row's ``_median``: odd and even
    counts (the lower median), NaNs skipped, an all-NaN row NaN, ties, ``inf``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g)
    x[1, ::2] = float("nan")  # 4 values left: an even count
    x[2] = float("nan")
    x[3, :5] = 1.0
    x[4, 0] = float("inf")
    for rows in (x, x[:, :8], x.double()):
        got = massive._medians(rows)
        want = [massive._median(r) for r in rows]
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a == b or (math.isnan(a) and math.isnan(b))
