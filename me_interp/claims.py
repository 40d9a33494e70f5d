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
from dataclasses import asdict, dataclass, replace
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
ONE_MEASUREMENT = "(one measurement repeated)"
"""In the reason of a claim not decided because its units give one distinct measurement (the
report counts these)."""


@dataclass(frozen=True)
class Threshold:
    """One decision threshold, documented where it is defined."""

    value: float
    doc: str
    ratio: bool = False
    """A threshold on a ratio (a factor): the p-values' tail is taken on the log scale."""


THRESHOLDS: dict[str, Threshold] = {
    "jump": Threshold(
        10.0,
        "ME layer: the norm ratio (the largest token norm over the mean of the other tokens' "
        "norms) of the layer output must grow at least this many times across one layer for the "
        "birth to count as sudden; also the FFN's factor on that ratio at the ME layer",
        ratio=True,
    ),
    "carried_fraction": Threshold(
        0.5,
        "after the ME layer the massive token's norm must stay at least this fraction of its "
        "ME-layer value over the middle layers (the residual stream carries it); a single layer "
        "that multiplies it by less than this is an eraser, and ends the layers judged",
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
    "ordinary_ratio": Threshold(
        3.0,
        "a removal is a removal: an edit that removes the massive activation must leave the edited "
        "token ordinary, its norm ratio R (its norm over the mean of the other tokens' norms) at "
        "most this many times the others' (prompt means, at the edited layer and the last layer); "
        "a fraction of the excess is not enough (a token 15x the others still draws a sink)",
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
        ratio=True,
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
        ratio=True,
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
        "super weights: 'the super weight is in the ME layer' when zeroing the ME layer's top "
        "candidate removes at least this share of what it and the best other layer's candidate "
        "remove of the massive excess, ρ_me / (ρ_me + max_other ρ) (0.5: a tie; bootstrap over "
        "the distinct massive-token prefixes)",
    ),
    "padding_equivalence": Threshold(
        1e-3,
        "left padding leaves a state 'unchanged' when its relative difference to the unpadded "
        "state, ‖h_pad − h‖ / ‖h‖, stays at most this (float32 rounding is about 1e-6)",
    ),
    "secondary_share": Threshold(
        0.5,
        "secondary massive tokens (after the first token) 'share' a property of the first token "
        "(its dims and birth layer, a sink) when at least this fraction of them has it "
        "(Clopper-Pearson interval)",
    ),
    "first_token": Threshold(
        0.75,
        "'the massive token is the first token' when at least this fraction of the distinct "
        "massive-token prefixes has its massive positions exactly at the first token "
        "(Clopper-Pearson interval)",
    ),
    "min_units": Threshold(
        4.0,
        "the fewest distinct units (for a statistic of the massive token's state: distinct "
        "massive-token prefixes) a bootstrap claim is decided on; below it the percentile interval "
        "says little about variation and the claim is inconclusive",
    ),
    "placebo_quantile": Threshold(
        0.9,
        "placebo layers: a claim that singles out the ME layer holds only when its statistic at "
        "the ME layer lies beyond this quantile (on the claimed side) of the same statistic with "
        "each other layer in the ME layer's place; else it fails (the effect is not the ME layer's)",
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
    if n != 1 or "×" in unit or not unit.endswith("s") or unit.endswith("ss"):
        return unit
    if unit.endswith("ies"):
        return unit[:-3] + "y"
    return unit[:-2] if unit.endswith(("xes", "ches", "shes")) else unit[:-1]


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
class Placebo:
    """A claim's statistic with every other layer in the ME layer's place (placebo layers).

    Attributes:
        layer: the ME layer (the claim's own layer).
        layers: the layers the statistic was computed at (the ME layer among them).
        values: the statistic's point value at each of ``layers`` (NaN where undefined).
        quantile: the quantile of the other layers' values the ME layer must beat
            (``THRESHOLDS['placebo_quantile']``).
        bound: that quantile of the other layers' values (on the claim's side: the upper quantile
            for ``>=``/``>``, the lower for ``<=``/``<``).
        beaten: whether the ME layer's value lies beyond ``bound``.
    """

    layer: int
    layers: tuple[int, ...]
    values: tuple[float, ...]
    quantile: float = float("nan")
    bound: float = float("nan")
    beaten: bool = False

    def others(self) -> np.ndarray:
        """The finite values of the other layers."""
        v = np.array(
            [x for la, x in zip(self.layers, self.values, strict=True) if la != self.layer]
        )
        return v[np.isfinite(v)] if len(v) else v

    @property
    def value(self) -> float:
        """The ME layer's value."""
        return float(dict(zip(self.layers, self.values, strict=True)).get(self.layer, math.nan))

    def judged(self, op: str) -> Placebo:
        """This placebo with its ``bound`` and ``beaten`` for a claim ``statistic op threshold``."""
        q = threshold("placebo_quantile")
        o = self.others()
        if op not in (">=", ">", "<=", "<"):
            raise ValueError(f"a placebo needs a one-sided op, not {op!r}")
        up = op in (">=", ">")
        if len(o) == 0 or self.value != self.value:
            return replace(self, quantile=q, bound=math.nan, beaten=False)
        bound = float(np.quantile(o, q if up else 1 - q))
        beaten = self.value > bound if up else self.value < bound
        return replace(self, quantile=q, bound=bound, beaten=bool(beaten))

    def text(self) -> str:
        """``"ME 0.273 (layer 9); other layers 0.21–0.37 (0.9 quantile 0.35): ..."``."""
        o = self.others()
        rng = f"{fmt_num(o.min())}–{fmt_num(o.max())}" if len(o) else "none"
        rank = int((o >= self.value).sum()) + 1 if len(o) else 1
        return (
            f"placebo layers: ME {fmt_num(self.value)} (layer {self.layer}); other layers {rng} "
            f"({len(o)} layers; {self.quantile:g} quantile {fmt_num(self.bound)}); the ME layer "
            f"ranks {rank} of {len(o) + 1} from the top"
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Placebo:
        return cls(
            int(d["layer"]),
            tuple(int(x) for x in d["layers"]),
            tuple(float(_float(x)) for x in d["values"]),
            float(_float(d.get("quantile", "nan"))),
            float(_float(d.get("bound", "nan"))),
            bool(d.get("beaten", False)),
        )


def placebo(at: Callable[[int], Measure], layer: int, layers: Iterable[int]) -> Placebo:
    """The :class:`Placebo` of a statistic ``at(l)`` (the claim's measurement with layer ``l`` in
    the ME layer's place) over ``layers``: each layer's point value (:func:`point`); a layer
    where ``at`` raises :class:`NotApplicable` is NaN."""
    ls = tuple(int(x) for x in layers)
    vals = []
    for la in ls:
        try:
            vals.append(point(at(la)))
        except NotApplicable:
            vals.append(math.nan)
    return Placebo(int(layer), ls, tuple(vals))


def placebo_of(
    at: Callable[[Any, int], Measure],
    layer: Callable[[Any], int],
    layers: Callable[[Any], Iterable[int]],
) -> Callable[[Any], Placebo]:
    """A :class:`Spec`'s ``placebo``: :func:`placebo` of ``at(result, l)`` over ``layers(result)``
    with ``layer(result)`` the ME layer."""
    return lambda r: placebo(lambda la: at(r, la), layer(r), layers(r))


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
    placebo: Placebo | None = None
    implied_by: str | None = None

    @property
    def counted(self) -> bool:
        """Evidence that tallies and Holm count: a claim of kind ``claim``, not a corollary."""
        return self.kind == "claim" and not self.implied_by

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
        if isinstance(kw.get("placebo"), Mapping):
            kw["placebo"] = Placebo.from_dict(kw["placebo"])
        return cls(**kw)

    def line(self) -> str:
        """One citable line: verdict, claim, statistic with interval and n, rule, control."""
        head = f"[{self.verdict}] {self.id} ({self.section}): {self.statement}"
        if self.implied_by:
            head += f" (corollary of {self.implied_by}: shown, never counted)"
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
        if self.placebo is not None:
            parts.append(self.placebo.text())
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
        placebo: ``result -> Placebo`` for a claim that singles out the ME layer: the statistic
            with every other layer in its place (:func:`placebo`); the claim holds only when the
            ME layer also beats them (``THRESHOLDS['placebo_quantile']``), else it fails.
        implied_by: the id of the claim this one restates (a corollary): shown beside it, never
            counted in tallies or in Holm's family.
        massive_state: the statistic is of the massive token's state (a function of its prefix):
            a :class:`Sample` without ``keys`` is resampled by the run header's units (distinct
            massive-token prefixes, ``result.header.unit_keys``; rows are prompts, or
            ``Sample.prompts``).
        log: the p-values' tail on the log scale (``None``: when the threshold is a ratio,
            ``Threshold.ratio``).
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
    placebo: Callable[[Any], Placebo] | None = None
    implied_by: str | None = None
    massive_state: bool = False
    log: bool | None = None

    def __post_init__(self) -> None:
        if self.placebo is not None and self.op == "|x|<":
            raise ValueError(f"{self.id}: an equivalence claim takes no placebo")
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
            if self.massive_state:
                m = with_units(m, result)
            pl = None if self.placebo is None else self.placebo(result).judged(self.op)
        except NotApplicable as e:
            return self.not_applicable(str(e))
        log = THRESHOLDS[self.threshold].ratio if self.log is None else self.log
        est, p_hold, p_fail, outcomes = measure_estimate(m, self.unit, self.op, t, seed, log)
        verdict = decide(est, self.op, t)
        notes = []
        if est.value != est.value:
            notes.append("the statistic is undefined")
        least = int(threshold("min_units"))
        if verdict in (HOLDS, FAILS) and self.kind != "sanity":  # a sanity check may be exact
            if est.n_eff is not None and est.n_eff < 2:
                notes.append(
                    f"not decided: the {est.n} {est.unit} give {est.n_eff} distinct measurement "
                    f"{ONE_MEASUREMENT}, so the interval says nothing about variation"
                )
                verdict = INCONCLUSIVE
            elif est.method != "clopper-pearson" and est.n_eff is not None and est.n_eff < least:
                notes.append(
                    f"not decided: {est.n_eff} distinct units, fewer than the {least} a bootstrap "
                    "interval is decided on (threshold 'min_units')"
                )
                verdict = INCONCLUSIVE
            elif est.method != "clopper-pearson" and est.lo == est.hi:
                notes.append("not decided: the bootstrap interval has zero width")
                verdict = INCONCLUSIVE
        p = p_hold if verdict == HOLDS else p_fail if verdict == FAILS else min(p_hold, p_fail)
        if pl is not None and verdict == HOLDS and not pl.beaten:
            verdict, p = (
                FAILS,
                math.nan,
            )  # decided by the placebo rank, not a test: not in Holm's family
            notes.append(
                "fails on the placebo layers: the ME layer's statistic does not lie beyond the "
                f"{pl.quantile:g} quantile of the other layers' ({fmt_num(pl.value)} vs "
                f"{fmt_num(pl.bound)}), so the effect is not the ME layer's"
            )
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
            pl,
            self.implied_by,
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
            implied_by=self.implied_by,
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
            statistic depends on token 0 only); ``None`` = distinct rows of ``values``. With keys
            the bootstrap resamples the distinct keys (all rows of a drawn key together).
        prompts: for a spec with ``massive_state``: the prompt of each row (``None``: row ``i`` is
            prompt ``i``), whose unit key the engine reads from the run header.
    """

    values: Any
    statistic: Callable[[np.ndarray], float] | None = None
    unit: str | None = None
    keys: Sequence[Any] | None = None
    prompts: Sequence[int] | None = None


def with_units(m: Measure, result: Any) -> Measure:
    """``m`` with the run header's unit keys (distinct massive-token prefixes) where a
    :class:`Sample` has none: the one effective-n rule for statistics of the massive token's state.
    Other measurements, and samples with their own keys, are returned as they are."""
    if not isinstance(m, Sample | Nested) or m.keys is not None:
        return m
    keys = tuple(getattr(getattr(result, "header", None), "unit_keys", ()) or ())
    if not keys:
        return m
    rows = range(len(keys)) if m.prompts is None else [int(b) for b in m.prompts]
    if len(rows) != len(np.asarray(m.values)):
        raise ValueError(f"{len(np.asarray(m.values))} rows but {len(rows)} prompts with unit keys")
    return replace(m, keys=[keys[b] for b in rows])


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
        den: per unit, the denominator of a ratio (e.g. the unedited excess ``R − 1``): the
            statistic is then (the mean, or ``statistic``, of the cells) / the mean of ``den`` over
            the same resampled units, so the denominator is resampled with its numerators instead
            of held fixed.
        keys, prompts: as :class:`Sample`'s: what makes two units distinct measurements (all rows
            of a drawn key are resampled together), and for a spec with ``massive_state`` the
            prompt of each row.
    """

    values: Any
    statistic: Callable[[np.ndarray], float] | None = None
    unit: str | None = None
    inner: str = "seeds"
    crossed: bool = True
    den: Any = None
    keys: Sequence[Any] | None = None
    prompts: Sequence[int] | None = None


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


def _rows_distinct(arr: np.ndarray) -> int:
    """The effective n of rows without keys: every row is its own measurement (distinct inputs),
    unless all rows agree (one measurement repeated: nothing about variation). A statistic that is
    a function of a shared prefix declares it (``Spec(massive_state=True)``: its units are the
    distinct massive-token prefixes), so values that merely agree closely across distinct prompts
    are not mistaken for fewer measurements."""
    return 1 if len(arr) and _distinct(arr) == 1 else len(arr)


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


def point(m: Measure) -> float:
    """The point value of a measurement on all its units (no resampling): ``k / n`` of outcomes,
    else the statistic of the finite rows (for :func:`placebo`)."""
    if isinstance(m, Outcomes):
        return sum(map(bool, m.outcomes)) / len(m.outcomes) if len(m.outcomes) else math.nan
    arr = np.asarray(m.values, dtype=np.float64)
    ok = np.isfinite(arr).reshape(len(arr), -1).all(axis=1)
    if isinstance(m, Nested):
        den = None if m.den is None else np.asarray(m.den, dtype=np.float64)
        if den is not None:
            ok &= np.isfinite(den)
        a = arr[ok]
        if len(a) == 0:
            return math.nan
        v = float(m.statistic(a)) if m.statistic is not None else float(a.mean())
        return v if den is None else float(divide(v, den[ok].mean()))
    a = arr[ok]
    if len(a) == 0:
        return math.nan
    return float(m.statistic(a)) if m.statistic is not None else float(a.mean())


def _unit_codes(keys: Sequence[Any]) -> tuple[np.ndarray, int]:
    """Each row's unit (the index of its key, in order of first appearance) and the number of units."""
    order = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return np.array([order[k] for k in keys]), len(order)


def _cluster_counts(codes: np.ndarray, n_units: int, seed_rng: Any) -> np.ndarray:
    """``[boot, rows]``: how often each row is drawn when the ``n_units`` units (``codes``: each
    row's unit) are resampled with replacement, all rows of a drawn unit together."""
    draws = seed_rng.integers(0, n_units, size=(N_BOOTSTRAP, n_units))
    per_unit = np.stack([np.bincount(d, minlength=n_units) for d in draws])  # [boot unit]
    return per_unit[:, codes]


def _boot_stats(m: Sample | Nested, seed: int) -> tuple[float, np.ndarray, int, int]:
    """(point value, bootstrap statistics, n units, effective n) of a sample or nested measure."""
    arr = np.asarray(m.values, dtype=np.float64)
    if arr.ndim == 0:
        raise ValueError("a measurement needs one value per unit, got a scalar")
    rng = np.random.default_rng(seed)
    if isinstance(m, Nested):
        if arr.ndim != 2:
            raise ValueError(f"Nested values must be (units, seeds), got shape {arr.shape}")
        ok = np.isfinite(arr).all(axis=1)
        den = None if m.den is None else np.asarray(m.den, dtype=np.float64)
        if den is not None:
            ok &= np.isfinite(den)
            den = den[ok]
        arr = arr[ok]
        n, s = arr.shape
        if n == 0 or s == 0:
            return float("nan"), np.array([]), 0, 0
        stat = m.statistic or (lambda a: float(a.mean()))
        keys = None if m.keys is None else [k for k, f in zip(m.keys, ok, strict=True) if f]
        iu = rng.integers(0, n, size=(N_BOOTSTRAP, n))
        if keys is not None and len(set(keys)) < n:  # whole units drawn: all rows of a key
            codes, n_units = _unit_codes(keys)
            members = [np.flatnonzero(codes == u) for u in range(n_units)]
            draws = rng.integers(0, n_units, size=(N_BOOTSTRAP, n_units))
            iu = [np.concatenate([members[u] for u in d]) for d in draws]  # rows per replicate
        if m.crossed:  # one seed resample per replicate, shared by its units
            iseed = np.broadcast_to(
                rng.integers(0, s, size=(N_BOOTSTRAP, 1, s)), (N_BOOTSTRAP, n, s)
            )
        else:
            iseed = rng.integers(0, s, size=(N_BOOTSTRAP, n, s))
        if isinstance(iu, list):  # units of unequal size: one replicate at a time
            stats = np.array(
                [stat(arr[r][:, iseed[b, 0]]) for b, r in enumerate(iu)]
                if m.crossed
                else [stat(arr[r[:, None], rng.integers(0, s, size=(len(r), s))]) for r in iu],
                dtype=np.float64,
            )
            den_means = None if den is None else np.array([den[r].mean() for r in iu])
        else:
            res = arr[iu[..., None], iseed]  # [boot unit seed]
            if m.statistic is None:
                stats = res.mean(axis=(1, 2))
            else:
                stats = np.array([stat(r) for r in res])
            den_means = None if den is None else den[iu].mean(axis=1)
        value = float(stat(arr))
        if den is not None:  # the denominator resampled with its units
            stats = divide(stats, den_means)
            value = float(divide(value, den.mean()))
        n_eff = len(set(keys)) if keys is not None else _rows_distinct(arr.mean(1))
        return value, stats, n, n_eff
    finite = np.isfinite(arr).reshape(len(arr), -1).all(axis=1)
    keys = None if m.keys is None else [k for k, f in zip(m.keys, finite, strict=True) if f]
    arr = arr[finite]
    n = len(arr)
    if n == 0:
        return float("nan"), np.array([]), 0, 0
    if m.statistic is None and arr.ndim != 1:
        raise ValueError("the default statistic (mean) needs 1-D values")
    if keys is not None and len(set(keys)) < n:  # resample the distinct units, not the rows
        codes, n_units = _unit_codes(keys)
        counts = _cluster_counts(codes, n_units, rng)  # [boot row]
        if m.statistic is None or getattr(m.statistic, "of_means", None) is not None:
            f = getattr(m.statistic, "of_means", None) or (lambda x: x)
            total = counts.sum(1, keepdims=True)
            means = (counts @ arr.reshape(n, -1) / total).reshape(N_BOOTSTRAP, *arr.shape[1:])
            with np.errstate(divide="ignore", invalid="ignore"):
                stats = np.asarray(f(means), dtype=np.float64)
        else:
            stats = np.array(
                [m.statistic(np.repeat(arr, c, axis=0)) for c in counts], dtype=np.float64
            )
        value = float(arr.mean()) if m.statistic is None else float(m.statistic(arr))
        return value, stats, n, n_units
    idx = rng.integers(0, n, size=(N_BOOTSTRAP, n))
    if m.statistic is None:
        value, stats = float(arr.mean()), arr[idx].mean(axis=1)
    else:
        value = float(m.statistic(arr))
        f = getattr(m.statistic, "of_means", None)
        if f is not None:  # one vectorised call for every resample
            with np.errstate(divide="ignore", invalid="ignore"):
                stats = np.asarray(f(_resample_means(arr, idx)), dtype=np.float64)
        else:
            stats = np.array([m.statistic(arr[i]) for i in idx], dtype=np.float64)
    n_eff = len(set(keys)) if keys is not None else _rows_distinct(arr)
    return value, stats, n, n_eff


P_TAIL_MIN = 10
"""Below this many resamples on the other side of the threshold the share cannot resolve the
tail: the p-value is then the normal tail of the resamples on the p-value scale (log for ratios),
capped by the share's ``(k + 1) / (B + 1)``."""


def _share_p(stats: np.ndarray, thr: float, up: bool, log: bool) -> float:
    """One-sided p-value of "the statistic lies above ``thr``" (``up``; else below) from bootstrap
    statistics: ``(1 + #resamples on the other side) / (B + 1)``; when fewer than
    :data:`P_TAIL_MIN` are there, the normal tail of the resamples (on the log scale when ``log``
    and everything is positive), never above the share."""
    b = len(stats)
    k = int((stats <= thr).sum() if up else (stats >= thr).sum())
    share = (k + 1) / (b + 1)
    if k >= P_TAIL_MIN:
        return share
    x, t = stats, thr
    if log and thr > 0 and bool((stats > 0).all()):
        x, t = np.log(stats), math.log(thr)
    sd = float(x.std(ddof=1)) if b > 1 else 0.0
    z = (float(x.mean()) - t) * (1 if up else -1)
    tail = (0.0 if z > 0 else 1.0) if sd == 0 else _norm_sf(z / sd)
    return min(share, tail)


def _p_values(stats: np.ndarray, op: str, thr: float, log: bool = False) -> tuple[float, float]:
    """One-sided p-values of "holds" and of "fails" from the bootstrap statistics (the share on
    the other side of the threshold, :func:`_share_p`). For ``|x|<`` (equivalence) "holds" is the
    larger of the two one-sided tests for "inside", "fails" the nearer "outside" side. Holm adjusts
    these; the verdicts themselves come from the intervals."""
    if len(stats) == 0:
        return float("nan"), float("nan")
    if op == "|x|<":  # two one-sided tests for "inside", the nearer side for "outside"
        p_hold = max(_share_p(stats, -thr, True, False), _share_p(stats, thr, False, False))
        p_fail = min(_share_p(stats, thr, True, False), _share_p(stats, -thr, False, False))
        return p_hold, p_fail
    up = op in (">=", ">")
    return _share_p(stats, thr, up, log), _share_p(stats, thr, not up, log)


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
    m: Measure, unit: str, op: str, thr: float, seed: int = 0, log: bool = False
) -> tuple[Estimate, float, float, dict[str, bool] | None]:
    """The estimate of a measurement, its one-sided p-values (holds, fails; from the resamples,
    their tail on the log scale when ``log``) and, for k-of-n outcomes, each unit's outcome."""
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
    p_hold, p_fail = _p_values(stats, op, thr, log)
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


