"""Weight swap: exchange the ME layer's parameters with another layer's — does the emergence move?

For each part (``me_interp.edits.PARTS``: ``ffn_path`` = pre-FFN RMSNorm + FFN, the paper's pair,
§2.3; ``ffn_norm``, ``ffn``, ``attn_path``, ``attn_norm``, ``attn``, ``block``; on sandwich-norm models
the paths carry their post-norm, and ``post_ffn_norm`` / ``post_attn_norm`` are measured without a
claim) and each partner layer ``p``, the part of the ME layer ``m`` and of ``p`` are exchanged
(:func:`me_interp.edits.swapped_layers`) and the ME layer is located again, on all prompts at once
and on each prompt alone (``probes.measurement``). One swap *moved* the emergence when the new ME
layer is ``p`` (else *stayed*, *vanished* or *elsewhere*); a partner is decided by a majority of
its prompts.

    python -m me_interp.experiments.weight_swap --parts ffn_path block --partners 0 5 20
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

from me_interp import claims, terminal
from me_interp.edits import swapped_layers
from me_interp.edits.core import ALL_PARTS, moved_modules
from me_interp.loading.loaded import LoadedModel
from me_interp.plotting import interval_bars, outcome_heatmap
from me_interp.probes.measurement import Measurement, Setup
from me_interp.probes.site import Site
from me_interp.prompts import spread
from me_interp.study import (
    Experiment,
    Headed,
    RunHeader,
    WeightConfig,
    checked,
    command,
    run_header,
    weights,
)
from me_interp.study.weights import (
    PART_ORDER,
    PART_SECTION,
    PART_WHAT,
    PartModules,
    depth_label,
    given_layers,
    majority,
)
from me_interp.terminal import fmt_table

NAME = "weight_swap"
OUTCOMES = ("moved", "stayed", "vanished", "elsewhere")


@dataclass(frozen=True)
class Config(WeightConfig):
    """Weight-swap settings.

    Attributes:
        partners: layers to swap with (empty: ``max_partners`` layers spread over the others).
        max_partners: without ``partners``, at most this many partners, spread evenly over every
            other layer (first and last included; ``0`` = all). Each partner costs one forward per
            part; the result reports the partners used.
        parts: the components to swap, each separately (``post_ffn_norm`` and ``post_attn_norm``
            only on a sandwich-norm model).
    """

    partners: tuple[int, ...] = ()
    max_partners: int = checked(15, ge=0)
    parts: tuple[str, ...] = checked(PART_ORDER, choices=ALL_PARTS, nonempty=True, unique=True)


@dataclass(frozen=True)
class SwapRow:
    """One swap: ``part`` of the ME layer ``m`` swapped with layer ``partner`` (0-based).

    Attributes:
        me_layer: the ME layer located after the swap (all prompts at once; ``None``: none).
        outcome: ``moved`` / ``stayed`` / ``vanished`` / ``elsewhere`` (:func:`outcome`).
        event_layers: the first layer of every emergence event after the swap.
        ratio_at_partner, ratio_at_layer, ratio_last: median norm ratio ``R`` at the partner, at
            ``m`` and at the last layer; ``*_per_prompt``: per prompt.
        prompt_me_layer: per prompt, the ME layer located on that prompt alone.
        sink_downstream: the mean sink after ``m``; ``top_ratio``, ``sink``: per layer.
    """

    part: str
    partner: int
    me_layer: int | None
    outcome: str
    event_layers: list[int]
    ratio_at_partner: float
    ratio_at_layer: float
    ratio_last: float
    ratio_at_partner_per_prompt: list[float]
    ratio_at_layer_per_prompt: list[float]
    prompt_me_layer: list[int | None]
    sink_downstream: float | None
    top_ratio: list[float]
    sink: list[float]


@dataclass(frozen=True)
class PartnerOutcome:
    """One partner layer of one part, as the claims count it: its depth label, the new ME layer
    (all prompts at once), how many prompts' own ME layer moved to the partner / left ``m``, and
    the majority outcomes ``moved`` / ``left_layer`` (:func:`majority`)."""

    partner: int
    label: str
    me_layer: int | None
    moved_prompts: int
    left_prompts: int
    moved: bool
    left_layer: bool


@dataclass(frozen=True)
class Result(Headed):
    """What :func:`run` measured (0-based layers; ``header.layer`` is the swapped layer ``m``,
    ``header.layer_given`` whether it came from ``--layer``).

    Attributes:
        partners: the partner layers, in order; ``parts``: the swapped parts, in order.
        baseline: the unedited model's :class:`Measurement`.
        rows: one per (part, partner): outcome, new ME layer, ratios (also per prompt), sink.
        part_modules: per part, the HF modules (names within a decoder layer) it moved.

    The claims are exact k-of-n counts (no resampling).
    """

    header: RunHeader
    partners: list[int]
    parts: list[str]
    baseline: Measurement
    rows: list[SwapRow]
    prompt_lengths: list[int]
    part_modules: list[PartModules] = field(default_factory=list)

    @property
    def layer_given(self) -> bool:
        return self.header.layer_given

    def part_rows(self, part: str) -> list[SwapRow]:
        """The rows of ``part``, in partner order."""
        return [r for r in self.rows if r.part == part]

    def fractions(self, part: str) -> list[float]:
        """Share of partners per outcome, in the order of :data:`OUTCOMES`."""
        got = [r.outcome for r in self.part_rows(part)]
        return [sum(g == o for g in got) / max(len(got), 1) for o in OUTCOMES]

    def partners_with(self, part: str, outcome: str) -> list[int]:
        return [r.partner for r in self.part_rows(part) if r.outcome == outcome]

    def per_partner(self, part: str) -> list[PartnerOutcome]:
        """The claims' units: per partner layer of ``part``, a :class:`PartnerOutcome`."""
        out = []
        for r in self.part_rows(part):
            moved = [pl == r.partner for pl in r.prompt_me_layer]
            left = [pl != self.layer for pl in r.prompt_me_layer]
            label = depth_label(r.partner, self.layer)
            k, k_left, y, y_left = sum(moved), sum(left), majority(moved), majority(left)
            out.append(PartnerOutcome(r.partner, label, r.me_layer, k, k_left, y, y_left))
        return out

    def partner_outcomes(self, part: str, what: str = "moved") -> claims.Outcomes:
        """The k-of-n measurement of a claim: per partner layer, the majority outcome ``what``
        (``"moved"`` or ``"left_layer"``), labelled by depth relative to ``m``."""
        pp = self.per_partner(part)
        flags = [p.moved if what == "moved" else p.left_layer for p in pp]
        return claims.Outcomes(flags, [p.label for p in pp], unit="partner layers")

    @property
    def baseline_has_emergence(self) -> bool:
        """Whether the unedited model's ME layer is the swapped layer."""
        return self.baseline.me_layer == self.layer


