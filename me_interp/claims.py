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

Every claim is a :class:`Spec`, a *declaration*: its statistic as a function of the experiment's
typed result, returning a measurement (:class:`Sample`: per-unit values for a percentile bootstrap;
:class:`Nested`: units × seeds for a two-way bootstrap, for random controls; :class:`Outcomes`: k of
n yes/no outcomes for an exact Clopper–Pearson interval, each listed), its resampling unit, its
comparison (``op`` and a threshold of :data:`THRESHOLDS`), when it applies, and its kind (``claim``,
``control`` or ``sanity``, :data:`KINDS`). One engine, :func:`judge`, turns specs and a result into
claims; no experiment computes a verdict. The engine also counts the *effective n* (the distinct
measurements: a shared-BOS first token at layer 0 is one measurement however many prompts repeat
it) and leaves a claim or control undecided when it rests on fewer than two, or on a zero-width
bootstrap interval. Resampling is over per-unit statistics, never forward passes, and seeded, so a
result is reproducible. :func:`holm` adjusts the verdicts of a whole battery for multiplicity, and
:func:`tally` gives the raw and adjusted counts with controls and sanity checks apart. The
statistics several experiments share live here too: :func:`excess_fraction` / :func:`excess_stat`
(the share ``(R_after − 1) / (R_before − 1)`` of the massive token's norm-ratio excess an edit
leaves, the removal statistic), :func:`halves` and :func:`peak_outcomes` (held-out layer choice).

Typical use inside an experiment module::

    SPECS = (
        claims.Spec(
            "weight_swap.ffn_path", "§2.1, §3", "The emergence moves with ...",
            statistic="fraction of partner layers ...", op=">=", threshold="moved_fraction",
            control="swaps of the single parts, of attn_path and of the whole block",
            stat=lambda r: claims.Outcomes(r.moved("ffn_path"), r.partner_labels()),
            unit="partner layers",
        ),
    )
    # common.execute: claims.judge(module.SPECS, result)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