def pair_measure(
    mats: np.ndarray,
    pairs: np.ndarray,
    reduce: Callable[[np.ndarray], Any],
    keys: Sequence[str] | None = None,
) -> Sample:
    """``reduce`` (over the last axis) of the per-matrix mean of ``mats[k, a, b]`` over the pairs
    ``pairs[a, b]`` (symmetric, false on the diagonal), as a sample over prompts (``keys``: what
    makes two prompts distinct measurements).

    A resample draws prompts with replacement; with multiplicities ``w`` the mean over the resampled
    pairs is ``wᵀ (P ∘ M_k) w / wᵀ P w`` (copies of one prompt share their first token, so they never
    pair). The sample's rows are the prompts' indicator vectors (the identity), so the column means
    of a resample are its ``w / n`` and the bootstrap takes every resample at once
    (``of_means``; the ratio does not depend on the scale of ``w``).
    """
    n = pairs.shape[0]
    P = pairs.astype(np.float64)
    M = np.where(pairs[None], mats, 0.0)  # [k n n]
    flat = M.reshape(-1, n)  # [k*n n]

    def of_weights(w: np.ndarray) -> np.ndarray | float:
        den = ((w @ P) * w).sum(-1)  # [...]
        num = ((w @ flat.T).reshape(*w.shape[:-1], -1, n) * w[..., None, :]).sum(-1)  # [... k]
        return np.where(den != 0, reduce(divide(num, den[..., None])), np.nan)

    return Sample(np.eye(n), of_means(of_weights), keys=keys)


