"""The claim type: bootstrap intervals against independent computations, the decision rule at its
edges, a constructed straddling case that must be inconclusive, and the JSON round trip."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from me_interp import claims, io
from me_interp.patching.cells import restore_stat

SPEC = claims.Spec(
    "demo.moves",
    "§2.1",
    "The thing moves",
    statistic="fraction moved",
    op=">=",
    threshold="moved_fraction",
    control="an unplanted twin",
)


class _Result:
    def __init__(self, seed=0, **kw):
        self.seed = seed
        self.__dict__.update(kw)


def _spec(stat, op=">=", thr="moved_fraction", **kw):
    return claims.Spec("demo.x", "§0", "x", "x", op, thr, stat=stat, **kw)


def _judge(stat, op=">=", thr="moved_fraction", seed=0, **kw):
    (c,) = claims.judge([_spec(stat, op, thr, **kw)], _Result(seed))
    return c


def test_bootstrap_mean_matches_the_normal_interval():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, size=400)
    est = _judge(lambda r: claims.Sample(x)).estimate
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x))  # independent: the CLT interval
    assert est.value == pytest.approx(x.mean())
    assert est.lo == pytest.approx(x.mean() - half, abs=0.25 * half)
    assert est.hi == pytest.approx(x.mean() + half, abs=0.25 * half)
    assert est.n == est.n_eff == 400 and est.resamples == claims.N_BOOTSTRAP >= 1000


def test_bootstrap_is_seeded_and_resamples_rows_together():
    x = np.arange(20, dtype=float)
    same = [_judge(lambda r: claims.Sample(x), seed=3).estimate for _ in range(2)]
    assert same[0] == same[1] != _judge(lambda r: claims.Sample(x), seed=4).estimate
    # paired rows: the difference of columns is constant, so its interval has no width
    pairs = np.stack([x, x + 2.0], axis=1)
    c = _judge(lambda r: claims.Sample(pairs, lambda a: float((a[:, 1] - a[:, 0]).mean())))
    assert c.estimate.value == c.estimate.lo == c.estimate.hi == pytest.approx(2.0)
    assert c.verdict == claims.INCONCLUSIVE and "zero width" in c.why  # not evidence


def test_bootstrap_by_hand_loop_equals_vectorised_mean():
    x = np.random.default_rng(0).exponential(size=30)
    fast = _judge(lambda r: claims.Sample(x), seed=5).estimate
    slow = _judge(lambda r: claims.Sample(x, lambda a: float(a.mean())), seed=5).estimate
    assert (fast.lo, fast.hi) == pytest.approx((slow.lo, slow.hi), rel=1e-12)


def _by_hand():
    """Each ``claims.of_means`` statistic of the experiments beside its per-resample formula, as it
    was written before (sums and means of the rows, Python branches), and the width of its rows."""
    from me_interp import evaluation
    from me_interp.experiments import super_weight, transplant
    from me_interp.probes.alignment import gain_alignment

    def ppl(a):
        return math.exp((a[:, 2].sum() - a[:, 1].sum()) / a[:, 0].sum())

    def gain(a):
        fm, fo, fm0, fo0 = a.mean(0)
        e, e0 = fm - fo, fm0 - fo0
        top = max(abs(e), abs(e0))
        return min(1.0 - fo / fm, 0.0 if top == 0 else (e - e0) / top)

    def shift(a):
        c = a.mean(0)
        before, after = c[:3].max(), c[3:].mean()
        return 0.0 if max(before, after) == 0 else (after - before) / max(before, after)

    def restore(a):
        m = a.mean(0)
        return np.max((m[2:] - m[1]) / (m[0] - m[1]))

    def recovered(a):
        damage = a[:, 2].sum() - a[:, 1].sum()
        return (a[:, 2].sum() - a[:, 3].sum()) / damage if damage > 0 else math.nan

    return [
        (claims.excess_stat, lambda a: (a[:, 0].mean() - 1) / (a[:, 1].mean() - 1), 2),
        (restore_stat, restore, 6),
        (claims.relative_drop, lambda a: 1 - a[:, 1].mean() / a[:, 0].mean(), 2),
        (
            transplant._share_stat,
            lambda a: (a[:, 0].mean() - a[:, 1].mean()) / a[:, 2].mean(),
            3,
        ),
        (evaluation.PPL_RATIO, ppl, 3),
        (evaluation.PPL_CHANGE, lambda a: ppl(a) - 1, 3),
        (evaluation.sink_drop, lambda a: 1 - a[:, 1].mean() / a[:, 0].mean(), 2),
        (evaluation.ratio_change, lambda a: a[:, 1].mean() / a[:, 0].mean() - 1, 2),
        (super_weight._recovered, recovered, 4),
        (gain_alignment, gain, 4),
        (claims.of_means(lambda m: claims.rise_after(m, 2)), shift, 6),
    ]


def test_of_means_statistics_equal_their_per_resample_formulas():
    """The bootstrap of an ``of_means`` statistic (one vectorised call on every resample's column
    means) gives, resample by resample, what the statistic's formula gives on the resampled rows."""
    rng = np.random.default_rng(3)
    for fast, slow, k in _by_hand():
        a = rng.uniform(0.5, 3.0, size=(17, k))
        a[:, 0] += 1.5  # distinct columns: no zero denominators
        idx = rng.integers(0, len(a), size=(200, len(a)))
        want = np.array([slow(a[i]) for i in idx])
        got = fast.of_means(claims._resample_means(a, idx))
        np.testing.assert_allclose(got, want, rtol=1e-10, err_msg=fast.__doc__)
        assert fast(a) == pytest.approx(slow(a), rel=1e-12)
        one = _judge(lambda r, a=a: claims.Sample(a, fast), seed=2).estimate  # noqa: B023
        ref = _judge(lambda r, a=a: claims.Sample(a, lambda x: float(slow(x))), seed=2).estimate  # noqa: B023
        assert (one.lo, one.hi) == pytest.approx((ref.lo, ref.hi), rel=1e-10)