HOLDS, FAILS, INCONCLUSIVE, NOT_APPLICABLE = "holds", "fails", "inconclusive", "not applicable"
VERDICTS = (HOLDS, FAILS, INCONCLUSIVE, NOT_APPLICABLE)
KINDS = ("claim", "control", "sanity")
"""``claim``: evidence, counted; ``control``: a comparison that must come out as designed for the
claims beside it to mean anything (e.g. random neurons keep the activation), shown apart and never
counted; ``sanity``: true by construction, shown apart and never counted."""
KIND_LABEL = {"claim": "", "control": "control", "sanity": "sanity check"}
"""How a claim's kind is marked beside its verdict (controls and sanity checks are never counted)."""
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
    "peak_fraction": Threshold(
        0.5,
        "a per-layer statistic 'peaks at the ME layer' when, on held-out prompts (the ME layer "
        "chosen on the other half), the ME layer is the statistic's largest layer on at least this "
        "fraction of them (Clopper-Pearson interval; under the null of exchangeable layers the "
        "chance is 1 / L)",
    ),
    "concentration_share": Threshold(
        0.9,
        "a few units carry the effect: the share of the top-3 FFN neurons (or dims) in the massive "
        "token's FFN output must reach this (mechanism.few_neurons: the held-out share of the "
        "neurons chosen on the other half, minus the share of 3 random neurons)",
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
        "a quantity 'appears downstream' (the attention to the massive token) when its mean after "
        "the ME layer exceeds "
        "its maximum before by at least this fraction of the larger of the two",
    ),
    "restore": Threshold(
        0.5,
        "activation patching: a patch 'restores' the clean behaviour when the normalised metric "
        "(clean = 1, corrupt = 0) reaches this; transplant: the fraction of the sink heads' "
        "unmodified attention to p that reaches the new position",
    ),
    "head_excess": Threshold(
        0.25,
        "activation patching per head: the heads chosen by their attention to the massive token "
        "carry its effect when, patched together, they restore at least this much more of the "
        "clean output (normalised, clean = 1, corrupt = 0) than as many random heads of the same "
        "layers",
    ),
    "removed": Threshold(
        0.1,
        "an intervention 'removes' the massive activation when the excess norm ratio (R - 1, "
        "R = the massive token's norm over the other tokens' mean (or median, where a claim says "
        "so) norm; 1 = an ordinary token) left after it is at most this fraction of the unedited "
        "excess",
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
    "super_weight_spike": Threshold(
        50.0,
        "super weights (Yu et al. 2024): a down_proj input or output value at the massive token is "
        "a spike when |value| exceeds this (the spike_threshold of their released "
        "plot_down_proj_input_output); a W_down weight is a super-weight candidate when its write "
        "into the residual stream there, |x_c W_down[r, c]| (times the post-FFN norm's gain over "
        "its rms on sandwich blocks), reaches it and makes that dim of the stream larger",
    ),
    "ffn_state_cos": Threshold(
        0.99,
        "the ME layer's FFN output *is* the massive token's state when their mean cosine over the "
        "prompts exceeds this and its norm is within ffn_state_norm of the state's: patching the FFN "
        "output back is then patching the state back (activation_patching.ffn_is_state, a sanity "
        "check, replaces ffn_writes; sink_causality.remove_ffn is then judged as remove_all)",
    ),
    "ffn_state_norm": Threshold(
        0.05,
        "the largest |‖FFN output‖ / ‖state‖ − 1| (mean over prompts) at which the ME layer's FFN "
        "output counts as the state itself (with ffn_state_cos)",
    ),
    "super_weight_layer": Threshold(
        0.5,
        "super weights: 'the super weight is in the ME layer' when the top candidate of at least "
        "this fraction of the distinct massive-token prefixes lies in the ME layer "
        "(Clopper-Pearson interval; under exchangeable layers the chance is 1 / n_layers)",
    ),
    "first_token": Threshold(
        0.75,
        "'the massive token is the first token' when at least this fraction of the distinct "
        "massive-token prefixes has its massive positions exactly at the first token "
        "(Clopper-Pearson interval)",
    ),
}


def threshold(name: str) -> float:
    """The value of threshold ``name`` from :data:`THRESHOLDS` (``KeyError`` with the choices)."""
    if name not in THRESHOLDS:
        raise KeyError(f"unknown threshold {name!r}; the table has {', '.join(THRESHOLDS)}")
    return THRESHOLDS[name].value


class NotApplicable(Exception):
    """Raised by an experiment's ``run`` when its claims presuppose something the model lacks, or by
    a spec's ``stat`` when that one claim does.

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
        method: ``"bootstrap"`` (percentile, seeded, over units), ``"two-way bootstrap (crossed)"`` /
            ``"two-way bootstrap (nested)"`` (units × seeds) or ``"clopper-pearson"`` (k of n).
        level: the confidence level.
        resamples: bootstrap resamples (0 for exact).
        n_eff: the effective n, the number of *distinct* measurements among the units (``None``:
            not counted); a verdict is not decided on fewer than two.
    """

    value: float
    lo: float
    hi: float
    n: int
    unit: str = "prompts"
    method: str = "bootstrap"
    level: float = LEVEL
    resamples: int = 0
    n_eff: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Estimate:
        """Inverse of :meth:`to_dict`, also for JSON (where non-finite floats are strings)."""
        return cls(**{k: _float(v) for k, v in d.items()})

    def text(self) -> str:
        v = fmt_num(self.value)
        lo, hi = fmt_num(self.lo), fmt_num(self.hi)
        for digits in (4, 5, 6):  # a narrow interval that rounds to [v, v] gets the digits it needs
            if self.lo == self.hi or len({lo, v, hi}) == 3:
                break
            v, lo, hi = (fmt_num(x, digits) for x in (self.value, self.lo, self.hi))
        how = self.method
        n = f"n = {self.n} {unit_text(self.n, self.unit)}"
        if self.n_eff is not None and self.n_eff != self.n:
            n += f", {self.n_eff} distinct"
        return f"{v} [{lo}, {hi}] ({self.level:.0%} CI, {how} over {n})"


