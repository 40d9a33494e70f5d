"""The claim type: bootstrap intervals against independent computations, the decision rule at its
edges, a constructed straddling case that must be inconclusive, and the JSON round trip."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from me_interp import claims, io

SPEC = claims.Spec(
    "demo.moves",
    "§2.1",
    "The thing moves",
    statistic="fraction moved",
    op=">=",
    threshold="moved_fraction",
    control="an unplanted twin",
)


def test_bootstrap_mean_matches_the_normal_interval():
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, size=400)
    est = claims.bootstrap(x, seed=0)
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x))  # independent: the CLT interval
    assert est.value == pytest.approx(x.mean())
    assert est.lo == pytest.approx(x.mean() - half, abs=0.25 * half)
    assert est.hi == pytest.approx(x.mean() + half, abs=0.25 * half)
    assert est.n == 400 and est.resamples == claims.N_BOOTSTRAP >= 1000


def test_bootstrap_is_seeded_and_resamples_rows_together():
    x = np.arange(20, dtype=float)
    assert claims.bootstrap(x, seed=3) == claims.bootstrap(x, seed=3)
    assert claims.bootstrap(x, seed=3) != claims.bootstrap(x, seed=4)
    # paired rows: the difference of columns is constant, so its interval has no width
    pairs = np.stack([x, x + 2.0], axis=1)
    est = claims.bootstrap(pairs, lambda a: float((a[:, 1] - a[:, 0]).mean()))
    assert est.value == est.lo == est.hi == pytest.approx(2.0)


def test_bootstrap_by_hand_loop_equals_vectorised_mean():
    x = np.random.default_rng(0).exponential(size=30)
    fast = claims.bootstrap(x, seed=5)
    slow = claims.bootstrap(x, lambda a: float(a.mean()), seed=5)
    assert (fast.lo, fast.hi) == pytest.approx((slow.lo, slow.hi), rel=1e-12)


def test_bootstrap_drops_non_finite_units_and_handles_none_left():
    est = claims.bootstrap([1.0, float("nan"), 3.0, float("inf")])
    assert est.n == 2 and est.value == 2.0
    empty = claims.bootstrap([float("nan")])
    assert empty.n == 0 and empty.value != empty.value
    assert claims.decide(empty, ">=", 0.0) == claims.INCONCLUSIVE


@pytest.mark.parametrize("bad", [{"n_resamples": 999}, {"level": 1.0}])
def test_bootstrap_rejects_bad_settings(bad):
    with pytest.raises(ValueError):
        claims.bootstrap([1.0, 2.0], **bad)


def test_over_seeds_needs_five_seeds():
    with pytest.raises(ValueError, match=">= 5 finite seeds"):
        claims.over_seeds([1.0, 2.0, 3.0, 4.0])
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    est = claims.over_seeds(x)
    half = 2.776 * np.std(x, ddof=1) / math.sqrt(5)  # t(0.975, 4), by hand
    assert est.unit == "seeds" and est.n == 5 and est.method == "t"
    assert (est.lo, est.hi) == pytest.approx((3.0 - half, 3.0 + half))
    assert "t interval over n = 5 seeds" in est.text()


def test_equivalence_rule_judges_the_signed_statistic():
    spec = claims.Spec("x.same", "§4", "unchanged", "ratio − 1", "|x|<", "ppl_unchanged")
    assert spec.judge(claims.Estimate(0.0, -0.01, 0.02, 9)).verdict == claims.HOLDS
    assert spec.judge(claims.Estimate(-0.2, -0.3, -0.06, 9)).verdict == claims.FAILS
    assert spec.judge(claims.Estimate(0.04, 0.01, 0.08, 9)).verdict == claims.INCONCLUSIVE
    # a statistic near 0 keeps an interval around 0 (folding |x| would push it away from 0)
    est = claims.bootstrap(np.random.default_rng(0).normal(0.0, 0.01, 40))
    assert est.lo < 0 < est.hi and spec.judge(est).verdict == claims.HOLDS
    assert "within ±0.05" in spec.rule()


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
    # per-unit outcomes whose mean (0.5) sits on the threshold: the interval must straddle it
    outcomes = [1.0, 0.0] * 8
    claim = SPEC.judge(claims.bootstrap(outcomes, unit="partner layers"))
    assert claim.estimate.lo < SPEC.value < claim.estimate.hi
    assert claim.verdict == claims.INCONCLUSIVE
    # the same mean with no spread is decided
    assert SPEC.judge(claims.bootstrap([0.5] * 16)).verdict == claims.HOLDS
    assert SPEC.judge(claims.bootstrap([0.0] * 16)).verdict == claims.FAILS


def test_spec_validates_its_rule():
    with pytest.raises(KeyError, match="unknown threshold"):
        claims.Spec("x.y", "§1", "s", "t", ">=", "no_such_threshold")
    with pytest.raises(ValueError, match="op must be"):
        claims.Spec("x.y", "§1", "s", "t", "=>", "jump")
    with pytest.raises(ValueError, match="share the id"):
        claims.check_specs([SPEC, SPEC])


def test_every_threshold_is_documented():
    for name, t in claims.THRESHOLDS.items():
        assert isinstance(t.value, float) and len(t.doc) > 20, name


def test_claim_line_names_statistic_interval_n_rule_and_control():
    claim = SPEC.judge(claims.bootstrap([1.0, 1.0, 0.0, 1.0, 1.0]), details="layer 11")
    line = claim.line()
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


def test_not_applicable_and_counts():
    na = SPEC.not_applicable("no massive activation on this model")
    assert na.verdict == claims.NOT_APPLICABLE and na.estimate is None
    assert "no massive activation" in na.line()
    sanity = claims.Spec("demo.by_construction", "§3", "s", "t", ">=", "restore", kind="sanity")
    cs = [
        na,
        SPEC.judge(claims.bootstrap([1.0] * 4)),
        sanity.judge(claims.exact(1.0, 4, "prompts")),
    ]
    assert claims.counts(cs) == {
        claims.HOLDS: 1,
        claims.FAILS: 0,
        claims.INCONCLUSIVE: 0,
        claims.NOT_APPLICABLE: 1,
    }


def test_claim_round_trips_through_json():
    claim = SPEC.judge(claims.bootstrap([0.2, float("nan"), 0.9]))
    d = json.loads(json.dumps(io.to_jsonable(claim)))
    back = claims.Claim.from_dict(d)
    assert back == claim
    nan_claim = SPEC.judge(claims.bootstrap([float("nan")]))
    d = json.loads(json.dumps(io.to_jsonable(nan_claim)))
    assert claims.Claim.from_dict(d).verdict == claims.INCONCLUSIVE


def test_null_z_against_a_hand_computation():
    x = [1.0, 2.0, 9.0, 3.0]
    others = np.array([1.0, 2.0, 3.0])
    assert claims.null_z(x, 2) == pytest.approx((9.0 - others.mean()) / others.std(ddof=1))
    assert claims.null_z([1.0, 1.0, 5.0], 2) == math.inf
    assert claims.null_z([1.0, 1.0, 1.0], 2) == 0.0
    with pytest.raises(ValueError):
        claims.null_z(x, 4)


def test_judge_seeds_needs_the_seeds_it_claims_over():
    na = SPEC.judge_seeds([0.9, 0.8, 1.0], flag="--n-random")
    assert (
        na.verdict == claims.NOT_APPLICABLE
        and "3 random seeds" in na.why
        and "--n-random" in na.why
    )
    ok = SPEC.judge_seeds([0.9, 0.8, 1.0, 0.95, 0.85], flag="--n-random")
    assert ok.verdict == claims.HOLDS and ok.estimate.method == "t"