def test_of_means_gives_nan_where_its_statistic_divides_by_zero():
    flat = np.ones((5, 2))  # excess fraction: (R_after - 1) / (R_before - 1) with R_before = 1
    assert math.isnan(claims.excess_stat(flat))
    stats = claims.excess_stat.of_means(claims._resample_means(flat, np.zeros((3, 5), int)))
    assert np.isnan(stats).all()


def test_excess_fraction_fixed_points():
    assert claims.excess_fraction(101.0, 101.0) == 1.0
    assert claims.excess_fraction(1.0, 101.0) == 0.0
    assert claims.excess_fraction(11.0, 101.0) == pytest.approx(0.1)
    assert claims.excess_fraction(2.0, 1.0) != claims.excess_fraction(2.0, 1.0)  # NaN


def test_bootstrap_drops_non_finite_units_and_handles_none_left():
    est = _judge(lambda r: claims.Sample([1.0, float("nan"), 3.0, float("inf")])).estimate
    assert est.n == 2 and est.value == 2.0
    empty = _judge(lambda r: claims.Sample([float("nan")]))
    assert empty.estimate.n == 0 and empty.estimate.value != empty.estimate.value
    assert empty.verdict == claims.INCONCLUSIVE and "undefined" in empty.why


def test_equivalence_rule_judges_the_signed_statistic():
    x = np.random.default_rng(7).normal(0.0, 0.05, 400)
    x -= x.mean()  # centred on 0: within ±0.05; shifted by 0.05, on the edge
    assert _judge(lambda r: claims.Sample(x), "|x|<", "ppl_unchanged").verdict == claims.HOLDS
    assert _judge(lambda r: claims.Sample(x - 0.2), "|x|<", "ppl_unchanged").verdict == claims.FAILS
    assert _judge(lambda r: claims.Sample(x + 0.05), "|x|<", "ppl_unchanged").verdict == (
        claims.INCONCLUSIVE
    )
    assert "within ±0.05" in _spec(None, "|x|<", "ppl_unchanged").rule()