def unit_text(n: int, unit: str) -> str:
    """``unit`` (a plural noun such as ``"partner layers"``) in the singular when ``n`` is 1."""
    if n == 1 and "×" not in unit and unit.endswith("s") and not unit.endswith("ss"):
        return unit[:-1]
    return unit


def fmt_num(x: float, digits: int = 3) -> str:
    """A number in ``digits`` significant digits (``nan``/``inf`` spelled out)."""
    if x != x:
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


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
    p: float | None = None
    outcomes: dict[str, bool] | None = None

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
        if self.outcomes:
            parts.append(
                "per unit: "
                + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in self.outcomes.items())
            )
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
        kind: ``"claim"`` (evidence), ``"control"`` or ``"sanity"`` (see :data:`KINDS`; the last
            two are shown apart and never counted).
        stat: the statistic as a function of the experiment's typed result, returning a
            :class:`Sample`, :class:`Nested` or :class:`Outcomes` (it may raise
            :class:`NotApplicable`); judged by :func:`judge`.
        unit: the resampling unit (what one row / outcome is), unless the measurement names its own.
        applies: ``result -> None`` when the claim applies, else the reason it does not.
        details: ``result -> str``, context printed with the verdict (where, what else was seen).
        thr: ``result -> float`` for a threshold relative to a measured reference (else the table's).
    """

    id: str
    section: str
    statement: str
    statistic: str
    op: str
    threshold: str
    control: str = ""
    kind: str = "claim"
    stat: Callable[[Any], Measure] | None = None
    unit: str = "prompts"
    applies: Callable[[Any], str | None] | None = None
    details: Callable[[Any], str] | None = None
    thr: Callable[[Any], float] | None = None

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

    def evaluate(self, result: Any, seed: int = 0) -> Claim:
        """This spec's claim on ``result`` (see :func:`judge`, which is how experiments call it)."""
        if self.stat is None:
            raise ValueError(f"{self.id}: a spec judged by the engine needs a stat")
        why = self.applies(result) if self.applies is not None else None
        if why:
            return self.not_applicable(why)
        try:
            m = self.stat(result)
            t = self.value if self.thr is None else float(self.thr(result))
        except NotApplicable as e:
            return self.not_applicable(str(e))
        est, p_hold, p_fail, outcomes = measure_estimate(m, self.unit, self.op, t, seed)
        verdict = decide(est, self.op, t)
        notes = []
        if est.value != est.value:
            notes.append("the statistic is undefined")
        if verdict in (HOLDS, FAILS) and self.kind != "sanity":  # a sanity check may be exact
            if est.n_eff is not None and est.n_eff < 2:
                notes.append(
                    f"not decided: the {est.n} {est.unit} give {est.n_eff} distinct measurement "
                    f"(one measurement repeated), so the interval says nothing about variation"
                )
                verdict = INCONCLUSIVE
            elif est.method != "clopper-pearson" and est.lo == est.hi:
                notes.append("not decided: the bootstrap interval has zero width")
                verdict = INCONCLUSIVE
        p = p_hold if verdict == HOLDS else p_fail if verdict == FAILS else min(p_hold, p_fail)
        details = self.details(result) if self.details is not None else ""
        return Claim(
            self.id,
            self.section,
            self.statement,
            self.statistic,
            self.rule(t),
            self.control,
            verdict,
            "; ".join(notes),
            est,
            t,
            self.kind,
            details,
            None if p != p else float(p),
            outcomes,
        )

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


# ------------------------------------------------------------------------------------------
# the engine: measurements, declarative specs, one judge
# ------------------------------------------------------------------------------------------

ALPHA = 1 - LEVEL
"""Family-wise error rate of the Holm adjustment (two-sided, as the intervals)."""
DISTINCT_RTOL = 1e-6
"""Two units whose statistics agree to this relative tolerance are one measurement (effective n)."""


@dataclass(frozen=True)
class Sample:
    """Per-unit values for a (percentile) bootstrap over units.

    Attributes:
        values: one row per unit, shape ``(n,)`` or ``(n, k)`` (rows resampled together).
        statistic: maps a resampled array to a float (:func:`of_means` for a function of its
            column means, which the bootstrap computes for all resamples at once); ``None`` = the
            mean (1-D values only).
        unit: what a row is (``None``: the spec's ``unit``).
        keys: what makes two units *distinct measurements* (e.g. the first token id when the
            statistic depends on token 0 only); ``None`` = distinct rows of ``values``.
    """

    values: Any
    statistic: Callable[[np.ndarray], float] | None = None
    unit: str | None = None
    keys: Sequence[Any] | None = None


def of_means(f: Callable[[np.ndarray], Any]) -> Callable[[np.ndarray], float]:
    """A :class:`Sample` statistic that depends on the rows only through their column means.

    ``f`` maps column means ``[..., k]`` (or ``[...]`` for 1-D values) to the statistic ``[...]``,
    vectorised over the leading axes. The statistic of rows ``a`` is ``f(a.mean(0))``; the bootstrap
    gets the means of all its resamples at once (their counts times the rows, one matrix product)
    and calls ``f`` once, instead of the statistic once per resample. A ratio of column sums is a
    ratio of column means."""

    def statistic(a: np.ndarray) -> float:
        return float(f(np.asarray(a, dtype=np.float64).mean(0)))

    statistic.of_means = f  # type: ignore[attr-defined]
    statistic.__doc__ = f.__doc__
    return statistic


def divide(num: Any, den: Any, ok: Any = None, fill: float = float("nan")) -> np.ndarray:
    """``num / den`` where ``ok`` (default: ``den != 0``), else ``fill``; elementwise, without a
    division warning (the statistics of :func:`of_means` are vectorised over resamples, so one
    resample's zero base must not stop the others)."""
    ok = np.asarray(den) != 0 if ok is None else ok
    return np.where(ok, num / np.where(ok, den, 1.0), fill)


def _resample_means(arr: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Column means ``[boot, ...]`` of the resamples ``arr[idx[b]]`` (``idx [boot, n]``): each
    resample's counts of the ``n`` rows times the rows, divided by ``n``."""
    boot, n = idx.shape
    counts = np.bincount((idx + n * np.arange(boot)[:, None]).ravel(), minlength=boot * n)
    flat = arr.reshape(n, -1)
    return (counts.reshape(boot, n) @ flat / n).reshape(boot, *arr.shape[1:])


@dataclass(frozen=True)
class Nested:
    """A random control measured on units × seeds: a two-way bootstrap that resamples the units
    (prompts, texts) and the seeds, so the interval carries both the data's and the draw's variance
    (a t interval over seeds ignores which texts were drawn).

    Attributes:
        values: shape ``(n_units, n_seeds)``; the statistic is the mean over all cells unless
            ``statistic`` (on a resampled ``(n_units, n_seeds)`` array) is given.
        crossed: ``True`` (the default) when a seed's draw is shared by every unit (a random edit of
            the model, a random dim set applied to every text): one resample of the seeds per
            replicate, for all units. ``False`` when each unit draws its own seeds (nested): the seeds
            are resampled within each unit.
    """

    values: Any
    statistic: Callable[[np.ndarray], float] | None = None
    unit: str | None = None
    inner: str = "seeds"
    crossed: bool = True


@dataclass(frozen=True)
class Outcomes:
    """k-of-n yes/no outcomes, one per unit (partner layers, held-out prompts): the estimate is
    k / n with an exact Clopper–Pearson interval, and every unit's outcome is listed in the claim.

    Attributes:
        outcomes: one bool per unit.
        labels: one label per unit (e.g. ``"partner 3 (depth -8)"``).
        unit: what a unit is (``None``: the spec's ``unit``).
    """

    outcomes: Sequence[bool]
    labels: Sequence[str]
    unit: str | None = None

    def __post_init__(self) -> None:
        if len(self.outcomes) != len(self.labels):
            raise ValueError(f"{len(self.outcomes)} outcomes but {len(self.labels)} labels")


Measure = Sample | Nested | Outcomes


def _distinct(arr: np.ndarray) -> int:
    """How many rows of ``arr`` differ beyond :data:`DISTINCT_RTOL` of the largest |value|."""
    if len(arr) == 0:
        return 0
    flat = arr.reshape(len(arr), -1)
    scale = float(np.max(np.abs(flat))) or 1.0
    q = np.round(flat / (scale * DISTINCT_RTOL))
    return len(np.unique(q, axis=0))


def _norm_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k), X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0 or p >= 1.0:
        return 1.0 if p <= 0.0 else 0.0
    lp, lq, lg = math.log(p), math.log1p(-p), math.lgamma
    return min(
        1.0,
        sum(
            math.exp(lg(n + 1) - lg(i + 1) - lg(n - i + 1) + i * lp + (n - i) * lq)
            for i in range(k + 1)
        ),
    )  # log space: exact enough, and no overflow for large n


@functools.lru_cache(maxsize=4096)
def clopper_pearson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """The exact (Clopper–Pearson) two-sided interval of a binomial rate with ``k`` of ``n``
    (cached: a battery asks for the same few ``(k, n)`` many times, each a 120-step bisection)."""
    if n <= 0:
        return float("nan"), float("nan")
    a = (1 - level) / 2

    def solve(f: Callable[[float], float]) -> float:  # f increasing in p, root by bisection
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: (1 - _binom_cdf(k - 1, n, p)) - a)
    upper = 1.0 if k == n else solve(lambda p: a - _binom_cdf(k, n, p))
    return lower, upper


