"""Weight patching: copy one component's weights from a source layer (or model) into a target layer.

``θ_target^part ← θ_source^part`` (:func:`me_interp.edits.patched_weights`) for each part (as in
``weight_swap``) and each target layer, then the ME layer is located again. Unlike a swap the source
keeps its weights: is a component *sufficient* to create the emergence where it is copied? One patch
*copied* the emergence when the new ME layer is the target (else *kept*, *vanished*, *elsewhere*); a
copy can only show up before the patched model's own ME layer ``m'``, so the claims (:data:`SPECS`,
docs/claims.md) are judged on the *eligible* targets ``t < m'``; later ones are reported. The source
is ``--layer`` (default: the ME layer of the source model, ``--source-model`` or the model itself).

    python -m me_interp.experiments.weight_patching --model synthetic:twin --source-model synthetic:planted
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import plotly.graph_objects as go

from me_interp import claims, terminal
from me_interp.claims import NotApplicable
from me_interp.edits import patched_weights
from me_interp.edits.core import ALL_PARTS, moved_modules
from me_interp.loading import load_model
from me_interp.loading.loaded import LoadedModel
from me_interp.plotting import outcome_heatmap
from me_interp.probes.measurement import Measurement, Setup
from me_interp.probes.site import Site, locate
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

NAME = "weight_patching"
OUTCOMES = ("copied", "kept", "vanished", "elsewhere")


@dataclass(frozen=True)
class Config(WeightConfig):
    """Weight-patching settings (``layer`` is the *source* layer).

    Attributes:
        targets: layers to patch into (empty: within one model, the layers before its ME layer;
            with a source model, every layer; ``max_targets`` of them, spread evenly).
        max_targets: without ``targets``, at most this many targets, spread evenly (first and last
            included; ``0`` = all). Each target costs one forward per part.
        parts: the components to copy, each separately (``post_ffn_norm`` and ``post_attn_norm``
            only on a sandwich-norm model).
        source_model: a second model of the same shape to copy from (loaded like ``--model``);
            ``None`` = copy within the model.
    """

    targets: tuple[int, ...] = ()
    max_targets: int = checked(0, ge=0)
    parts: tuple[str, ...] = checked(PART_ORDER, choices=ALL_PARTS, nonempty=True, unique=True)
    source_model: str | None = None


@dataclass(frozen=True)
class PatchRow:
    """One weight patch: the source layer's ``part`` copied into layer ``target`` (0-based).

    Attributes:
        me_layer: the ME layer located after the patch (all prompts at once; ``None``: none).
        outcome: the patch's outcome (:func:`outcome`).
        event_layers: the first layer of every emergence event after the patch.
        ratio_at_target, ratio_at_target_before: median norm ratio ``R`` at the target after and
            before; ``ratio_at_me_before``: after the patch, at the unpatched ME layer; ``ratio_last``:
            at the last layer; ``ratio_at_target_per_prompt``: per prompt.
        prompt_me_layer: per prompt, the ME layer located on that prompt alone.
        sink_downstream: the mean sink after the unpatched ME layer (or the target); ``top_ratio``:
            per layer.
    """

    part: str
    target: int
    me_layer: int | None
    outcome: str
    event_layers: list[int]
    ratio_at_target: float
    ratio_at_target_before: float
    ratio_at_me_before: float | None
    ratio_last: float
    ratio_at_target_per_prompt: list[float]
    prompt_me_layer: list[int | None]
    sink_downstream: float | None
    top_ratio: list[float]


@dataclass(frozen=True)
class TargetOutcome:
    """One target layer of one part, as the claim counts it: its depth label, the new ME layer (all
    prompts at once), whether it is eligible, how many prompts' own ME layer is the target, and the
    majority outcome ``copied`` (:func:`~me_interp.study.weights.majority`)."""

    target: int
    label: str
    me_layer: int | None
    eligible: bool
    copied_prompts: int
    copied: bool


@dataclass(frozen=True)
class Result(Headed):
    """What :func:`run` measured (0-based layers; ``header`` is the patched model's run, its
    ``layer`` the Site's).

    Attributes:
        source_model: the model copied from; ``source_layer``: the copied layer (``layer_given``:
            from ``--layer``).
        targets: the target layers, in order; ``eligible``: those before the patched model's ME
            layer (every target when it has none), on which the claims are judged.
        baseline: the unpatched (target) model's :class:`Measurement`.
        rows: one per (part, target): outcome, new ME layer, ratios (also per prompt), sink.
        part_modules: per part, the HF modules (names within a decoder layer) it copied.

    The claims are exact k-of-n counts (no resampling).
    """

    header: RunHeader
    source_model: str
    source_layer: int
    layer_given: bool
    targets: list[int]
    eligible: list[int]
    parts: list[str]
    baseline: Measurement
    rows: list[PatchRow]
    prompt_lengths: list[int]
    part_modules: list[PartModules] = field(default_factory=list)

    def part_rows(self, part: str, eligible_only: bool = False) -> list[PatchRow]:
        """The rows of ``part`` in target order (only eligible targets with ``eligible_only``)."""
        return [
            r
            for r in self.rows
            if r.part == part and (not eligible_only or r.target in self.eligible)
        ]

    def fraction(self, part: str, outcome: str, eligible_only: bool = False) -> float:
        rows = self.part_rows(part, eligible_only)
        return sum(r.outcome == outcome for r in rows) / max(len(rows), 1)

    def targets_with(self, part: str, outcome: str) -> list[int]:
        return [r.target for r in self.part_rows(part) if r.outcome == outcome]

    def per_target(self, part: str) -> list[TargetOutcome]:
        """Per target layer of ``part`` (the claim's units), a :class:`TargetOutcome`."""
        out = []
        for r in self.part_rows(part):
            hits = [pl == r.target for pl in r.prompt_me_layer]
            label = depth_label(r.target, self.source_layer)
            ok = r.target in self.eligible
            out.append(TargetOutcome(r.target, label, r.me_layer, ok, sum(hits), majority(hits)))
        return out

    def target_outcomes(self, part: str) -> claims.Outcomes:
        """The k-of-n measurement of a claim: per eligible target, the majority outcome."""
        keep = [t for t in self.per_target(part) if t.eligible]
        return claims.Outcomes(
            [t.copied for t in keep], [t.label for t in keep], unit="target layers"
        )


def outcome(me_after: int | None, me_before: int | None, target: int) -> str:
    """``copied`` (ME layer = target), ``kept`` (= the unpatched ME layer), ``vanished`` or ``elsewhere``."""
    if me_after is None:
        return "vanished"
    if me_after == target:
        return "copied"
    return "kept" if me_after == me_before else "elsewhere"


def eligible_targets(targets: Sequence[int], me_layer: int | None) -> list[int]:
    """The targets where a copy can show up as a new emergence: before ``me_layer`` (all if None)."""
    return [t for t in targets if me_layer is None or t < me_layer]


def _source_layer(cfg: Config, source: LoadedModel, s: Setup) -> int:
    """``cfg.layer``, else the source model's ME layer, else the patched model's."""
    if cfg.layer is not None:
        return source.check_layer(cfg.layer)
    me = s.site.me_layer
    if source is not s.model:
        me = locate(source, weights.inputs(cfg, source), criterion=s.criterion).me_layer
        if me is None:
            me = s.site.me_layer
    if me is None:
        s.site.require("pass --layer to patch a layer anyway")
    return me


def resolve_targets(
    cfg: Config, target: LoadedModel, same_model: bool, source_layer: int, me_layer: int | None
) -> list[int]:
    """``cfg.targets`` validated, else the default targets (see :class:`Config`).

    Raises:
        NotApplicable: within one model whose ME layer is layer 0 (no earlier layer to copy into).
        ValueError: a target out of range, or the source layer itself within one model.
    """
    if cfg.targets:
        why = f"source layer {source_layer}: patching a layer onto itself changes nothing"
        own = source_layer if same_model else None
        return given_layers(cfg.targets, target, "--targets", own, why)
    if same_model:
        candidates = [
            t for t in eligible_targets(range(target.n_layers), me_layer) if t != source_layer
        ]
        if not candidates:
            raise NotApplicable(
                f"the massive activation of {target.name} emerges at layer {me_layer}: there is no "
                "earlier layer to copy its weights into (pass --targets to patch later layers)"
            )
    else:
        candidates = list(range(target.n_layers))
    return spread(candidates, cfg.max_targets)


def run(
    cfg: Config,
    model: LoadedModel | None = None,
    site: Site | None = None,
    source_model: LoadedModel | None = None,
) -> Result:
    """Copy each part of the source layer into each target layer and measure. No printing, no files.

    Args:
        source_model: an already loaded source model (else ``cfg.source_model`` is loaded).

    Raises:
        NotApplicable: neither model has a massive activation and no ``cfg.layer``; or the default
            targets are empty (ME layer 0).
        ValueError: a layer out of range, models of different shapes, a target equal to the source
            layer within one model.
    """
    s = weights.setup(EXPERIMENT, cfg, model, site, require=False)
    target = s.model
    if source_model is None and cfg.source_model is not None:
        source_model = load_model(cfg.source_model, bos=cfg.bos, dtype=cfg.dtype, device=cfg.device)
    src = source_model if source_model is not None else target
    if src is not target and (src.n_layers, src.d_model) != (target.n_layers, target.d_model):
        raise ValueError(
            f"the source model has {src.n_layers} layers × d_model {src.d_model}, the model "
            f"{target.n_layers} × {target.d_model}: weight patching needs models of the same shape"
        )
    same = src is target
    source_layer = _source_layer(cfg, src, s)
    me0 = s.baseline.me_layer
    targets = resolve_targets(cfg, target, same, source_layer, me0)
    for part in cfg.parts:  # a post-norm part needs it in both models
        moved_modules(src, part)
    part_modules = [PartModules(part, moved_modules(target, part)) for part in cfg.parts]
    rows = []
    todo = [(part, t) for part in cfg.parts for t in targets]
    s.reuse_from(targets)  # a patch changes nothing before its target layer
    for part, t in terminal.bar(todo, desc=f"{NAME} (source layer {source_layer})"):
        with patched_weights(target, source_layer, t, part, source_model=None if same else src):
            after = s.measure(start=t)
        me, at_me = after.me_layer, None if me0 is None else after.ratio_at(me0)
        ratios = (after.ratio_at(t), s.baseline.ratio_at(t), at_me, after.top_ratio[-1])
        per = (after.prompt_ratio_at(t), after.prompt_me_layer)
        tail = (after.sink_after(me0 if me0 is not None else t), after.top_ratio)
        rows.append(
            PatchRow(part, t, me, outcome(me, me0, t), after.event_layers, *ratios, *per, *tail)
        )
    return Result(
        header=run_header(cfg, target, len(s.batch), s.site),
        source_model=src.name,
        source_layer=source_layer,
        layer_given=cfg.layer is not None,
        targets=targets,
        eligible=eligible_targets(targets, me0),
        parts=list(cfg.parts),
        baseline=s.baseline,
        rows=rows,
        prompt_lengths=s.batch.lengths,
        part_modules=part_modules,
    )


def _details(result: Result, part: str) -> str:
    src = "" if result.source_model == result.model else f" of {result.source_model}"
    got = "; ".join(
        f"{o} {result.targets_with(part, o)}" for o in OUTCOMES if result.targets_with(part, o)
    )
    per = ", ".join(
        f"{t.label} {t.copied_prompts}/{result.n_prompts}"
        for t in result.per_target(part)
        if t.eligible
    )
    later = [t for t in result.targets if t not in result.eligible]
    return (
        f"source layer m = {result.source_layer}{src} (1-based {result.source_layer + 1}, "
        f"{'--layer' if result.layer_given else 'detected'}); unpatched ME layer "
        f"{result.baseline.me_layer}; prompts whose own ME layer is the target: {per}; all "
        f"prompts at once: {got}"
        + (f"; targets {later} (at or after the ME layer) reported, not judged" if later else "")
        + f"; {result.n_prompts} prompts of ≤ {max(result.prompt_lengths)} tokens"
    )


def _applies(part: str):
    def applies(result: Result) -> str | None:
        if part not in result.parts:
            return f"{part} was not copied in this run (--parts)"
        if not result.eligible:
            return (
                "no target before the layer where the patched model's massive activation emerges "
                f"({result.baseline.me_layer}): a copy cannot show up as a new emergence there"
            )
        return None

    return applies


def _spec(part: str) -> claims.Spec:
    control = {
        "ffn_path": "copies of ffn_norm alone, ffn alone, attn_path and the whole block (their own "
        "claims); targets spread over the layers before the emergence",
        "block": "ffn_path, which copies no attention",
    }.get(part, "ffn_path and block; the other single parts")
    return claims.Spec(
        f"{NAME}.{part}",
        PART_SECTION[part],
        "Copied into an earlier layer (or into a model without the emergence), the ME layer's "
        f"{PART_WHAT[part]} makes that layer the ME layer: it suffices to create the emergence",
        f"fraction of eligible target layers t for which copying the source layer's {part} into t "
        "makes t the ME layer; eligible: before the patched model's own ME layer; a target counts "
        "when the ME layer located on each prompt alone is t on more than half of the prompts (k "
        "of n target layers, Clopper–Pearson: the targets are the depths tried, not a sample, and "
        "prompt variance enters only through the majority)",
        ">=",
        "moved_fraction",
        control,
        stat=lambda r: r.target_outcomes(part),
        unit="target layers",
        applies=_applies(part),
        details=lambda r: _details(r, part),
    )


PART_SPECS: dict[str, claims.Spec] = {p: _spec(p) for p in PART_ORDER}
SPECS: tuple[claims.Spec, ...] = tuple(PART_SPECS.values())
claims.check_specs(SPECS)


def figures(result: Result) -> dict[str, go.Figure]:
    index = {(r.part, r.target): r for r in result.rows}
    cells = [[index[(p, t)] for t in result.targets] for p in result.parts]
    src = "" if result.source_model == result.model else f" of {result.source_model}"
    fig = outcome_heatmap(
        [[r.me_layer for r in row] for row in cells],
        result.targets,
        result.parts,
        "copy %{y} into layer %{x}<br>ME layer after: %{text}<br>ratio at the target "
        "%{customdata:.4g}",
        [[r.ratio_at_target for r in row] for row in cells],
    ).update_layout(
        title=f"ME layer after copying layer {result.source_layer}{src}'s part into the target — "
        f"{result.model}<br><sup>unpatched ME layer {result.baseline.me_layer} (0-based); judged "
        f"targets: {result.eligible}</sup>",
        xaxis_title="target layer (0-based)",
        yaxis_title="copied part",
        template="plotly_white",
    )
    return {"me_layer_after_patch": fig}


def summary(result: Result) -> str:
    rows = [(p, *(f"{result.fraction(p, o):.0%}" for o in OUTCOMES)) for p in result.parts]
    return "\n".join(
        [
            f"model: {result.model}   source: {result.source_model} layer {result.source_layer}   "
            f"unpatched ME layer {result.baseline.me_layer}   targets {result.targets} "
            f"(judged: {result.eligible})   prompts {result.n_prompts}",
            "",
            fmt_table(["part", *OUTCOMES], rows),
            "",
            "modules copied per part (within the decoder layer):",
            *(f"  {p.part}: {' + '.join(p.modules)}" for p in result.part_modules),
        ]
    )


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("me_layer_after_patch",),
    inputs=weights.inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