@pytest.mark.parametrize(
    ("lo", "hi", "op", "verdict"),
    [
        (0.6, 0.9, ">=", claims.HOLDS),
        (0.5, 0.9, ">=", claims.HOLDS),  # the edge is on the claimed side
        (0.1, 0.4, ">=", claims.FAILS),
        (0.4, 0.6, ">=", claims.INCONCLUSIVE),
        (0.5, 0.9, ">", claims.INCONCLUSIVE),
        (0.1, 0.4, "<=", claims.HOLDS),
        (0.6, 0.9, "<", claims.FAILS),
    ],
)
def test_decide_at_the_threshold(lo, hi, op, verdict):
    est = claims.Estimate((lo + hi) / 2, lo, hi, 10)
    assert claims.decide(est, op, 0.5) == verdict


def test_a_constructed_straddling_case_is_inconclusive():
    # per-unit outcomes whose rate (0.5) sits on the threshold: the exact interval must straddle it
    outcomes = [True, False] * 8
    claim = _judge(lambda r: claims.Outcomes(outcomes, [str(i) for i in range(16)]))
    assert claim.estimate.lo < SPEC.value < claim.estimate.hi
    assert claim.verdict == claims.INCONCLUSIVE
    # a constant per-unit statistic is one measurement repeated: never decided, either side
    for v in (0.9, 0.0):
        assert _judge(lambda r, v=v: claims.Sample([v] * 16)).verdict == claims.INCONCLUSIVE


def test_spec_validates_its_rule():
    with pytest.raises(KeyError, match="unknown threshold"):
        claims.Spec("x.y", "§1", "s", "t", ">=", "no_such_threshold")
    with pytest.raises(ValueError, match="op must be"):
        claims.Spec("x.y", "§1", "s", "t", "=>", "jump")
    with pytest.raises(ValueError, match="kind must be"):
        claims.Spec("x.y", "§1", "s", "t", ">=", "jump", kind="finding")
    with pytest.raises(ValueError, match="share the id"):
        claims.check_specs([SPEC, SPEC])
    with pytest.raises(ValueError, match="needs a stat"):
        claims.judge([SPEC], _Result())


def test_every_threshold_is_documented():
    for name, t in claims.THRESHOLDS.items():
        assert isinstance(t.value, float) and len(t.doc) > 20, name


def test_claim_line_names_statistic_interval_n_rule_and_control():
    spec = claims.Spec(
        "demo.moves", "§2.1", "The thing moves", "fraction moved", ">=", "moved_fraction",
        control="an unplanted twin", stat=lambda r: claims.Sample([1.0, 1.0, 0.0, 1.0, 1.0]),
        details=lambda r: "layer 11",
    )  # fmt: skip
    line = claims.judge([spec], _Result())[0].line()
    for part in (
        "[",
        "demo.moves",
        "§2.1",
        "fraction moved",
        "95% CI",
        "n = 5 prompts",
        "0.5",
        "an unplanted twin",
        "layer 11",
    ):
        assert part in line, part
    assert "distinct" not in line  # five prompts are five measurements, whatever their values


def test_not_applicable_and_counts():
    na = SPEC.not_applicable("no massive activation on this model")
    assert na.verdict == claims.NOT_APPLICABLE and na.estimate is None
    assert "no massive activation" in na.line()
    x = np.linspace(0.8, 1.0, 8)
    cs = [
        na,
        _judge(lambda r: claims.Sample(x)),
        _judge(lambda r: claims.Sample(x), kind="control"),
        _judge(lambda r: claims.Sample(np.ones(4)), kind="sanity"),  # exact: a sanity check may be
    ]
    assert cs[3].verdict == claims.HOLDS
    assert claims.counts(cs) == {
        claims.HOLDS: 1,
        claims.FAILS: 0,
        claims.INCONCLUSIVE: 0,
        claims.NOT_APPLICABLE: 1,
    }
    assert (
        claims.counts(cs, "control")[claims.HOLDS] == claims.counts(cs, "sanity")[claims.HOLDS] == 1
    )