def _boot_stats(m: Sample | Nested, seed: int) -> tuple[float, np.ndarray, int, int]:
    """(point value, bootstrap statistics, n units, effective n) of a sample or nested measure."""
    arr = np.asarray(m.values, dtype=np.float64)
    if arr.ndim == 0:
        raise ValueError("a measurement needs one value per unit, got a scalar")
    rng = np.random.default_rng(seed)
    if isinstance(m, Nested):
        if arr.ndim != 2:
            raise ValueError(f"Nested values must be (units, seeds), got shape {arr.shape}")
        arr = arr[np.isfinite(arr).all(axis=1)]
        n, s = arr.shape
        if n == 0 or s == 0:
            return float("nan"), np.array([]), 0, 0
        stat = m.statistic or (lambda a: float(a.mean()))
        iu = rng.integers(0, n, size=(N_BOOTSTRAP, n))
        if m.crossed:  # one seed resample per replicate, shared by its units
            iseed = np.broadcast_to(
                rng.integers(0, s, size=(N_BOOTSTRAP, 1, s)), (N_BOOTSTRAP, n, s)
            )
        else:
            iseed = rng.integers(0, s, size=(N_BOOTSTRAP, n, s))
        res = arr[iu[..., None], iseed]  # [boot unit seed]
        if m.statistic is None:
            stats = res.mean(axis=(1, 2))
        else:
            stats = np.array([stat(r) for r in res])
        return float(stat(arr)), stats, n, _distinct(arr.mean(1))
    finite = np.isfinite(arr).reshape(len(arr), -1).all(axis=1)
    keys = None if m.keys is None else [k for k, f in zip(m.keys, finite, strict=True) if f]
    arr = arr[finite]
    n = len(arr)
    if n == 0:
        return float("nan"), np.array([]), 0, 0
    idx = rng.integers(0, n, size=(N_BOOTSTRAP, n))
    if m.statistic is None:
        if arr.ndim != 1:
            raise ValueError("the default statistic (mean) needs 1-D values")
        value, stats = float(arr.mean()), arr[idx].mean(axis=1)
    else:
        value = float(m.statistic(arr))
        f = getattr(m.statistic, "of_means", None)
        if f is not None:  # one vectorised call for every resample
            with np.errstate(divide="ignore", invalid="ignore"):
                stats = np.asarray(f(_resample_means(arr, idx)), dtype=np.float64)
        else:
            stats = np.array([m.statistic(arr[i]) for i in idx], dtype=np.float64)
    n_eff = len(set(keys)) if keys is not None else _distinct(arr)
    return value, stats, n, n_eff


