"""Claims and verdicts: the one type every experiment and the report use to state a result.

An experiment computes *statistics*; this module decides. A claim has an id, the paper section it
tests, its statement, the statistic it is judged on, an estimate with a confidence interval and the
number of independent units behind it, a decision rule whose threshold comes from the single table
:data:`THRESHOLDS`, the control that could have made it come out the other way, and a verdict:

* ``holds``         — the whole interval lies on the claimed side of the threshold;
* ``fails``         — the whole interval lies on the other side;
* ``inconclusive``  — the interval straddles the threshold (or the statistic is undefined);
* ``not applicable`` — the claim presupposes something this model lacks (e.g. a massive activation),
  with ``why``.

Intervals are percentile bootstraps over *per-unit statistics* (prompts, texts, partner layers),
never over forward passes: resampling costs microseconds; random controls over seeds get a Student-t
interval (a bootstrap over five seeds under-covers). The bootstrap is seeded, so a result is
reproducible. A claim of kind ``"sanity"`` reports something that holds by construction (e.g. patching
back the very cell a corruption overwrote); it is shown apart from the evidence and never counted.

Typical use inside an experiment module::

    SPECS = (claims.Spec("weight_swap.ffn_path", "§2.1, §3", "The emergence moves with ...",
                         statistic="fraction of partner layers ...", op=">=", threshold="moved_fraction",
                         control="swaps of the single parts, of attn_path and of the whole block"),)
    def verdicts(result):
        est = claims.bootstrap(result.moved_per_partner(), unit="partner layers")
        return [SPECS[0].judge(est, details="...")]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

HOLDS, FAILS, INCONCLUSIVE, NOT_APPLICABLE = "holds", "fails", "inconclusive", "not applicable"
VERDICTS = (HOLDS, FAILS, INCONCLUSIVE, NOT_APPLICABLE)
KINDS = ("claim", "sanity")
OPS = (">=", ">", "<=", "<", "|x|<")
"""``|x|<``: an equivalence claim (\"unchanged\"): the *signed* statistic lies within ``(-thr, thr)``."""
N_BOOTSTRAP = 2000
"""Bootstrap resamples per interval (the issue asks for at least 1000)."""
LEVEL = 0.95
"""Two-sided confidence level of every interval."""
MIN_SEEDS = 5
"""Fewest seeds a random control may be judged on."""


@dataclass(frozen=True)
class Threshold:
    """One decision threshold, documented where it is defined."""

    value: float
    doc: str


THRESHOLDS: dict[str, Threshold] = {
    "jump": Threshold(
        10.0,
        "ME layer: the norm ratio (the largest token norm over the mean of the other tokens' "
        "norms) of the layer output must grow at least this many times across one layer for the "
        "birth to count as sudden; also the FFN's factor on that ratio at the ME layer",
    ),
    "carried_fraction": Threshold(
        0.5,
        "after the ME layer the norm ratio must stay at least this fraction of its ME-layer value "
        "(the residual stream carries it)",
    ),
    "null_z": Threshold(
        3.0,
        "a per-layer statistic 'peaks at the ME layer' when the ME layer's value lies at least this "
        "many standard deviations (of the other layers' values) above the other layers' mean",
    ),
    "concentration_share": Threshold(
        0.9,
        "a few units carry the effect: the share of the top-3 FFN neurons (or dims) in the massive "
        "token's FFN output must reach this",
    ),
    "invariance_cos": Threshold(
        0.9,
        "directional invariance: mean cosine of the massive token's state across inputs with "
        "different first tokens",
    ),
    "invariance_gap": Threshold(
        0.2,
        "invariance beyond the baseline: the massive token's mean cosine minus the other tokens' "
        "mean cosine",
    ),
    "relative_drop": Threshold(
        0.2,
        "a quantity 'drops' (entropy, effective rank, a sink) when it falls by at least this "
        "fraction of its reference value",
    ),
    "relative_rise": Threshold(
        0.2,
        "a quantity 'appears downstream' (the sink rate) when its mean after the ME layer exceeds "
        "its maximum before by at least this fraction of the larger of the two",
    ),
    "restore": Threshold(
        0.5,
        "activation patching: a patch 'restores' the clean behaviour when the normalised metric "
        "(clean = 1, corrupt = 0) reaches this; transplant: the fraction of the sink heads' "
        "unmodified attention to p that reaches the new position",
    ),
    "removed": Threshold(
        0.1,
        "an intervention 'removes' the massive activation when the excess norm ratio (R - 1, "
        "R = the massive token's norm over the other tokens' mean norm; 1 = an ordinary token) left "
        "after it is at most this fraction of the unedited excess",
    ),
    "moved_fraction": Threshold(
        0.5,
        "weight swaps / patches: the emergence moves / is copied / leaves the ME layer for at least "
        "this fraction of the partner / target layers",
    ),
    "cross_large": Threshold(
        10.0,
        "weights x input cross: a cell C[X, Y] (the massive token's FFN output of layer X's pre-FFN "
        "norm + FFN on layer Y's input, over the other tokens' median FFN output at X) is large when "
        "it is at least this many times an ordinary FFN output (and at least 'cross_keep' x C[m, m])",
    ),
    "cross_keep": Threshold(
        0.1,
        "weights x input cross: a large cell must also keep at least this fraction of the ME "
        "layer's own value C[m, m]",
    ),
    "cross_breadth": Threshold(
        0.5,
        "weights x input cross: 'any earlier depth' when the ME layer's weights make a large cell "
        "from at least this fraction of the earlier inputs Y < m",
    ),
    "cross_share": Threshold(
        0.5,
        "weights x input cross: the share of the large cells (see 'cross_large') among "
        "pre-emergence inputs (Y <= m, the cell (m, m) left out) that lie in the ME layer's row "
        "must reach this for 'only the ME layer's weights make it'",
    ),
    "ppl_unchanged": Threshold(
        0.05,
        "perplexity is 'unchanged' when |ratio - 1| stays below this",
    ),
    "mc_unchanged": Threshold(
        0.05,
        "multiple-choice accuracy is 'unchanged' when |accuracy ratio - 1| stays below this",
    ),
    "ppl_damage": Threshold(
        2.0,
        "an edit 'hurts' the model when it multiplies perplexity by at least this",
    ),
    "sink_attention": Threshold(
        0.3,
        "a head is a sink head when its mean attention to the massive token (queries after it) "
        "reaches this",
    ),
}


def threshold(name: str) -> float:
    """The value of threshold ``name`` from :data:`THRESHOLDS` (``KeyError`` with the choices)."""
    if name not in THRESHOLDS:
        raise KeyError(f"unknown threshold {name!r}; the table has {', '.join(THRESHOLDS)}")
    return THRESHOLDS[name].value


class NotApplicable(Exception):
    """Raised by an experiment's ``run`` when its claims presuppose something the model lacks.

    The CLI and the battery turn it into "not applicable" verdicts (with this message as the why) for
    every claim the experiment states, and exit 0: on a model without a massive activation that is
    the honest answer, not an error.
    """


# ------------------------------------------------------------------------------------------
# estimates
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A statistic with its interval.

    Attributes:
        value: the point estimate on all units.
        lo, hi: the ``level`` interval (equal to ``value`` for an exact, unresampled quantity).
        n: the number of independent units (prompts, partner layers, seeds).
        unit: what one unit is.
        method: ``"bootstrap"`` (percentile, seeded), ``"t"`` (Student-t, for seeds) or ``"exact"``
            (no resampling possible).
        level: the confidence level.
        resamples: bootstrap resamples (0 for exact).
    """

    value: float
    lo: float
    hi: float
    n: int
    unit: str = "prompts"
    method: str = "bootstrap"
    level: float = LEVEL
    resamples: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Estimate:
        """Inverse of :meth:`to_dict`, also for JSON (where non-finite floats are strings)."""
        return cls(**{k: _float(v) for k, v in d.items()})

    def text(self) -> str:
        v = fmt_num(self.value)
        if self.method == "exact":
            return f"{v} (exact, n = {self.n} {self.unit})"
        how = "t interval" if self.method == "t" else "bootstrap"
        return (
            f"{v} [{fmt_num(self.lo)}, {fmt_num(self.hi)}] ({self.level:.0%} CI, {how} over "
            f"n = {self.n} {self.unit})"
        )


def fmt_num(x: float) -> str:
    """A number in three significant digits (``nan``/``inf`` spelled out)."""
    if x != x:
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


def bootstrap(
    values: Sequence[float] | np.ndarray,
    statistic: Callable[[np.ndarray], float] | None = None,
    *,
    unit: str = "prompts",
    n_resamples: int = N_BOOTSTRAP,
    seed: int = 0,
    level: float = LEVEL,
) -> Estimate:
    """Percentile bootstrap of ``statistic`` over the rows of ``values`` (one row per unit).

    Args:
        values: per-unit statistics, shape ``(n,)`` or ``(n, k)`` (rows are resampled together, so
            paired quantities stay paired).
        statistic: maps a resampled ``(n, ...)`` array to a float; ``None`` = the mean over rows
            (then ``values`` must be 1-D), computed for all resamples at once.
        unit: what a row is (reported).
        n_resamples: resamples (at least 1000).
        seed: seeds the resampling (a fixed seed makes the interval reproducible).
        level: two-sided confidence level.

    Non-finite rows are dropped first (and ``n`` counts the rest); with no finite row the estimate is
    NaN, which :func:`decide` calls inconclusive.
    """
    if n_resamples < 1000:
        raise ValueError(f"n_resamples must be >= 1000, got {n_resamples}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 0:
        raise ValueError("bootstrap needs one value per unit, got a scalar")
    finite = np.isfinite(arr).reshape(len(arr), -1).all(axis=1)
    arr = arr[finite]
    n = len(arr)
    nan = float("nan")
    if n == 0:
        return Estimate(nan, nan, nan, 0, unit, "bootstrap", level, n_resamples)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_resamples, n))
    if statistic is None:
        if arr.ndim != 1:
            raise ValueError("the default statistic (mean) needs 1-D values")
        value = float(arr.mean())
        stats = arr[idx].mean(axis=1)
    else:
        value = float(statistic(arr))
        stats = np.array([statistic(arr[i]) for i in idx], dtype=np.float64)
    stats = stats[np.isfinite(stats)]
    if len(stats) == 0:
        return Estimate(value, nan, nan, n, unit, "bootstrap", level, n_resamples)
    a = (1 - level) / 2
    lo, hi = np.quantile(stats, [a, 1 - a])
    return Estimate(value, float(lo), float(hi), n, unit, "bootstrap", level, n_resamples)


_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
"""Student-t 97.5 % quantiles for 1..30 degrees of freedom (1.96 beyond)."""


def over_seeds(values: Sequence[float], *, level: float = LEVEL) -> Estimate:
    """The Student-t interval of the mean over a random control's seeds (at least
    :data:`MIN_SEEDS`): ``mean ± t_{n-1} · sd / √n``.

    With a handful of seeds a percentile bootstrap under-covers (about 88 % for a nominal 95 % with
    5 seeds), so seeds get the t interval; only the 95 % level is tabulated.
    """
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < MIN_SEEDS:
        raise ValueError(f"a random control needs >= {MIN_SEEDS} finite seeds, got {len(x)}")
    if level != LEVEL:
        raise ValueError(f"over_seeds gives {LEVEL:.0%} intervals only")
    df = len(x) - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    half = t * float(x.std(ddof=1)) / math.sqrt(len(x))
    m = float(x.mean())
    return Estimate(m, m - half, m + half, len(x), "seeds", "t", level, 0)


def exact(value: float, n: int, unit: str) -> Estimate:
    """A quantity with no resampling unit (e.g. a rank among layers): its interval is the value."""
    v = float(value)
    return Estimate(v, v, v, int(n), unit, "exact", LEVEL, 0)


def decide(estimate: Estimate, op: str, thr: float) -> str:
    """``holds`` if the whole interval satisfies ``estimate op thr``, ``fails`` if none of it does,
    else ``inconclusive`` (also for a NaN estimate or interval). For ``op = "|x|<"`` (an equivalence
    claim) the interval of the signed statistic must lie inside ``(-thr, thr)`` to hold and wholly
    outside it to fail."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    lo, hi = estimate.lo, estimate.hi
    if any(x != x for x in (estimate.value, lo, hi)):
        return INCONCLUSIVE
    if op == "|x|<":  # equivalence: bootstrap the signed statistic, never its absolute value
        if -thr < lo and hi < thr:
            return HOLDS
        if lo >= thr or hi <= -thr:
            return FAILS
        return INCONCLUSIVE
    sat = {
        ">=": lambda x: x >= thr,
        ">": lambda x: x > thr,
        "<=": lambda x: x <= thr,
        "<": lambda x: x < thr,
    }[op]
    if sat(lo) and sat(hi):
        return HOLDS
    if not sat(lo) and not sat(hi):
        return FAILS
    return INCONCLUSIVE