def test_claim_round_trips_through_json():
    outcomes = claims.Outcomes([True, False, True], ["a", "b", "c"])
    for stat in (lambda r: claims.Sample([0.2, float("nan"), 0.9]), lambda r: outcomes):
        claim = _judge(stat)
        d = json.loads(json.dumps(io.to_jsonable(claim)))
        assert claims.Claim.from_dict(d) == claim
    nan_claim = _judge(lambda r: claims.Sample([float("nan")]))
    d = json.loads(json.dumps(io.to_jsonable(nan_claim)))
    assert claims.Claim.from_dict(d).verdict == claims.INCONCLUSIVE


def test_narrow_intervals_print_the_digits_that_tell_them_apart():
    est = claims.Estimate(1.0, 0.9991, 1.0004, 10)
    assert "[0.9991, 1.0004]" in est.text()


def test_clopper_pearson_matches_published_values():
    # textbook exact intervals (e.g. Clopper & Pearson 1934 tables; any statistics package)
    assert claims.clopper_pearson(3, 10) == pytest.approx((0.0667, 0.6525), abs=5e-5)
    assert claims.clopper_pearson(0, 5) == pytest.approx((0.0, 0.5218), abs=5e-5)
    assert claims.clopper_pearson(5, 5) == pytest.approx((0.4782, 1.0), abs=5e-5)
    assert claims.clopper_pearson(50, 100) == pytest.approx((0.3983, 0.6017), abs=5e-5)


def test_outcomes_are_judged_exactly_and_listed():
    labels = [f"layer {i}" for i in range(9)]
    spec = _spec(lambda r: claims.Outcomes([True] * 8 + [False], labels), unit="partner layers")
    (c,) = claims.judge([spec], _Result())
    assert c.verdict == claims.HOLDS and c.estimate.method == "clopper-pearson"
    assert c.estimate.value == pytest.approx(8 / 9) and c.estimate.unit == "partner layers"
    assert c.outcomes == {**dict.fromkeys(labels[:8], True), "layer 8": False}
    assert c.p == pytest.approx(10 / 512)  # P(Bin(9, 1/2) >= 8), by hand
    # all-or-nothing outcomes give a real interval, not [1, 1]
    (c,) = claims.judge([_spec(lambda r: claims.Outcomes([True] * 3, ["a", "b", "c"]))], _Result())
    assert c.estimate.lo < 0.3 and c.verdict == claims.INCONCLUSIVE


def test_one_repeated_measurement_is_not_decided():
    spec = _spec(lambda r: claims.Sample(np.full(40, 0.978)))
    (c,) = claims.judge([spec], _Result())
    assert c.estimate.n == 40 and c.estimate.n_eff == 1
    assert c.verdict == claims.INCONCLUSIVE and "1 distinct measurement" in c.why
    # keys say which units are the same measurement, whatever the values
    x = np.random.default_rng(0).normal(1.0, 0.01, 40)
    (c,) = claims.judge([_spec(lambda r: claims.Sample(x, keys=[1] * 40))], _Result())
    assert c.estimate.n_eff == 1 and c.verdict == claims.INCONCLUSIVE
    (c,) = claims.judge([_spec(lambda r: claims.Sample(x, keys=list(range(40))))], _Result())
    assert c.estimate.n_eff == 40 and c.verdict == claims.HOLDS