def _p_values(value: float, se: float, op: str, thr: float) -> tuple[float, float]:
    """One-sided p-values (normal approximation with the bootstrap standard error) of "holds" and
    of "fails": the chance of a statistic this far on the claimed (failed) side if the truth were at
    the threshold. Holm adjusts these; the verdicts themselves come from the intervals."""
    if not (math.isfinite(value) and math.isfinite(se)):
        return float("nan"), float("nan")
    if se == 0:
        sat = decide(Estimate(value, value, value, 1), op, thr)
        return (0.0, 1.0) if sat == HOLDS else (1.0, 0.0)
    if op == "|x|<":  # two one-sided tests for "inside", the nearer side for "outside"
        p_hold = max(_norm_sf((value + thr) / se), _norm_sf((thr - value) / se))
        p_fail = min(_norm_sf((value - thr) / se), _norm_sf((-thr - value) / se))
        return p_hold, p_fail
    up = op in (">=", ">")
    z = (value - thr) / se if up else (thr - value) / se
    return _norm_sf(z), _norm_sf(-z)


def _binom_p(k: int, n: int, op: str, thr: float) -> tuple[float, float]:
    """Exact one-sided binomial p-values of "holds" and "fails" for a rate compared with ``thr``."""
    ge = 1 - _binom_cdf(k - 1, n, thr)  # P(X >= k)
    le = _binom_cdf(k, n, thr)  # P(X <= k)
    if op in (">=", ">"):
        return ge, le
    if op in ("<=", "<"):
        return le, ge
    raise ValueError(f"k-of-n outcomes take >=, >, <= or <, not {op!r}")