def lowest(x: np.ndarray) -> np.ndarray | float:
    """The minimum over the last axis (a ``reduce`` of :func:`pair_measure`)."""
    return x.min(-1)


@of_means
def relative_drop(m: np.ndarray) -> np.ndarray | float:
    """``1 − mean(a[:, 1]) / mean(a[:, 0])`` of paired rows ``(reference, value)`` (``m``: their
    column means): how far the value lies below the reference, as a fraction of it (a
    :class:`Sample` statistic)."""
    return 1.0 - m[..., 1] / m[..., 0]


def paired(reference: np.ndarray, value: np.ndarray) -> np.ndarray:
    """``[n, 2]`` rows ``(reference, value)`` for :func:`relative_drop`."""
    return np.stack([np.asarray(reference, float), np.asarray(value, float)], axis=1)


def rise_after(curve: np.ndarray, layer: int) -> np.ndarray | float:
    """``(mean after − max before) / max(both)`` of per-layer values ``curve [..., layer]`` (0 when
    both are 0), before = layers ≤ ``layer``, after = layers > ``layer``; vectorised over the leading
    axes (for the bootstrap: :func:`of_means`)."""
    before, after = curve[..., : layer + 1].max(-1), curve[..., layer + 1 :].mean(-1)
    top = np.maximum(before, after)
    return divide(after - before, top, fill=0.0)