def test_sample_p_value_is_the_share_of_resamples_past_the_threshold():
    x = np.random.default_rng(2).normal(0.6, 0.3, 30)
    (c,) = claims.judge([_spec(lambda r: claims.Sample(x))], _Result(5))
    # independent: the same seeded resamples drawn by hand, and the share on the other side
    idx = np.random.default_rng(5).integers(0, len(x), size=(claims.N_BOOTSTRAP, len(x)))
    k = int((x[idx].mean(1) <= 0.5).sum())
    assert k >= claims.P_TAIL_MIN  # the share resolves this tail
    assert c.p == pytest.approx((k + 1) / (claims.N_BOOTSTRAP + 1))


def test_a_skewed_ratio_far_past_its_threshold_keeps_its_verdict_after_holm():
    # component_ablation.zero_dims_hurts: perplexity x7.93e5 [3.76e5, 1.6e6] against 2 got p = 0.0078
    # from a normal z on the raw ratio scale and became inconclusive after Holm
    rng = np.random.default_rng(0)
    d = rng.normal(math.log(7.93e5), 2.1, 32)  # per-text log perplexity ratios
    ratio = claims.of_means(np.exp)
    spec = _spec(lambda r: claims.Sample(d, ratio), thr="ppl_damage")
    (c,) = claims.judge([spec], _Result())
    assert c.verdict == claims.HOLDS and 1e5 < c.estimate.lo < c.estimate.value < c.estimate.hi
    boot = np.exp(d[np.random.default_rng(0).integers(0, 32, (2000, 32))].mean(1))
    raw_z = (c.estimate.value - 2.0) / boot.std(ddof=1)  # the old rule, by hand
    assert 0.5 * math.erfc(raw_z / math.sqrt(2)) > claims.ALPHA / 2 / 101  # Holm's first step
    logs = np.log(boot)  # the log-scale normal tail, by hand
    z = (logs.mean() - math.log(2.0)) / logs.std(ddof=1)
    assert c.p == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=1e-6) and c.p < 1e-10
    others = [claims.Claim(f"o.{i}", "", "", "", "", "", claims.HOLDS, p=1e-6) for i in range(100)]
    assert claims.holm([c, *others])[0] == claims.HOLDS


def test_placebo_layers_fail_a_claim_the_other_layers_match():
    curve = np.array([0.37, 0.21, 0.30, 0.273, 0.33, 0.35])  # the ME layer (3) inside the others
    rows = np.random.default_rng(1).normal(0.0, 0.01, (40, 1))

    def at(layer):
        return claims.Sample(rows[:, 0] + curve[layer])

    spec = _spec(
        lambda r: at(3),
        thr="relative_drop",
        placebo=lambda r: claims.placebo(at, 3, range(len(curve))),
    )
    (c,) = claims.judge([spec], _Result())
    assert c.verdict == claims.FAILS and c.p is None and "placebo" in c.why
    pl = c.placebo
    assert pl.layer == 3 and pl.values == pytest.approx(tuple(curve + rows.mean()))
    assert pl.bound == pytest.approx(np.quantile(np.delete(curve, 3), 0.9) + rows.mean())
    assert "other layers 0.21" in c.line() and not pl.beaten
    assert claims.Claim.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert claims.Claim.from_dict(json.loads(json.dumps(io.to_jsonable(c)))) == c
    curve[3] = 0.9  # now the ME layer stands out
    (c,) = claims.judge([spec], _Result())
    assert c.verdict == claims.HOLDS and c.placebo.beaten and c.p is not None


def test_a_corollary_is_shown_and_never_counted():
    x = np.random.default_rng(0).normal(0.9, 0.05, 40)
    base = _spec(lambda r: claims.Sample(x))
    cor = claims.Spec(
        "demo.y", "§0", "y", "y", ">=", "moved_fraction", stat=base.stat, implied_by="demo.x"
    )
    cs = claims.judge([base, cor], _Result())
    assert [c.verdict for c in cs] == [claims.HOLDS, claims.HOLDS]
    assert "corollary of demo.x" in cs[1].line() and cs[1].implied_by == "demo.x"
    t = claims.tally(cs)
    assert t["raw"][claims.HOLDS] == 1 and t["holm"][claims.HOLDS] == 1
    assert t["corollary"][
        claims.HOLDS
    ] == 1 and "1 corollary: 1 holds (never counted)" in claims.tally_text(t)
    assert claims.tally([c.to_dict() for c in cs]) == t