def outcome(me_after: int | None, layer: int, partner: int) -> str:
    """``moved`` (ME layer = partner), ``stayed`` (= the original layer), ``vanished`` or ``elsewhere``."""
    if me_after is None:
        return "vanished"
    if me_after == partner:
        return "moved"
    return "stayed" if me_after == layer else "elsewhere"


def resolve_partners(cfg: Config, model: LoadedModel, layer: int) -> list[int]:
    """``cfg.partners`` validated, or ``cfg.max_partners`` layers spread over every other layer.

    Raises:
        ValueError: a partner out of range or equal to ``layer`` (a swap with itself).
    """
    if cfg.partners:
        why = f"swapped layer {layer}: cannot swap a layer with itself"
        return given_layers(cfg.partners, model, "--partners", layer, why)
    return spread([p for p in range(model.n_layers) if p != layer], cfg.max_partners)


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Swap each part of the ME layer with each partner layer and measure. No printing, no files.

    Raises:
        NotApplicable: no massive activation on the model and no ``cfg.layer``.
        ValueError: a partner out of range or equal to the layer (a swap with itself).
    """
    s: Setup = weights.setup(EXPERIMENT, cfg, model, site)
    m = s.layer
    assert m is not None  # setup(require=True) raises otherwise
    partners = resolve_partners(cfg, s.model, m)
    part_modules = [PartModules(part, moved_modules(s.model, part)) for part in cfg.parts]
    rows = []
    todo = [(part, p) for part in cfg.parts for p in partners]
    s.reuse_from([min(m, p) for p in partners])  # a swap changes nothing before its first layer
    for part, p in terminal.bar(todo, desc=f"{NAME} (layer {m})"):
        with swapped_layers(s.model, m, p, part):
            after = s.measure(start=min(m, p))
        ratios = (after.ratio_at(p), after.ratio_at(m), after.top_ratio[-1])
        per = (after.prompt_ratio_at(p), after.prompt_ratio_at(m), after.prompt_me_layer)
        me, tail = after.me_layer, (after.sink_after(m), after.top_ratio, after.sink)
        rows.append(
            SwapRow(part, p, me, outcome(me, m, p), after.event_layers, *ratios, *per, *tail)
        )
    return Result(
        header=run_header(cfg, s.model, len(s.batch), s.site),
        partners=partners,
        parts=list(cfg.parts),
        baseline=s.baseline,
        rows=rows,
        prompt_lengths=s.batch.lengths,
        part_modules=part_modules,
    )


def _details(result: Result, part: str, what: str = "moved") -> str:
    m = result.layer
    where = "--layer" if result.layer_given else "detected"
    out = "; ".join(
        f"{o} {result.partners_with(part, o)}" for o in OUTCOMES if result.partners_with(part, o)
    )
    per = ", ".join(
        f"{p.label} {p.moved_prompts if what == 'moved' else p.left_prompts}/{result.n_prompts}"
        for p in result.per_partner(part)
    )
    return (
        f"layer m = {m} (1-based {m + 1}, {where}; unedited ME layer {result.baseline.me_layer}, "
        f"ratio {result.baseline.ratio_at(m):.4g}); prompts whose own ME layer "
        f"{'moved to the partner' if what == 'moved' else 'is not m'}: {per}; "
        f"all prompts at once: {out}; {result.n_prompts} prompts of ≤ "
        f"{max(result.prompt_lengths)} tokens"
    )


def _swapped(part: str):
    def applies(result: Result) -> str | None:
        if part not in result.parts:
            return f"{part} was not swapped in this run (--parts)"
        return None

    return applies


_MAJORITY = (
    "; a partner counts when that holds for the ME layer located on each prompt alone on more than "
    "half of the prompts (k of n partner layers, Clopper–Pearson: the partners are the depths "
    "tried, not a sample, and prompt variance enters only through the majority)"
)
_CONTROL = {
    "ffn_path": "the same swaps of ffn_norm alone, ffn alone, attn_path and the whole block (their "
    "own claims); partners spread over every depth",
    "block": "ffn_path, which leaves attention in place",
    "attn_path": "ffn_path: the paper predicts the emergence moves with the FFN path, not with "
    "attention (which runs before the FFN)",
}


def _part_spec(part: str) -> claims.Spec:
    return claims.Spec(
        f"{NAME}.{part}",
        PART_SECTION[part],
        f"The emergence moves with the ME layer's {PART_WHAT[part]}: exchanging that part with "
        "another layer's makes that layer the ME layer",
        f"fraction of partner layers p for which swapping {part} of layers m ↔ p makes p the ME "
        "layer" + _MAJORITY,
        ">=",
        "moved_fraction",
        _CONTROL.get(part, "ffn_path and block; the other single parts"),
        stat=lambda r: r.partner_outcomes(part, "moved"),
        unit="partner layers",
        applies=_swapped(part),
        details=lambda r: _details(r, part),
    )


def _needed_applies(result: Result) -> str | None:
    if "ffn_path" not in result.parts:
        return "ffn_path was not swapped in this run (--parts)"
    if not result.baseline_has_emergence:
        return (
            f"layer {result.layer} is not where the unedited model's massive activation "
            f"emerges (ME layer {result.baseline.me_layer}): there is no emergence there to remove"
        )
    return None


PART_SPECS: dict[str, claims.Spec] = {p: _part_spec(p) for p in PART_ORDER}
NEEDED_SPEC = claims.Spec(
    f"{NAME}.ffn_path_needed",
    "§2.1, §2.3",
    "The emergence needs the ME layer's own FFN path: with another layer's pre-FFN RMSNorm + FFN "
    "(+ post-FFN norm on sandwich models) in its place, the ME layer is no longer where the massive "
    "activation emerges",
    "fraction of partner layers p for which, after swapping ffn_path of layers m ↔ p, the ME "
    "layer is not m (it moved or vanished)" + _MAJORITY,
    ">=",
    "moved_fraction",
    "the unedited model, whose ME layer is m; attn_path swaps (their own claim)",
    stat=lambda r: r.partner_outcomes("ffn_path", "left_layer"),
    unit="partner layers",
    applies=_needed_applies,
    details=lambda r: _details(r, "ffn_path", "left_layer"),
    # the ME layer's FFN makes the activation (ffn_creates): taking that FFN away moves it
    implied_by="me_layer.ffn_creates",
)
SPECS: tuple[claims.Spec, ...] = (*PART_SPECS.values(), NEEDED_SPEC)
claims.check_specs(SPECS)


def _grid(result: Result, key: str) -> list[list[Any]]:
    index = {(r.part, r.partner): getattr(r, key) for r in result.rows}
    return [[index.get((part, p)) for p in result.partners] for part in result.parts]


def figures(result: Result) -> dict[str, go.Figure]:
    m, name = result.layer, result.model
    fig_me = outcome_heatmap(
        _grid(result, "me_layer"),
        result.partners,
        result.parts,
        f"swap %{{y}} of layer {m} with layer %{{x}}<br>ME layer after: %{{text}}",
    ).update_layout(
        title=f"ME layer after swapping layer {m}'s part with the partner layer — {name}<br><sup>"
        f"baseline ME layer {result.baseline.me_layer} (0-based); 'moved' = ME layer equals the "
        "partner</sup>",
        xaxis_title="partner layer (0-based)",
        yaxis_title="swapped part",
        template="plotly_white",
    )
    ratio = _grid(result, "ratio_at_partner")
    fig_ratio = go.Figure(
        go.Heatmap(
            z=[[math.log10(v) if v and v > 0 else None for v in row] for row in ratio],
            x=[str(p) for p in result.partners],
            y=result.parts,
            customdata=ratio,
            colorscale="Magma",
            colorbar_title="log10 ratio",
            hovertemplate="swap %{y} with layer %{x}<br>massive ratio at the partner layer: "
            "%{customdata:.4g}<extra></extra>",
        )
    ).update_layout(
        title=f"Massive ratio (max token / mean others) at the partner layer after the swap — {name}"
        f"<br><sup>baseline ratio at layer {m}: {result.baseline.ratio_at(m):.4g}</sup>",
        xaxis_title="partner layer (0-based)",
        yaxis_title="swapped part",
        template="plotly_white",
    )
    judged = [c for c in claims.judge(SPECS, result) if c.estimate and c.id != NEEDED_SPEC.id]
    fig_moved = interval_bars(
        [c.id.split(".", 1)[1] for c in judged],
        [(c.estimate.value, c.estimate.lo, c.estimate.hi) for c in judged],
        [c.verdict for c in judged],
        "%{x}: moved for %{y:.0%} of partners (%{text})",
    )
    thr = claims.threshold("moved_fraction")
    fig_moved.add_hline(y=thr, line_dash="dash", annotation_text=f"moved_fraction {thr:g}")
    fig_moved.update_layout(
        title=f"Fraction of partner layers the emergence moved to, per swapped part — {name}<br>"
        f"<sup>layer {m}, {len(result.partners)} partners (majority over prompts each); 95% "
        "Clopper–Pearson interval over partner layers</sup>",
        xaxis_title="swapped part",
        yaxis_title="moved fraction",
        yaxis_range=[0, 1.05],
        template="plotly_white",
    )
    return {
        "me_layer_after_swap": fig_me,
        "ratio_at_partner": fig_ratio,
        "moved_fraction": fig_moved,
    }


def summary(result: Result) -> str:
    b = result.baseline
    lines = [
        f"model: {result.model}   layer {result.layer} (1-based {result.layer + 1})   baseline ratio "
        f"{b.ratio_at(result.layer):.4g}   prompts {result.n_prompts}   partners {result.partners}",
        "",
        fmt_table(
            ["part", *OUTCOMES],
            [(p, *(f"{v:.0%}" for v in result.fractions(p))) for p in result.parts],
        ),
        "",
        "modules moved per part (within the decoder layer):",
        *(f"  {p.part}: {' + '.join(p.modules)}" for p in result.part_modules),
    ]
    return "\n".join(lines)


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("me_layer_after_swap",),
    inputs=weights.inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