def measure_estimate(
    m: Measure, unit: str, op: str, thr: float, seed: int = 0
) -> tuple[Estimate, float, float, dict[str, bool] | None]:
    """The estimate of a measurement, its one-sided p-values (holds, fails) and, for k-of-n
    outcomes, each unit's outcome."""
    unit = m.unit or unit
    if isinstance(m, Outcomes):
        o = [bool(x) for x in m.outcomes]
        n, k = len(o), sum(o)
        if n == 0:
            nan = float("nan")
            return Estimate(nan, nan, nan, 0, unit, "clopper-pearson", LEVEL, 0, 0), nan, nan, {}
        lo, hi = clopper_pearson(k, n)
        est = Estimate(k / n, lo, hi, n, unit, "clopper-pearson", LEVEL, 0, n)
        p_hold, p_fail = _binom_p(k, n, op, thr)
        return est, p_hold, p_fail, dict(zip(m.labels, o, strict=True))
    value, stats, n, n_eff = _boot_stats(m, seed)
    method = "bootstrap"
    if isinstance(m, Nested):
        method = "two-way bootstrap (crossed)" if m.crossed else "two-way bootstrap (nested)"
    if isinstance(m, Nested):
        unit = f"{unit} × {m.inner}"
    nan = float("nan")
    stats = stats[np.isfinite(stats)]
    if n == 0 or len(stats) == 0:
        return Estimate(value, nan, nan, n, unit, method, LEVEL, N_BOOTSTRAP, n_eff), nan, nan, None
    a = (1 - LEVEL) / 2
    lo, hi = (float(x) for x in np.quantile(stats, [a, 1 - a]))
    est = Estimate(value, lo, hi, n, unit, method, LEVEL, N_BOOTSTRAP, n_eff)
    p_hold, p_fail = _p_values(value, float(stats.std(ddof=1)) if len(stats) > 1 else 0.0, op, thr)
    return est, p_hold, p_fail, None