def test_units_are_resampled_together_and_too_few_are_not_decided():
    x = np.random.default_rng(0).normal(0.9, 0.05, 12)
    keys = [b % 3 for b in range(12)]  # 3 distinct measurements
    (c,) = claims.judge([_spec(lambda r: claims.Sample(x, keys=keys))], _Result())
    assert c.estimate.n == 12 and c.estimate.n_eff == 3
    assert c.verdict == claims.INCONCLUSIVE and "min_units" in c.why
    # the engine reads the run header's unit keys for a statistic of the massive token's state
    header = _Result(unit_keys=tuple(f"k{b % 6}" for b in range(12)), seed=0)
    spec = _spec(lambda r: claims.Sample(x[:6], prompts=range(6)), massive_state=True)
    (c,) = claims.judge([spec], _Result(header=header))
    assert c.estimate.n_eff == 6 and c.verdict == claims.HOLDS
    # a cluster bootstrap, by hand: every resample draws whole units
    m = claims.with_units(claims.Sample(x), _Result(header=header))
    _, stats, _, n_eff = claims._boot_stats(m, 0)
    unit_means = np.array([x[[b for b in range(12) if b % 6 == u]].mean() for u in range(6)])
    draws = np.random.default_rng(0).integers(0, 6, size=(claims.N_BOOTSTRAP, 6))
    assert n_eff == 6 and stats == pytest.approx(unit_means[draws].mean(1))


def test_a_denominator_is_resampled_with_its_units():
    rng = np.random.default_rng(4)
    num, den = rng.normal(1.0, 0.3, (30, 5)), rng.normal(4.0, 1.0, 30)
    m = claims.Nested(num, den=den)
    value, stats, n, _ = claims._boot_stats(m, 0)
    assert value == pytest.approx(num.mean() / den.mean()) and n == 30
    r = np.random.default_rng(0)  # by hand: the same draws as the engine's
    iu = r.integers(0, 30, size=(claims.N_BOOTSTRAP, 30))
    iseed = r.integers(0, 5, size=(claims.N_BOOTSTRAP, 1, 5))
    cells = num[iu[..., None], np.broadcast_to(iseed, (claims.N_BOOTSTRAP, 30, 5))]
    assert stats == pytest.approx(cells.mean((1, 2)) / den[iu].mean(1))
    assert claims.point(m) == pytest.approx(value)


def test_a_nested_measure_of_the_massive_state_resamples_whole_units():
    rng = np.random.default_rng(5)
    num, den = rng.normal(1.0, 0.3, (12, 4)), rng.normal(4.0, 1.0, 12)
    header = _Result(unit_keys=tuple(f"k{b % 3}" for b in range(12)), seed=0)
    spec = _spec(lambda r: claims.Nested(num, den=den), massive_state=True)
    (c,) = claims.judge([spec], _Result(header=header))
    assert c.estimate.n == 12 and c.estimate.n_eff == 3  # three prefixes, however many prompts
    assert c.verdict == claims.INCONCLUSIVE and "min_units" in c.why
    m = claims.with_units(claims.Nested(num, den=den), _Result(header=header))
    value, stats, _, n_eff = claims._boot_stats(m, 0)
    assert n_eff == 3 and value == pytest.approx(num.mean() / den.mean())
    r = np.random.default_rng(0)  # by hand: whole units drawn, one seed resample per replicate
    r.integers(0, 12, size=(claims.N_BOOTSTRAP, 12))
    draws = r.integers(0, 3, size=(claims.N_BOOTSTRAP, 3))
    iseed = r.integers(0, 4, size=(claims.N_BOOTSTRAP, 1, 4))
    members = [np.arange(u, 12, 3) for u in range(3)]
    rows = [np.concatenate([members[u] for u in d]) for d in draws]
    by_hand = [num[w][:, iseed[b, 0]].mean() / den[w].mean() for b, w in enumerate(rows)]
    assert stats == pytest.approx(by_hand)