# ------------------------------------------------------------------------------------------
# claims
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """One stated claim and its verdict on one model (see the module docstring)."""

    id: str
    section: str
    statement: str
    statistic: str
    rule: str
    control: str
    verdict: str
    why: str = ""
    estimate: Estimate | None = None
    threshold: float | None = None
    kind: str = "claim"
    details: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["estimate"] = None if self.estimate is None else self.estimate.to_dict()
        d["line"] = self.line()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Claim:
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        est = kw.get("estimate")
        if isinstance(est, Mapping):
            kw["estimate"] = Estimate.from_dict(est)
        return cls(**kw)

    def line(self) -> str:
        """One citable line: verdict, claim, statistic with interval and n, rule, control."""
        head = f"[{self.verdict}] {self.id} ({self.section}): {self.statement}"
        if self.verdict == NOT_APPLICABLE:
            return f"{head} — {self.why}"
        parts = [head, f"{self.statistic} = {self.estimate.text() if self.estimate else 'n/a'}"]
        parts.append(f"rule: {self.rule}")
        if self.control:
            parts.append(f"control: {self.control}")
        if self.details:
            parts.append(self.details)
        if self.why:
            parts.append(self.why)
        return " — ".join(parts)


def _float(v: Any) -> Any:
    return float(v) if v in ("nan", "inf", "-inf") else v