def judge(specs: Iterable[Spec], result: Any, *, seed: int | None = None) -> list[Claim]:
    """Every spec of ``specs`` judged on ``result``: the one place a verdict is computed.

    For each spec: not applicable when ``spec.applies(result)`` gives a reason (or ``spec.stat``
    raises :class:`NotApplicable`); else the measurement ``spec.stat(result)`` is resampled by its
    kind (bootstrap over units, two-way bootstrap over units × seeds, Clopper–Pearson for k of
    n), decided against the threshold, and *not decided* (inconclusive, saying why) when it rests on
    fewer than two distinct measurements or, for a bootstrap, on a zero-width interval. ``seed``
    defaults to ``result.header.seed`` (``result.seed`` without a header; 0 without either).
    """
    specs = tuple(specs)
    check_specs(specs)
    if seed is None:  # the run header's seed (a Result's first field), else the result's own
        seed = int(getattr(getattr(result, "header", result), "seed", 0) or 0)
    return [s.evaluate(result, seed) for s in specs]


def too_few_seeds(n: int, flag: str) -> str | None:
    """Why a random control measured on ``n`` seeds is not applicable (fewer than
    :data:`MIN_SEEDS`; ``flag`` names the option that sets the number), else ``None``."""
    if n >= MIN_SEEDS:
        return None
    return (
        f"not measured in this run: {n} random seeds, the control needs at least {MIN_SEEDS} "
        f"({flag})"
    )


