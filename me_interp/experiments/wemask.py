"""The mask-rate study: WeMask and its alternatives against rate r and strength α, with claims.

At every mask rate ``r`` (by default the paper's 0.1, 0.3, 0.5, 0.7 and 1.0, with 0 as the
reference) and dim selection (``weight`` = the paper's text, ``activation`` = the released code,
``random`` and ``magnitude`` = the paper's ablations), and for the soft alternatives (``h − α P_S h``
on the ``weight`` dims; ``h − α (⟨h,v⟩/‖v‖²) v``, ``v`` the mean massive attention input), it masks
the massive token's attention input in the layers from the ME layer on and measures the shipped
texts, one forward per condition (:func:`me_interp.interventions.soft.mask_conditions`; metrics:
:func:`me_interp.evaluation.text_metrics`, per text) and, with ``mc``, multiple-choice accuracy.
``r = 0`` and ``α = 0`` are the identity (the baseline rows); ``r = 1`` is one forward for every
selection. The claims are :data:`SPECS`.

    python -m me_interp.experiments.wemask                     # bundled model, a few minutes on a CPU
    python -m me_interp.experiments.wemask --model synthetic:planted --rates 0 0.5 1
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go

from me_interp import claims, evaluation, plotting, terminal
from me_interp.evaluation import Metrics
from me_interp.interventions import soft
from me_interp.interventions.soft import MaskCondition as Condition
from me_interp.interventions.wemask import (
    STARTS,
    VARIANTS,
    locate_with_directions,
    mask_layers,
    massive_positions,
    positions_label,
    start_layer,
)
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.measurement import short_batch
from me_interp.prompts import builtin_texts, read_prompts, spread
from me_interp.study import (
    BackendConfig,
    Experiment,
    Headed,
    checked,
    command,
    model_for,
    run_header,
)
from me_interp.study.result import RunHeader

NAME = "wemask"
METRICS = evaluation.POOLED_METRICS
PER_TEXT = evaluation.TEXT_STATS


@dataclass(frozen=True)
class Config(BackendConfig):
    """Mask-rate study settings.

    Attributes:
        rates: mask rates r ∈ [0, 1] of the sweep (``claim_rate`` is always run too).
        variants: dim selections.
        claim_rate: the rate the claims are judged at (the paper's training-free rate), in (0, 1).
        n_seeds: seeds of the ``random`` selection at ``claim_rate`` (``seed, seed+1, …``; the
            random-dims claim needs at least 5).
        alphas: strengths α ∈ [0, 1] of the soft alternatives (empty: none; at α = 1 the dim
            projection is the WeMask ``weight`` row).
        soft_rate: rate of the ``weight`` dim set of the soft dim projection.
        start: ``ge`` (layers ≥ ME, the paper) or ``gt`` (layers > ME).
        me_layer: the ME layer (0-based); measured on the prompts when ``None``.
        texts: text file (one text per line) for the metrics; ``None``: the shipped texts.
        max_texts: use this many texts, spread evenly over the file (``0`` = all; each condition
            is a forward over them); the claims' intervals are over texts: keep at least 32.
        rank_layer: layer whose token states give the effective rank (negative: from the end).
        mc: multiple-choice scoring: ``claim`` (baseline and the claim's WeMask), ``all`` (every
            condition, one more forward each) or ``none``.
        mc_items: MC item file (JSON list of {context, choices, answer}); ``None``: the shipped items.
        positions: ``first`` (absolute position 0) or ``massive`` (the massive positions detected in
            each text at the ME layer; texts with none fall back to position 0).
        detect_tokens: cut the prompts to this many tokens to detect the ME layer (``0`` = no cut;
            the massive token is among the first).
        batch_tokens: padded tokens per forward batch of texts (texts are grouped by length).
        backend: ``tl`` (TransformerLens) or ``nnsight`` (a plain HF model under nnsight: the WeMask
            selections at every rate with perplexity, sink, entropy and effective rank reduced inside
            the trace; no KL / top-1 agreement, MC items or soft alternatives; ``docs/remote.md``).
        remote: with ``nnsight``: run on NDIF (key in ``NDIF_API_KEY``; the model is an HF name).
    """

    rates: tuple[float, ...] = checked((0.0, 0.1, 0.3, 0.5, 0.7, 1.0), ge=0, le=1, nonempty=True)
    variants: tuple[str, ...] = checked(VARIANTS, choices=VARIANTS, nonempty=True)
    # 0 is the identity, 1 masks every dim for every selection
    claim_rate: float = checked(0.1, gt=0, lt=1)
    n_seeds: int = checked(5, ge=1)
    alphas: tuple[float, ...] = checked((1.0,), ge=0, le=1)
    soft_rate: float = checked(0.1, ge=0, le=1)
    start: str = checked("ge", choices=STARTS)
    me_layer: int | None = None
    texts: str | None = None
    max_texts: int = checked(32, ge=0)
    rank_layer: int = -1
    mc: Literal["none", "claim", "all"] = "claim"
    mc_items: str | None = None
    positions: str = checked("first", choices=("first", "massive"))
    detect_tokens: int = checked(16, ge=2, also=(0,))
    batch_tokens: int = checked(1024, ge=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend == "nnsight" and self.positions != "first":
            raise ValueError(
                "positions must be 'first' with the nnsight backend (it masks position 0)"
            )

    def load_texts(self) -> list[str]:
        texts = builtin_texts() if self.texts is None else read_prompts(self.texts)
        return spread(texts, self.max_texts)

    def run_rates(self) -> list[float]:
        """The rates run: ``rates`` and ``claim_rate``, sorted."""
        return sorted({float(r) for r in self.rates} | {float(self.claim_rate)})


def conditions(cfg: Config) -> list[Condition]:
    """Every masked condition of the run, one forward each (:func:`soft.mask_conditions`)."""
    seeds = (cfg.seed, cfg.claim_rate, cfg.n_seeds)  # seed; n_seeds random seeds at claim_rate
    return soft.mask_conditions(cfg.run_rates(), cfg.variants, cfg.alphas, cfg.soft_rate, *seeds)


Row = evaluation.MaskRow


@dataclass(frozen=True)
class Result(Headed, evaluation.MaskRows):
    """What :func:`run` measured. The header's ``layer`` is the layer the masks start from (given or
    detected: :attr:`me_layer`), its ``me_layer`` and ``dims`` the detected ME layer and massive dims.
    ``baseline`` and each row of ``rows`` hold the pooled metrics, their per-text statistics and, when
    scored, the MC accuracy with per-item outcomes (read back by condition:
    :class:`~me_interp.evaluation.MaskRows`). ``not_measured``: what the backend left out."""

    header: RunHeader
    massive_at_me: bool
    start: str
    layers: list[int]
    positions: tuple[int, ...] | list[list[int]]
    rank_layer: int
    claim_rate: float
    n_seeds: int
    n_texts: int
    n_tokens: int
    n_items: int
    baseline: Metrics
    rows: list[Row]
    not_measured: str | None = None

    @property
    def me_layer(self) -> int:
        """The layer the masks start from (``start``)."""
        return int(self.header.layer)  # type: ignore[arg-type]

    @property
    def me_layer_given(self) -> bool:
        return self.header.layer_given


def run(cfg: Config, model: LoadedModel | None = None, site: None = None) -> Result:
    """Run the sweep. No printing (a tqdm bar on stderr), no files. No Site is given (``site`` is
    None): the detection prompts are cut to ``detect_tokens`` (``interventions.wemask``).

    Raises:
        NotApplicable: ``me_layer=None`` and the model has no massive activation on the prompts.
        ValueError: a layer out of range, an ME layer that leaves no layer to mask, bad texts.
    """
    model = model_for(cfg, model)
    detect = short_batch(model, cfg.load_prompts(), 0, cfg.detect_tokens)
    loc, first = locate_with_directions(model, detect)
    me = start_layer(model, cfg.me_layer, loc, len(detect))
    layers = list(mask_layers(model, cfg.start, me))
    texts = cfg.load_texts()
    positions: Any = (0,)
    if cfg.positions == "massive":
        positions = [p or [0] for p in massive_positions(model, model.tokenize(texts))]
    chunks = evaluation.length_batches(model, texts, cfg.batch_tokens)
    rank_layer = evaluation.check_rank_layer(cfg.rank_layer, model.n_layers)
    # the massive direction of each masked layer: the mean attention input at position 0
    directions = {L: first[L] for L in layers}
    conds = conditions(cfg)
    claim = Condition("wemask", "weight", cfg.claim_rate, 1.0, cfg.seed)
    swept = evaluation.sweep(
        model,
        chunks,
        layers,
        rank_layer,
        [partial(c.spec, model, layers, directions=directions) for c in conds],
        positions=positions,
        per_text=cfg.positions == "massive",
        items=evaluation.load_mc_items(cfg.mc_items) if cfg.mc != "none" else [],
        score_mc=[cfg.mc == "all" or c == claim for c in conds],
        progress=partial(terminal.bar, desc="wemask sweep"),
    )
    rows: list[Row] = []
    for c, m in zip(conds, swept.rows):
        if m is not None:  # None: a condition the model's backend does not apply
            mm = Metrics.of(m)
            shared = soft.same_forward(c, cfg.variants, cfg.alphas, cfg.soft_rate, cfg.seed)
            rows += [Row(c, mm), *(Row(x, mm, f"wemask {c.variant}") for x in shared)]
    base = Metrics.of(swept.base)
    if 0.0 in cfg.rates:  # the identity rows: the baseline, once per selection, for the figure
        rows += [
            Row(Condition("wemask", v, 0.0, 1.0, cfg.seed), base, "baseline") for v in cfg.variants
        ]
    header = replace(
        run_header(cfg, model, len(detect)),
        layer=me,
        layer_1based=me + 1,
        layer_given=cfg.me_layer is not None,
        me_layer=loc.me_layer,
        dims=tuple(loc.massive_dims),
    )
    return Result(
        header=header,
        massive_at_me=bool(loc.layer_has_massive[me]),
        start=cfg.start,
        layers=layers,
        positions=positions,
        rank_layer=rank_layer,
        claim_rate=float(cfg.claim_rate),
        n_seeds=cfg.n_seeds,
        n_texts=len(texts),
        n_tokens=int(sum(b.attention_mask.sum() for _, b in chunks)),
        n_items=swept.n_items,
        baseline=base,
        rows=rows,
        not_measured=swept.not_measured,
    )


def _where(r: Result) -> str:
    return (
        f"r = {r.claim_rate:g}, layers {r.layers[0]}..{r.layers[-1]} (ME layer {r.me_layer}, "
        f"1-based {r.me_layer + 1}), positions {positions_label(r.positions)}"
    )


def _applies(*need: tuple[Callable[[Result], Any], str]) -> Callable[[Result], str | None]:
    """``applies`` of a spec: not applicable without a massive activation at the ME layer, or when a
    row it needs was not measured (``(getter, what)`` pairs; ``what`` says why)."""

    def check(r: Result) -> str | None:
        if not r.massive_at_me:
            return (
                f"no massive activation at the ME layer {r.me_layer} of this model (given, not "
                "detected): there is no massive token whose attention input WeMask would mask"
            )
        for get, what in need:
            if get(r) is None:
                return f"not measured in this run: {what}"
        return None

    return check


def _weight(r: Result) -> Metrics | None:
    return r.metrics("wemask", "weight", r.claim_rate)


def _variant(name: str) -> Callable[[Result], Metrics | None]:
    def get(r: Result) -> Metrics | None:
        return r.metrics("wemask", name, r.claim_rate) if _weight(r) is not None else None

    return get


def _mc(r: Result) -> Metrics | None:
    return w if ((w := _weight(r)) is not None and w.per_item and r.baseline.per_item) else None


_NEED_WEIGHT = (_weight, "the weight variant was not run")
_NEED_FULL = (lambda r: r.full_row(), "r = 1 was not run (--rates)")


def _random_measure(r: Result) -> claims.Nested:
    if why := claims.too_few_seeds(len(r.random_rows(r.claim_rate)), "--n-seeds"):
        raise claims.NotApplicable(why)  # fewer than MIN_SEEDS seeds: not decided
    return claims.Nested(np.asarray(r.random_gaps().per_text, dtype=np.float64), unit="texts")


def _random_details(r: Result) -> str:
    rand, w, base = r.random_rows(r.claim_rate), _weight(r), r.baseline
    return (
        f"{_where(r)}; pooled perplexity random "
        f"[{', '.join(f'{x.metrics.perplexity:.4g}' for x in rand)}] "
        f"(seeds {[x.condition.seed for x in rand]}) vs weight {w.perplexity:.4g}, unmasked "
        f"{base.perplexity:.4g}; a seed's dim set is shared by every text (per-text, per-seed "
        "gaps: Result.random_gaps())"
    )


def _full_details(r: Result) -> str:
    full = r.full_row()
    return (
        f"layers {r.layers[0]}..{r.layers[-1]}, every dim; perplexity {r.baseline.perplexity:.4g} "
        f"→ {full.perplexity:.4g}; top-1 agreement {full.top1:.3f}; attention to position 0 "
        f"{r.baseline.sink:.3f} → {full.sink:.3f}"
    )


_VACUOUS = (
    "informative only where the full mask hurts (wemask.full_mask_collapses): on a model that does "
    "not use the massive token's attention input, every mask leaves perplexity unchanged"
)

SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "wemask.small_rate_ppl_unchanged",
        "§2 claim 5 (training-free WeMask)",
        "Weight-guided WeMask at a small rate leaves the language model's perplexity unchanged",
        "perplexity ratio − 1 (signed; judged by its size), WeMask (weight dims, r = claim rate) "
        "against the unmasked model, pooled over the texts",
        "|x|<",
        "ppl_unchanged",
        "the full mask (wemask.full_mask_collapses) and the random / magnitude dims at the same "
        f"rate (wemask.beats_random, wemask.beats_magnitude); {_VACUOUS}",
        stat=lambda r: claims.Sample(
            evaluation.nll_columns(r.baseline, _weight(r)), evaluation.PPL_CHANGE
        ),
        unit="texts",
        applies=_applies(_NEED_WEIGHT),
        details=lambda r: (
            f"{_where(r)}; perplexity {r.baseline.perplexity:.4g} → "
            f"{_weight(r).perplexity:.4g} over {r.n_texts} texts "
            f"({int(sum(r.baseline.per_text.n_pred))} predictions); KL "
            f"{_weight(r).kl:.3g} nats, top-1 agreement {_weight(r).top1:.3f}"
        ),
    ),
    claims.Spec(
        "wemask.small_rate_mc_unchanged",
        "§2 claim 5 (training-free WeMask)",
        "Weight-guided WeMask at a small rate leaves multiple-choice accuracy unchanged",
        "MC accuracy ratio − 1 (signed; judged by its size), WeMask (weight dims, r = claim rate) "
        "against the unmasked model, paired over items",
        "|x|<",
        "mc_unchanged",
        "the unmasked model on the same items (paired); when no item changes its answer the "
        "interval has zero width and the claim is not decided (the items bound the change only "
        "through their number)",
        stat=lambda r: claims.Sample(
            np.column_stack([r.baseline.per_item.correct, _mc(r).per_item.correct]).astype(
                np.float64
            ),
            evaluation.ratio_change,
            keys=range(r.n_items),  # every item is its own measurement
        ),
        unit="items",
        applies=_applies(_NEED_WEIGHT, (_mc, "MC items not scored (--mc none)")),
        details=lambda r: (
            f"{_where(r)}; accuracy {r.baseline.mc_accuracy:.3f} → "
            f"{_mc(r).mc_accuracy:.3f} on {r.n_items} items; "
            f"{sum(a != b for a, b in zip(r.baseline.per_item.correct, _mc(r).per_item.correct))} "
            "items change their outcome"
        ),
    ),
    claims.Spec(
        "wemask.beats_random",
        "§2 claim 5 (ablation: random dims)",
        "Random dims masked at the same rate hurt more than the weight-selected dims (by more than "
        "the perplexity change called 'unchanged')",
        "(perplexity with random dims − perplexity with weight dims) / unmasked perplexity, per "
        "text and random seed (each text's own perplexity), mean over texts × seeds at the claim "
        "rate",
        ">",
        "ppl_unchanged",
        "random dim sets of the same size, one per seed, shared by every text (two-way crossed "
        "bootstrap over texts and seeds)",
        stat=_random_measure,
        unit="texts",
        applies=_applies(
            _NEED_WEIGHT,
            (lambda r: r.random_rows(r.claim_rate) or None, "the random variant was not run"),
        ),
        details=_random_details,
    ),
    claims.Spec(
        "wemask.beats_magnitude",
        "§2 claim 5 (ablation: magnitude dims)",
        "Dims selected by the massive token's residual magnitude, masked at the same rate, hurt more "
        "than the weight-selected dims (by more than the perplexity change called 'unchanged')",
        "(perplexity with magnitude dims − perplexity with weight dims) / unmasked perplexity, per "
        "text (each text's own perplexity), mean over texts at the claim rate",
        ">",
        "ppl_unchanged",
        "the weight-selected WeMask on the same texts (paired)",
        stat=lambda r: claims.Sample(
            evaluation.text_gap(_variant("magnitude")(r), _weight(r), r.baseline)
        ),
        unit="texts",
        applies=_applies(
            _NEED_WEIGHT, (_variant("magnitude"), "the magnitude or weight variant was not run")
        ),
        details=lambda r: (
            f"{_where(r)}; pooled perplexity magnitude {_variant('magnitude')(r).perplexity:.4g} "
            f"vs weight {_weight(r).perplexity:.4g}, unmasked {r.baseline.perplexity:.4g}"
        ),
    ),
    claims.Spec(
        "wemask.activation_like_weight",
        "§4 (released code selects by activation)",
        "The released code's activation-selected dims behave like the paper's weight-selected dims",
        "perplexity(activation dims) / perplexity(weight dims) − 1 (signed; judged by its size) at "
        "the claim rate, pooled over the texts",
        "|x|<",
        "ppl_unchanged",
        f"the weight-selected WeMask on the same texts (paired); {_VACUOUS}",
        stat=lambda r: claims.Sample(
            evaluation.nll_columns(_weight(r), _variant("activation")(r)), evaluation.PPL_CHANGE
        ),
        unit="texts",
        applies=_applies(
            _NEED_WEIGHT, (_variant("activation"), "the activation or weight variant was not run")
        ),
        details=lambda r: (
            f"{_where(r)}; perplexity activation {_variant('activation')(r).perplexity:.4g} vs "
            f"weight {_weight(r).perplexity:.4g}; KL {_variant('activation')(r).kl:.3g} vs "
            f"{_weight(r).kl:.3g} nats"
        ),
    ),
    claims.Spec(
        "wemask.full_mask_collapses",
        "§2 claim 5 (r = 1.0 collapses)",
        "Masking the whole attention input of the massive token (r = 1) collapses the model",
        "perplexity ratio at r = 1 against the unmasked model, pooled over the texts",
        ">=",
        "ppl_damage",
        "the small-rate WeMask (wemask.small_rate_ppl_unchanged)",
        stat=lambda r: claims.Sample(
            evaluation.nll_columns(r.baseline, r.full_row()), evaluation.PPL_RATIO
        ),
        unit="texts",
        applies=_applies(_NEED_FULL),
        details=_full_details,
    ),
    claims.Spec(
        "wemask.full_mask_removes_sink",
        "§2 claims 4, 6 (the massive token is the sink)",
        "Masking the massive token's whole attention input lowers the attention sink on it in the "
        "masked layers (nearly true by construction: its key and value are then computed from "
        "zeros in the very layers measured; a sanity check, not evidence)",
        "relative drop of the attention to position 0 in the masked layers at r = 1: "
        "1 − sink(r = 1) / sink(unmasked)",
        ">=",
        "relative_drop",
        "the unmasked model on the same texts (paired)",
        kind="sanity",
        stat=lambda r: claims.Sample(
            np.column_stack([r.baseline.per_text.sink, r.full_row().per_text.sink]),
            evaluation.sink_drop,
        ),
        unit="texts",
        applies=_applies(_NEED_FULL),
        details=lambda r: (
            f"attention to position 0 in layers {r.layers[0]}..{r.layers[-1]}: "
            f"{r.baseline.sink:.3f} → {r.full_row().sink:.3f}"
        ),
    ),
)
claims.check_specs(SPECS)


def figures(result: Result) -> dict[str, go.Figure]:
    metrics = [m for m in (*METRICS, "mc_accuracy") if getattr(result.baseline, m) is not None]
    variants = [v for v in VARIANTS if any(r.condition.variant == v for r in result.rows)]
    titles = evaluation.METRIC_TITLES
    log = {titles["perplexity"]}
    rate_fig = plotting.panel_lines(
        {titles[m]: {v: result.rate_curve(v, m) for v in variants} for m in metrics},
        "mask rate r",
        f"WeMask mask-rate study — {result.model}<br><sup>masked positions: "
        f"{positions_label(result.positions)}; layers {result.layers[0]}..{result.layers[-1]} (ME layer "
        f"{result.me_layer}, start '{result.start}'); {result.n_texts} texts</sup>",
        log,
    )
    rand = result.random_rows(result.claim_rate)
    for i, m in enumerate(metrics):
        if m in METRICS and len(rand) > 1:
            seeds = go.Scatter(
                x=[result.claim_rate] * len(rand),
                y=[getattr(r.metrics, m) for r in rand],
                mode="markers",
                marker={"color": "gray", "symbol": "circle-open"},
                name="random, each seed",
                legendgroup="seeds",
                showlegend=i == 0,
            )
            rate_fig.add_trace(seeds, row=i // 3 + 1, col=i % 3 + 1)
    kinds = [
        k
        for k in ("dim_projection", "direction_projection")
        if any(r.condition.kind == k for r in result.rows)
    ]
    soft_fig = plotting.panel_lines(
        {titles[m]: {k: result.alpha_curve(k, m) for k in kinds} for m in metrics},
        "α",
        f"Soft alternatives: h − α P_S h (weight dims) and h − α proj_v h — {result.model}",
        log,
    )
    return {"mask_rate": rate_fig, "soft_alpha": soft_fig}


def summary(result: Result) -> str:
    head = (
        f"model: {result.model}   ME layer {result.me_layer} (1-based {result.me_layer + 1}); masked "
        f"layers {result.layers[0]}..{result.layers[-1]} at positions {positions_label(result.positions)}; "
        f"{result.n_texts} texts, {result.n_tokens} tokens; {result.n_items} MC items; claims at "
        f"r = {result.claim_rate:g}"
    )
    return "\n".join([head, "", result.table()])


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("mask_rate",)
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