@dataclass(frozen=True)
class Spec:
    """What an experiment claims, before it is measured: judged by :meth:`judge`.

    Attributes:
        id: ``"<experiment>.<short name>"``, unique.
        section: the paper section (``paper.md``) or prior work the claim comes from.
        statement: the claim, in one sentence.
        statistic: what is measured, in words.
        op: the comparison the claim asserts: ``statistic op threshold``.
        threshold: a key of :data:`THRESHOLDS`.
        control: the condition that could have made the claim come out the other way.
        kind: ``"claim"`` (evidence) or ``"sanity"`` (true by construction; never counted).
    """

    id: str
    section: str
    statement: str
    statistic: str
    op: str
    threshold: str
    control: str = ""
    kind: str = "claim"

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"{self.id}: op must be one of {OPS}, got {self.op!r}")
        threshold(self.threshold)  # must exist
        if self.kind not in KINDS:
            raise ValueError(f"{self.id}: kind must be one of {KINDS}")

    @property
    def value(self) -> float:
        """The threshold the rule compares with (from :data:`THRESHOLDS`)."""
        return threshold(self.threshold)

    def rule(self, thr: float | None = None) -> str:
        thr = self.value if thr is None else thr
        if self.op == "|x|<":
            return (
                f"holds if the whole {LEVEL:.0%} interval lies within ±{thr:g} (threshold "
                f"'{self.threshold}'), fails if it lies wholly outside, else inconclusive"
            )
        return (
            f"holds if the whole {LEVEL:.0%} interval is {self.op} {thr:g} "
            f"(threshold '{self.threshold}'), fails if none of it is, else inconclusive"
        )

    def judge(
        self,
        estimate: Estimate,
        *,
        details: str = "",
        control: str | None = None,
        thr: float | None = None,
    ) -> Claim:
        """The claim with its verdict for ``estimate`` (``thr`` overrides the table for a threshold
        that is relative to a measured reference, e.g. a fraction of the baseline)."""
        t = self.value if thr is None else float(thr)
        verdict = decide(estimate, self.op, t)
        why = "the statistic is undefined" if estimate.value != estimate.value else ""
        return Claim(
            self.id,
            self.section,
            self.statement,
            self.statistic,
            self.rule(t),
            self.control if control is None else control,
            verdict,
            why,
            estimate,
            t,
            self.kind,
            details,
        )

    def judge_seeds(self, values: Sequence[float], *, flag: str, details: str = "") -> Claim:
        """The claim judged on a random control's per-seed values (:func:`over_seeds`), or not
        applicable when this run measured fewer than :data:`MIN_SEEDS` seeds (``flag`` names the
        option that sets the number of seeds)."""
        n = sum(1 for v in values if math.isfinite(v))
        if n < MIN_SEEDS:
            return self.not_applicable(
                f"not measured in this run: {n} random seeds, the control needs at least "
                f"{MIN_SEEDS} ({flag})"
            )
        return self.judge(over_seeds(values), details=details)

    def not_applicable(self, why: str) -> Claim:
        """The claim marked not applicable on this model, with ``why``."""
        return Claim(
            self.id,
            self.section,
            self.statement,
            self.statistic,
            self.rule(),
            self.control,
            NOT_APPLICABLE,
            why,
            None,
            self.value,
            self.kind,
        )