def halves(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split of ``n`` units into a selection half and a held-out half (sizes ``⌈n/2⌉``,
    ``⌊n/2⌋``): what is chosen on the first (a layer, neurons) is tested on the second, so a
    selection never scores itself."""
    if n < 2:
        raise NotApplicable(f"a held-out test needs at least 2 units, got {n}")
    perm = np.random.default_rng(seed).permutation(n)
    k = (n + 1) // 2
    return np.sort(perm[:k]), np.sort(perm[k:])


def peak_outcomes(values: Any, layer: int, units: Sequence[int] | np.ndarray) -> Outcomes:
    """Per held-out unit (prompt), whether ``layer`` is where ``values[unit]`` (one value per layer)
    peaks: the outcomes of a permutation null under which each layer is the peak with chance 1 / L.
    ``layer`` must have been chosen on *other* units (:func:`halves`). Units whose values are all
    NaN are left out."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2:
        raise ValueError(f"values must be (units, layers), got shape {v.shape}")
    if not 0 <= layer < v.shape[1]:
        raise ValueError(f"layer {layer} out of range for {v.shape[1]} layers")
    out, labels = [], []
    for u in units:
        row = v[int(u)]
        if not np.isfinite(row).any():
            continue
        out.append(int(np.nanargmax(np.where(np.isfinite(row), row, -np.inf))) == layer)
        labels.append(f"prompt {int(u)}")
    return Outcomes(out, labels, unit="held-out prompts")


def excess_fraction(after: float, before: float) -> float:
    """``(R_after − 1) / (R_before − 1)`` for norm ratios ``R = ‖h_p‖ / mean_{t≠p}‖h_t‖``.

    An ordinary token has ``R ≈ 1``, so this is the share of the massive token's *excess* that an
    intervention leaves: 1 = untouched, 0 = the token is as ordinary as the others (a plain
    ``R_after / R_before`` never goes below ``1 / R_before``). NaN when ``R_before = 1``.
    """
    return float(excess_stat.of_means(np.array([after, before], dtype=np.float64)))


@of_means
def excess_stat(m: np.ndarray) -> np.ndarray | float:
    """Per-prompt columns ``[after, before]`` → :func:`excess_fraction` of their prompt means ``m``
    (the statistic the claims bootstrap over prompts; vectorised over leading axes)."""
    return divide(m[..., 0] - 1.0, m[..., 1] - 1.0)


def holm(claims: Sequence[Claim | Mapping[str, Any]], alpha: float = ALPHA) -> list[str]:
    """Holm-adjusted verdicts (one per claim, in order) over the family of claims of kind
    ``claim`` with a p-value: a decided verdict stays decided when its one-sided p-value passes
    Holm's step-down at ``alpha / 2`` (the one-sided level of the 95 % intervals), else it becomes
    inconclusive. Controls, sanity checks and not-applicable claims keep their verdict and are not
    in the family."""

    rows = [
        (c.verdict, c.kind, c.p)
        if isinstance(c, Claim)
        else (c.get("verdict"), c.get("kind"), c.get("p"))
        for c in claims
    ]
    out = [verdict for verdict, _, _ in rows]
    fam = [
        (float(p), i)
        for i, (_, kind, p) in enumerate(rows)
        if kind == "claim" and p is not None and math.isfinite(float(p))
    ]
    fam.sort()
    m = len(fam)
    passed = True
    for j, (p, i) in enumerate(fam):
        passed = passed and p <= (alpha / 2) / (m - j)
        if not passed and out[i] in (HOLDS, FAILS):
            out[i] = INCONCLUSIVE
    return out


def not_applicable(specs: Iterable[Spec], why: str) -> list[Claim]:
    """Every claim of ``specs`` marked not applicable with the same ``why``."""
    return [s.not_applicable(why) for s in specs]


def counts(claims: Iterable[Claim | Mapping[str, Any]], kind: str = "claim") -> dict[str, int]:
    """How many claims of ``kind`` (default: evidence only) hold / fail / are inconclusive / not
    applicable."""
    out = dict.fromkeys(VERDICTS, 0)
    for c in claims:
        k = c.kind if isinstance(c, Claim) else c.get("kind", "claim")
        verdict = c.verdict if isinstance(c, Claim) else c["verdict"]
        if k == kind:
            out[verdict] += 1
    return out


def tally(claims: Iterable[Claim | Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """The counts a summary reports: ``raw`` and ``holm`` (Holm-adjusted, :func:`holm`) for the
    claims of kind ``claim``, and the controls and sanity checks apart (never counted as evidence)."""
    cs = list(claims)
    adjusted = holm(cs)
    kinds = [c.kind if isinstance(c, Claim) else c.get("kind", "claim") for c in cs]
    holm_counts = dict.fromkeys(VERDICTS, 0)
    for k, v in zip(kinds, adjusted, strict=True):
        if k == "claim":
            holm_counts[v] += 1
    return {
        "raw": counts(cs),
        "holm": holm_counts,
        "control": counts(cs, "control"),
        "sanity": counts(cs, "sanity"),
    }


def tally_text(t: Mapping[str, Mapping[str, int]]) -> str:
    """One line for :func:`tally`: raw and Holm-adjusted claim counts, controls and sanity apart."""

    def fmt(c: Mapping[str, int]) -> str:
        return ", ".join(f"{c[v]} {v}" for v in VERDICTS if c.get(v)) or "none"

    def part(key: str, noun: str) -> str:
        k = sum(t[key].values())
        return f"{k} {unit_text(k, noun)}: {fmt(t[key])}"

    parts = [part("raw", "claims") + f"; Holm-adjusted: {fmt(t['holm'])}"]
    for key, noun in (("control", "controls"), ("sanity", "sanity checks")):
        if any(t[key].values()):  # none of a kind: not said
            parts.append(part(key, noun))
    return " | ".join(parts)


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