def test_two_way_bootstrap_carries_unit_and_seed_variance():
    rng = np.random.default_rng(3)
    n, s = 40, 5
    a = rng.normal(0.0, 1.0, (n, 1))  # unit effects
    b = rng.normal(0.0, 0.4, (1, s))  # seed effects, shared by every unit (a random edit)
    v = 0.5 + a + b + rng.normal(0.0, 0.2, (n, s))

    def width(m):
        (c,) = claims.judge([_spec(lambda r: m, thr="removed", op="<=")], _Result())
        return c, c.estimate.hi - c.estimate.lo

    c, crossed = width(claims.Nested(v))
    # crossed two-way standard error, by hand: unit, seed and cell variance of the grand mean
    se = math.sqrt(a.var(ddof=1) / n + b.var(ddof=1) / s + 0.04 / (n * s))
    assert crossed == pytest.approx(2 * 1.96 * se, rel=0.35)
    assert c.estimate.unit == "prompts × seeds" and "crossed" in c.estimate.method
    # nested resampling treats the shared seed effect as noise within units: it averages away
    c, nested = width(claims.Nested(v, crossed=False))
    se_nested = math.sqrt(a.var(ddof=1) / n + (b.var(ddof=1) + 0.04) / (n * s))
    assert nested == pytest.approx(2 * 1.96 * se_nested, rel=0.35) and nested < crossed
    # a t interval over the 5 seed means ignores the unit variance: far narrower than either
    seed_means = v.mean(0)
    t_half = 2.776 * seed_means.std(ddof=1) / math.sqrt(s)
    assert 2 * t_half < nested


def test_holm_step_down_by_hand():
    def claim(p, verdict=claims.HOLDS, kind="claim"):
        return {"id": str(p), "kind": kind, "verdict": verdict, "p": p}

    cs = [claim(0.001), claim(0.015), claim(0.02), claim(1e-9, kind="control")]
    # m = 3 claims: 0.001 <= 0.025/3; 0.015 > 0.025/2 stops the step-down; the control is not in it
    assert claims.holm(cs) == [claims.HOLDS, claims.INCONCLUSIVE, claims.INCONCLUSIVE, claims.HOLDS]
    cs = [claim(0.001), claim(0.01), claim(0.02, claims.FAILS)]
    assert claims.holm(cs) == [claims.HOLDS, claims.HOLDS, claims.FAILS]
    t = claims.tally([*cs, claim(0.5, claims.HOLDS, "sanity")])
    assert t["raw"][claims.HOLDS] == 2 and t["sanity"][claims.HOLDS] == 1
    assert "3 claims" in claims.tally_text(t)


def test_applicability_and_not_applicable_from_the_statistic():
    def stat(r):
        raise claims.NotApplicable("no massive token")

    (c,) = claims.judge(
        [_spec(lambda r: claims.Sample([1.0, 2.0]), applies=lambda r: "why")], _Result()
    )
    assert c.verdict == claims.NOT_APPLICABLE and c.why == "why"
    (c,) = claims.judge([_spec(stat)], _Result())
    assert c.verdict == claims.NOT_APPLICABLE and c.why == "no massive token"


def test_halves_and_held_out_peaks():
    a, b = claims.halves(11, seed=4)
    assert len(a) == 6 and len(b) == 5 and not set(a) & set(b) and set(a) | set(b) == set(range(11))
    values = np.zeros((4, 5))
    values[:, 2] = 1.0
    values[3, 4] = 2.0  # prompt 3 peaks elsewhere
    o = claims.peak_outcomes(values, 2, [0, 3])
    assert list(o.outcomes) == [True, False] and o.labels == ["prompt 0", "prompt 3"]
    with pytest.raises(claims.NotApplicable):
        claims.halves(1)