def holm(claims: Sequence[Claim | Mapping[str, Any]], alpha: float = ALPHA) -> list[str]:
    """Holm-adjusted verdicts (one per claim, in order) over the family of claims of kind
    ``claim`` with a p-value: a decided verdict stays decided when its one-sided p-value passes
    Holm's step-down at ``alpha / 2`` (the one-sided level of the 95 % intervals), else it becomes
    inconclusive. Controls, sanity checks and not-applicable claims keep their verdict and are not
    in the family."""

    rows = [
        (c.verdict, _kind(c), c.p)
        if isinstance(c, Claim)
        else (c.get("verdict"), _kind(c), c.get("p"))
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
        if _kind(c) == kind:
            out[c.verdict if isinstance(c, Claim) else c["verdict"]] += 1
    return out


def _kind(c: Claim | Mapping[str, Any]) -> str:
    """A claim's kind for counting: ``"corollary"`` for a claim with ``implied_by`` (shown, never
    counted as evidence), else its kind."""
    kind = c.kind if isinstance(c, Claim) else c.get("kind", "claim")
    implied = c.implied_by if isinstance(c, Claim) else c.get("implied_by")
    return "corollary" if implied and kind == "claim" else kind


def tally(claims: Iterable[Claim | Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """The counts a summary reports: ``raw`` and ``holm`` (Holm-adjusted, :func:`holm`) for the
    claims of kind ``claim``, and the controls and sanity checks apart (never counted as evidence)."""
    cs = list(claims)
    adjusted = holm(cs)
    kinds = [_kind(c) for c in cs]
    holm_counts = dict.fromkeys(VERDICTS, 0)
    for k, v in zip(kinds, adjusted, strict=True):
        if k == "claim":
            holm_counts[v] += 1
    return {
        "raw": counts(cs),
        "holm": holm_counts,
        "control": counts(cs, "control"),
        "sanity": counts(cs, "sanity"),
        "corollary": counts(cs, "corollary"),
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
    if any(t.get("corollary", {}).values()):
        parts.append(part("corollary", "corollaries") + " (never counted)")
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