def not_applicable(specs: Iterable[Spec], why: str) -> list[Claim]:
    """Every claim of ``specs`` marked not applicable with the same ``why``."""
    return [s.not_applicable(why) for s in specs]


def counts(claims: Iterable[Claim | Mapping[str, Any]]) -> dict[str, int]:
    """How many claims (kind ``claim`` only) hold / fail / are inconclusive / not applicable."""
    out = dict.fromkeys(VERDICTS, 0)
    for c in claims:
        kind = c.kind if isinstance(c, Claim) else c.get("kind", "claim")
        verdict = c.verdict if isinstance(c, Claim) else c["verdict"]
        if kind == "claim":
            out[verdict] += 1
    return out


def check_specs(specs: Iterable[Spec]) -> None:
    """Raise ``ValueError`` if two specs share an id."""
    seen: set[str] = set()
    for s in specs:
        if s.id in seen:
            raise ValueError(f"two claims share the id {s.id!r}")
        seen.add(s.id)


def index(specs: Sequence[Spec]) -> dict[str, Spec]:
    """``{short name: spec}`` for an experiment's specs (the id after ``"<experiment>."``), after
    :func:`check_specs`."""
    check_specs(specs)
    return {s.id.split(".", 1)[1]: s for s in specs}


def null_z(values: Sequence[float] | np.ndarray, layer: int) -> float:
    """How far the value at ``layer`` lies above the other layers': ``(x_L - mean_{l≠L} x_l) /
    std_{l≠L} x_l`` (``inf`` when the others are constant and ``x_L`` above them).

    Used to judge "peaks at the ME layer" against the null of every other layer, so that a statistic
    the detection rule nearly implies still has to stand out from the rest of the model.
    """
    x = np.asarray(values, dtype=np.float64)
    if not 0 <= layer < len(x):
        raise ValueError(f"layer {layer} out of range for {len(x)} values")
    others = np.delete(x, layer)
    others = others[np.isfinite(others)]
    if len(others) < 2 or not np.isfinite(x[layer]):
        return float("nan")
    sd = others.std(ddof=1)
    gap = x[layer] - others.mean()
    if sd == 0:
        return float("inf") if gap > 0 else (0.0 if gap == 0 else float("-inf"))
    return float(gap / sd)
