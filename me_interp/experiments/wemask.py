"""The mask-rate study: WeMask and its alternatives against rate r and strength α, with claims.

For every mask rate ``r ∈ rates`` and dim selection (``weight`` = the paper's text, ``activation`` = the
released code, ``random`` and ``magnitude`` = the paper's ablations), and for the soft alternatives
(``h − α P_S h`` on the ``weight`` dims at ``soft_rate``; ``h − α (⟨h,v⟩/‖v‖²) v`` with ``v`` the
mean massive attention input of the prompts), it masks the massive token's attention input (position
0) in layers from the measured ME layer (``start="ge"``: ≥ ME, ``"gt"``: > ME) to the last, and
measures on the shipped texts, in one forward per condition:

* perplexity, next-token ``KL(p_ref ‖ p_int)`` and top-1 agreement with the unmodified model, kept
  per text (NLL and KL sums, counts) and pooled: ``ppl = exp(Σ_b nll_b / Σ_b n_b)``;
* attention to the sink (position 0) and attention entropy: per text and head the mean over real
  queries ``q ≥ 1``, then the mean over heads and masked layers (per text), then over texts;
* effective rank ``exp(−Σ p_i log p_i)``, ``p = σ / Σσ`` (singular values of the token states
  ``t ≥ 1`` of each text at ``rank_layer``), per text;
* multiple-choice log-likelihood accuracy on the shipped items, per item (``mc="claim"``: at the
  baseline and for the claim's WeMask; ``"all"``: every condition; ``"none"``).

The ``random`` selection is drawn with ``n_seeds`` seeds at ``claim_rate`` (one seed at the other
rates). ``r = 0`` and ``α = 0`` are the identity (tested bit-identical), so those rows are the
baseline; at ``r = 1`` every selection masks every dim, so that forward is run once and shared.

Claims (:data:`SPECS`, declarations judged by :func:`me_interp.claims.judge`; thresholds from
:data:`me_interp.claims.THRESHOLDS`): ratios of pooled perplexities are bootstrapped over texts (the
rows of a text stay paired across conditions) and MC accuracies over items; the two "hurts more than
the weight dims" comparisons use each text's own perplexity, ``(ppl_x − ppl_weight) / ppl_unmasked``
per text, and the random-dims one is a two-way (crossed) bootstrap over texts × seeds
(:class:`me_interp.claims.Nested`; the per-text, per-seed gaps are in the result as
``random_dims_gap``). ``full_mask_removes_sink`` is a sanity check (the masked key is computed from
zeros). The "unchanged" claims are informative only where the full mask hurts: on a model that does not
use the massive token's attention input (the planted model's random language model) every mask leaves
perplexity unchanged. On a model without a massive activation (and no ``me_layer`` given) :func:`run`
raises :class:`me_interp.claims.NotApplicable`.

    python -m me_interp.experiments.wemask                     # bundled model, about a minute on a CPU
    python -m me_interp.experiments.wemask --model synthetic:planted --rates 0 0.5 1
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from me_interp import claims, evaluation, names, terminal
from me_interp.backends import check_backend
from me_interp.experiments._weights import short_batch, spread
from me_interp.interventions import core
from me_interp.interventions.soft import DirectionProjection, dim_projection
from me_interp.interventions.wemask import (
    STARTS,
    VARIANTS,
    WeMask,
    mask_layers,
    massive_positions,
    no_massive_activation,
)
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes import Activations, find_me_layer
from me_interp.probes.batching import Chunk, Prefix, capture_prefix
from me_interp.probes.massive import locate_me_layer
from me_interp.prompts import builtin_texts, read_prompts
from me_interp.study import INDEX_CONVENTION, CommonConfig, Experiment, command, model_for
from me_interp.terminal import fmt_table

NAME = "wemask"
METRICS = evaluation.POOLED_METRICS
PER_TEXT = evaluation.TEXT_STATS
MC_MODES = ("none", "claim", "all")
METRIC_TITLES = {
    "perplexity": "perplexity (shipped texts)",
    "kl": "next-token KL to the unmodified model (nats)",
    "top1": "top-1 agreement with the unmodified model",
    "sink": "attention to position 0 (masked layers)",
    "entropy": "attention entropy (nats, masked layers)",
    "eff_rank": "effective rank of token states",
    "mc_accuracy": "MC accuracy (shipped items)",
}


@dataclass(frozen=True)
class Config(CommonConfig):
    """Mask-rate study settings.

    Attributes:
        rates: mask rates r ∈ [0, 1] of the sweep (``claim_rate`` is always run too).
        variants: dim selections (``weight``, ``activation``, ``random``, ``magnitude``).
        claim_rate: the rate the claims are judged at (the paper's training-free r = 0.1), in (0, 1).
        n_seeds: seeds of the ``random`` selection at ``claim_rate`` (``seed, seed+1, …``; the
            random-dims claim needs at least 5).
        alphas: strengths α ∈ [0, 1] of the soft alternatives (empty: skip them; the default α = 1
            costs one forward: the dim projection at α = 1 is the WeMask ``weight`` row).
        soft_rate: rate of the ``weight`` dim set of the soft dim projection.
        start: ``ge`` (layers ≥ ME, the paper) or ``gt`` (layers > ME).
        me_layer: the ME layer (0-based); measured on the prompts when ``None``.
        texts: text file (one text per line) for the metrics; ``None``: the shipped texts.
        max_texts: use this many texts, spread evenly over the file (``0`` = all). Every condition
            costs a forward over them, so the default subsamples the shipped set to 32 (the result
            reports ``n_texts``); the claims' intervals are over texts, so keep at least 32.
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

    rates: tuple[float, ...] = (0.0, 0.1, 1.0)
    variants: tuple[str, ...] = VARIANTS
    claim_rate: float = 0.1
    n_seeds: int = 5
    alphas: tuple[float, ...] = (1.0,)
    soft_rate: float = 0.1
    start: str = "ge"
    me_layer: int | None = None
    texts: str | None = None
    max_texts: int = 32
    rank_layer: int = -1
    mc: Literal["none", "claim", "all"] = "claim"
    mc_items: str | None = None
    positions: str = "first"
    detect_tokens: int = 16
    batch_tokens: int = 1024
    backend: Literal["tl", "nnsight"] = "tl"
    remote: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_backend(self.backend, self.remote)
        if self.backend == "nnsight" and self.positions != "first":
            raise ValueError(
                "positions must be 'first' with the nnsight backend (it masks position 0)"
            )
        if not self.rates:
            raise ValueError("give at least one rate")
        for r in self.rates:
            core.check_fraction(r, "rate")
        core.check_fraction(self.claim_rate, "claim_rate")
        if not 0 < self.claim_rate < 1:
            raise ValueError(
                f"claim_rate must lie strictly between 0 and 1 (0 is the identity, 1 masks every "
                f"dim for every selection), got {self.claim_rate}"
            )
        for a in self.alphas:
            core.check_fraction(a, "alpha")
        core.check_fraction(self.soft_rate, "soft_rate")
        if not self.variants:
            raise ValueError("give at least one variant")
        for v in self.variants:
            if v not in VARIANTS:
                raise ValueError(f"unknown variant {v!r}; choose from {VARIANTS}")
        if self.start not in STARTS:
            raise ValueError(f"start must be one of {STARTS}, got {self.start!r}")
        if self.positions not in ("first", "massive"):
            raise ValueError(f"positions must be 'first' or 'massive', got {self.positions!r}")
        if self.mc not in MC_MODES:
            raise ValueError(f"mc must be one of {MC_MODES}, got {self.mc!r}")
        if self.n_seeds < 1:
            raise ValueError(f"n_seeds must be >= 1, got {self.n_seeds}")
        if self.max_texts < 0:
            raise ValueError(f"max_texts must be >= 0 (0 = all), got {self.max_texts}")
        if self.detect_tokens != 0 and self.detect_tokens < 2:
            raise ValueError(
                f"detect_tokens must be >= 2 (or 0 = no cut), got {self.detect_tokens}"
            )
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {self.batch_tokens}")

    def load_texts(self) -> list[str]:
        texts = builtin_texts() if self.texts is None else read_prompts(self.texts)
        return spread(texts, self.max_texts)

    def run_rates(self) -> list[float]:
        """The rates run: ``rates`` and ``claim_rate``, sorted."""
        return sorted({float(r) for r in self.rates} | {float(self.claim_rate)})


# ------------------------------------------------------------------------------------------
# the conditions: one forward each over the texts (evaluation.text_metrics)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    """One masked condition: ``kind`` ∈ {wemask, dim_projection, direction_projection}."""

    kind: str
    variant: str
    rate: float
    alpha: float = 1.0
    seed: int = 0

    def label(self) -> str:
        if self.kind == "wemask":
            tail = f" seed {self.seed}" if self.variant == "random" else ""
            return f"wemask {self.variant} r={self.rate:g}{tail}"
        if self.kind == "dim_projection":
            return f"dim_projection r={self.rate:g} α={self.alpha:g}"
        return f"direction_projection α={self.alpha:g}"


def conditions(cfg: Config) -> list[Condition]:
    """Every masked condition of the run, without duplicates: one ``r = 1`` forward for all selections
    (they coincide), ``n_seeds`` random seeds at ``claim_rate``, and the soft alternatives (the dim
    projection at α = 1 *is* WeMask ``weight`` at ``soft_rate``, so it is run only when that WeMask is
    not)."""
    rates = [r for r in cfg.run_rates() if r > 0]
    out: list[Condition] = []
    for r in rates:
        if r == 1.0:
            out.append(Condition("wemask", cfg.variants[0], 1.0, 1.0, cfg.seed))
            continue
        for v in cfg.variants:
            n = cfg.n_seeds if (v == "random" and r == cfg.claim_rate) else 1
            out += [Condition("wemask", v, r, 1.0, cfg.seed + i) for i in range(n)]
    have_weight = "weight" in cfg.variants and cfg.soft_rate in rates
    for a in cfg.alphas:
        if a > 0 and not (a == 1.0 and have_weight):
            out.append(Condition("dim_projection", "weight", cfg.soft_rate, a, cfg.seed))
    out += [
        Condition("direction_projection", "mean_direction", 0.0, a, cfg.seed)
        for a in cfg.alphas
        if a > 0
    ]
    return out


def _spec(model, cond: Condition, layers, positions, directions) -> Any:
    if cond.kind == "wemask":
        return WeMask.build(model, layers, cond.rate, cond.variant, positions, seed=cond.seed)
    if cond.kind == "dim_projection":
        return dim_projection(
            model, cond.alpha, layers, variant=cond.variant, rate=cond.rate, positions=positions
        )
    return DirectionProjection.build(model, cond.alpha, directions, layers, positions=positions)


# ------------------------------------------------------------------------------------------
# result
# ------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What :func:`run` measured. ``baseline`` and each row of ``rows`` hold the pooled metrics, their
    ``per_text`` statistics (:data:`PER_TEXT`, in the order of the texts) and, when scored, the MC
    accuracy with ``per_item`` outcomes."""

    model: str
    bos: str
    me_layer: int
    me_layer_given: bool
    massive_at_me: bool
    start: str
    layers: list[int]
    rank_layer: int
    claim_rate: float
    n_seeds: int
    seed: int
    n_texts: int
    n_tokens: int
    n_items: int
    detection: dict[str, Any]
    baseline: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    positions: Any = (0,)

    def row(
        self, kind: str, variant: str, rate: float, alpha: float = 1.0, seed: int | None = None
    ) -> dict | None:
        """The row of one condition (``seed=None``: the run's own seed)."""
        seed = self.seed if seed is None else seed
        for r in self.rows:
            if (
                (r["kind"], r["variant"]) == (kind, variant)
                and math.isclose(r["rate"], rate)
                and math.isclose(r["alpha"], alpha)
                and r["seed"] == seed
            ):
                return r
        return None

    def random_rows(self, rate: float) -> list[dict[str, Any]]:
        """Every seed's ``random`` row at ``rate``."""
        return [
            r
            for r in self.rows
            if r["kind"] == "wemask" and r["variant"] == "random" and math.isclose(r["rate"], rate)
        ]

    def full_row(self) -> dict[str, Any] | None:
        """The ``r = 1`` forward (the one row every selection shares), or ``None`` when not run."""
        return next(
            (
                r
                for r in self.rows
                if r["kind"] == "wemask" and r["rate"] == 1.0 and "same_as" not in r
            ),
            None,
        )

    def random_gaps(self) -> dict[str, Any]:
        """What ``wemask.beats_random`` is judged on: per text and random seed at ``claim_rate``,
        ``(ppl_random − ppl_weight) / ppl_unmasked`` of the text's own perplexities
        (:func:`text_gap`): ``{"seeds": [...], "per_text": [[gap of seed s] per text]}`` (empty
        when the weight or random selection was not run)."""
        w, rand = self.row("wemask", "weight", self.claim_rate), self.random_rows(self.claim_rate)
        if w is None or not rand:
            return {"seeds": [], "per_text": []}
        gaps = np.column_stack([text_gap(r, w, self.baseline) for r in rand])  # [text seed]
        return {"seeds": [r["seed"] for r in rand], "per_text": gaps.tolist()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "bos": self.bos,
            "index_convention": INDEX_CONVENTION,
            "me_layer": self.me_layer,
            "me_layer_1based": self.me_layer + 1,
            "me_layer_given": self.me_layer_given,
            "massive_at_me_layer": self.massive_at_me,
            "start": self.start,
            "masked_layers": self.layers,
            "masked_positions": self.positions,
            "rank_layer": self.rank_layer,
            "claim_rate": self.claim_rate,
            "n_seeds": self.n_seeds,
            "seed": self.seed,
            "n_texts": self.n_texts,
            "n_tokens": self.n_tokens,
            "n_items": self.n_items,
            "detection": self.detection,
            "baseline": self.baseline,
            "table": self.rows,
            "random_dims_gap": self.random_gaps(),
        }


@dataclass
class _Sweep:
    """What every condition of a run shares: the texts in length groups, the masked layers, the
    massive directions, the positions to mask and the MC items."""

    cfg: Config
    model: LoadedModel
    layers: list[int]
    rank_layer: int
    chunks: list[tuple[list[int], Batch]]
    n_texts: int
    positions: Any
    directions: dict[int, torch.Tensor]
    items: list[evaluation.MCItem]
    prefixes: list[Prefix | None] | None = None
    """Per text batch, the unmasked model's block inputs (``probes.batching.capture_prefix``): a
    condition then runs from the first masked block (the blocks before are the unmasked model's)."""

    def _positions(self, idx: list[int]) -> Any:
        per_text = self.cfg.positions == "massive"
        return [self.positions[i] for i in idx] if per_text else self.positions

    def _scores_mc(self, cond: Condition | None) -> bool:
        if not self.items:
            return False
        claim = Condition("wemask", "weight", self.cfg.claim_rate, 1.0, self.cfg.seed)
        return cond is None or self.cfg.mc == "all" or cond == claim

    def measure(
        self, cond: Condition | None, refs: list[evaluation.Reference] | None
    ) -> tuple[dict[str, Any], list[evaluation.Reference | None]]:
        """The pooled metrics, ``per_text`` statistics and (when scored) MC outcomes of ``cond``
        (``None``: the unmasked model, whose references are returned for the others)."""
        per_text: dict[str, list[float]] = {k: [math.nan] * self.n_texts for k in PER_TEXT}
        own = []
        for c, (idx, batch) in enumerate(self.chunks):
            hooks = []
            if cond is not None:
                spec = _spec(self.model, cond, self.layers, self._positions(idx), self.directions)
                hooks = core.tl_hooks(spec)
            ref = None if refs is None else refs[c]
            prefix = None if self.prefixes is None else self.prefixes[c]
            stats, r = evaluation.text_metrics(
                self.model,
                batch,
                hooks,
                self.layers,
                self.rank_layer,
                ref,
                prefix,
                min(self.layers),
            )
            for k, vals in stats.items():
                for i, v in zip(idx, vals):
                    per_text[k][i] = v
            own.append(r)
        out: dict[str, Any] = {**evaluation.pooled_metrics(per_text), "per_text": per_text}
        if self._scores_mc(cond):  # MC rows start at the first token: position 0
            hooks = []
            if cond is not None:
                hooks = core.tl_hooks(_spec(self.model, cond, self.layers, (0,), self.directions))
            mc = evaluation.score_choices(self.model, self.items, hooks)
            out["mc_accuracy"] = mc.accuracy
            out["per_item"] = {"correct": mc.correct, "correct_norm": mc.correct_norm}
        return out, own


def _rows(cfg: Config, cond: Condition, m: dict[str, Any]) -> list[dict[str, Any]]:
    """The table rows one forward stands for: ``cond`` itself, every other selection at ``r = 1``, and
    the dim projection at ``α = 1`` for WeMask ``weight`` at ``soft_rate`` (marked ``same_as``)."""
    rows = [{**_cond_dict(cond), **m}]
    if cond.kind != "wemask":
        return rows
    if cond.rate == 1.0:
        for v in cfg.variants[1:]:
            same = Condition("wemask", v, 1.0, 1.0, cfg.seed)
            rows.append({**_cond_dict(same), **m, "same_as": f"wemask {cond.variant}"})
    is_weight = cond.variant == "weight" or cond.rate == 1.0  # r = 1: every selection
    if is_weight and cond.rate == cfg.soft_rate and 1.0 in cfg.alphas:
        alias = Condition("dim_projection", "weight", cfg.soft_rate, 1.0, cfg.seed)
        rows.append({**_cond_dict(alias), **m, "same_as": f"wemask {cond.variant}"})
    return rows


def _check_rank_layer(layer: int, n_layers: int) -> int:
    """``rank_layer`` as a 0-based layer (negative: from the end), or ``ValueError``."""
    if not -n_layers <= layer < n_layers:
        raise ValueError(
            f"rank_layer {layer} is out of range: this model has {n_layers} layers "
            f"(0..{n_layers - 1}, or -{n_layers}..-1 from the end)"
        )
    return layer % n_layers


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Run the sweep. No printing (a tqdm bar on stderr), no files.

    Raises:
        NotApplicable: ``me_layer=None`` and the model has no massive activation on the prompts.
        ValueError: a layer out of range, an ME layer that leaves no layer to mask, bad texts.
    """
    model = model_for(cfg, model)
    if cfg.backend == "nnsight":
        return _run_nnsight(cfg, model)
    detect = short_batch(model, cfg.load_prompts(), 0, cfg.detect_tokens)
    # the attention input of the token at position 0, in the ME-layer probe's forward
    first = Activations(model, detect, [names.attn_in(L) for L in range(model.n_layers)], at=0)
    loc = find_me_layer(model, detect, fwd_hooks=first.hooks(Chunk.whole(detect)))
    me = _me_layer(cfg, model, loc, len(detect))
    layers = list(mask_layers(model, cfg.start, me))
    texts = cfg.load_texts()
    positions: Any = (0,)
    if cfg.positions == "massive":
        positions = [p or [0] for p in massive_positions(model, model.tokenize(texts))]
    sweep = _Sweep(
        cfg=cfg,
        model=model,
        layers=layers,
        rank_layer=_check_rank_layer(cfg.rank_layer, model.n_layers),
        chunks=evaluation.length_batches(model, texts, cfg.batch_tokens),
        n_texts=len(texts),
        positions=positions,
        # the massive direction of each masked layer: the mean attention input at position 0
        directions={L: first[names.attn_in(L)].float().cpu().mean(0) for L in layers},
        items=evaluation.load_mc_items(cfg.mc_items) if cfg.mc != "none" else [],
    )
    base, refs = sweep.measure(None, None)
    start = min(layers)
    if 0 < start <= sweep.rank_layer:  # the masks change nothing before the first masked layer
        sweep.prefixes = [
            capture_prefix(model, b, [start], max_tokens=None) for _, b in sweep.chunks
        ]
    rows: list[dict[str, Any]] = []
    for cond in terminal.bar(conditions(cfg), desc="wemask sweep"):
        rows += _rows(cfg, cond, sweep.measure(cond, refs)[0])
    return _result(
        cfg, model, loc, me, layers, sweep.rank_layer, len(texts), sweep.chunks, len(sweep.items),
        {"n_prompts": len(detect)}, base, rows, positions,
    )  # fmt: skip


def _me_layer(cfg: Config, model: Any, loc: Any, n_prompts: int) -> int:
    """The layer the masks start from: ``cfg.me_layer`` when given (checked), else the detected ME
    layer (``NotApplicable`` when there is none)."""
    if cfg.me_layer is not None:
        return model.check_layer(cfg.me_layer)
    if loc.me_layer is None:
        raise no_massive_activation(model, n_prompts)
    return int(loc.me_layer)


def _result(
    cfg: Config,
    model: Any,
    loc: Any,
    me: int,
    layers: list[int],
    rank_layer: int,
    n_texts: int,
    chunks: list[tuple[list[int], Batch]],
    n_items: int,
    detection: dict[str, Any],
    base: dict[str, Any],
    rows: list[dict[str, Any]],
    positions: Any,
) -> Result:
    """The :class:`Result` of a sweep, with the identity rows (``r = 0``: the baseline, once per
    selection, for the sweep figure) added when ``0`` is among the rates."""
    if 0.0 in cfg.rates:
        for v in cfg.variants:
            zero = Condition("wemask", v, 0.0, 1.0, cfg.seed)
            rows.append({**_cond_dict(zero), **base, "same_as": "baseline"})
    return Result(
        model=model.name,
        bos=model.bos,
        me_layer=me,
        me_layer_given=cfg.me_layer is not None,
        massive_at_me=bool(loc.layer_has_massive[me]),
        start=cfg.start,
        layers=layers,
        rank_layer=rank_layer,
        claim_rate=float(cfg.claim_rate),
        n_seeds=cfg.n_seeds,
        seed=cfg.seed,
        n_texts=n_texts,
        n_tokens=int(sum(b.attention_mask.sum() for _, b in chunks)),
        n_items=n_items,
        detection={
            **detection,
            "max_tokens": cfg.detect_tokens,
            "me_layer_detected": loc.me_layer,
            "massive_dims": loc.massive_dims,
        },
        baseline=base,
        rows=rows,
        positions=positions,
    )


def _run_nnsight(cfg: Config, model: Any) -> Result:
    """:func:`run` on the nnsight backend: the ME layer from its scan, then every WeMask condition
    (``conditions(cfg)`` without the soft alternatives) and the unmasked model over the texts in one
    session (:func:`me_interp.backends.nnsight.text_stats`); per-text statistics without KL and top-1
    agreement (NaN), no MC items."""
    from me_interp.backends import nnsight

    detect = short_batch(model, cfg.load_prompts(), 0, cfg.detect_tokens)
    loc = locate_me_layer(nnsight.scan_norms(model, detect))
    me = _me_layer(cfg, model, loc, len(detect))
    layers = list(mask_layers(model.hf, cfg.start, me))
    texts = cfg.load_texts()
    groups = evaluation.length_batches(model, texts, cfg.batch_tokens)
    rank_layer = _check_rank_layer(cfg.rank_layer, model.n_layers)
    conds = [c for c in conditions(cfg) if c.kind == "wemask"]
    specs = nnsight.mask_specs(model, layers, [(c.variant, c.rate, c.seed) for c in conds])
    stats = nnsight.text_stats(model, groups, [None, *specs], layers, rank_layer)

    def measured(per_text: dict[str, list[float]]) -> dict[str, Any]:
        return {**evaluation.pooled_metrics(per_text), "per_text": per_text}

    base = measured(stats[0])
    rows: list[dict[str, Any]] = []
    for cond, st in zip(conds, stats[1:]):
        rows += _rows(cfg, cond, measured(st))
    detection = {
        "n_prompts": len(detect),
        "backend": "nnsight",
        "not_measured": "kl, top1 (no reference distributions leave the trace), MC items, "
        "soft alternatives",
    }
    return _result(
        cfg, model, loc, me, layers, rank_layer, len(texts), groups, 0, detection, base, rows, (0,)
    )


def _cond_dict(c: Condition) -> dict[str, Any]:
    return {"kind": c.kind, "variant": c.variant, "rate": c.rate, "alpha": c.alpha, "seed": c.seed}


# ------------------------------------------------------------------------------------------
# claims: declarations judged by claims.judge (common.execute)
# ------------------------------------------------------------------------------------------


def _where(r: Result) -> str:
    return (
        f"r = {r.claim_rate:g}, layers {r.layers[0]}..{r.layers[-1]} (ME layer {r.me_layer}, "
        f"1-based {r.me_layer + 1}), positions {_pos_label(r.positions)}"
    )


def _cols(*rows: dict[str, Any], key: str = "nll") -> np.ndarray:
    """``[text, 1 + len(rows)]``: the prediction count, then ``key`` of each row, per text."""
    n = np.asarray(rows[0]["per_text"]["n_pred"], dtype=np.float64)
    return np.column_stack([n, *(np.asarray(r["per_text"][key], dtype=np.float64) for r in rows)])


@claims.of_means
def _sink_drop(m: np.ndarray) -> np.ndarray | float:
    """``1 − mean(column 1) / mean(column 0)``, NaN when the base is not positive."""
    return 1.0 - claims.divide(m[..., 1], m[..., 0], m[..., 0] > 0)


@claims.of_means
def _acc_dev(m: np.ndarray) -> np.ndarray | float:
    """``mean(column 1) / mean(column 0) − 1``, NaN when the base is not positive."""
    return claims.divide(m[..., 1], m[..., 0], m[..., 0] > 0) - 1.0


def text_perplexity(row: dict[str, Any]) -> np.ndarray:
    """``[text]``: each text's own perplexity ``exp(nll_b / n_b)`` (NaN for a text without a
    prediction)."""
    nll = np.asarray(row["per_text"]["nll"], dtype=np.float64)
    n = np.asarray(row["per_text"]["n_pred"], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, np.exp(nll / np.where(n > 0, n, 1.0)), np.nan)


def text_gap(row: dict[str, Any], weight: dict[str, Any], base: dict[str, Any]) -> np.ndarray:
    """``[text]``: ``(ppl_x − ppl_weight) / ppl_unmasked`` of each text (its own perplexities): how much
    more the selection of ``row`` hurts than the weight selection, in units of the unmasked model."""
    return (text_perplexity(row) - text_perplexity(weight)) / text_perplexity(base)


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


def _weight(r: Result) -> dict | None:
    return r.row("wemask", "weight", r.claim_rate)


def _variant(name: str) -> Callable[[Result], dict | None]:
    def get(r: Result) -> dict | None:
        return r.row("wemask", name, r.claim_rate) if _weight(r) is not None else None

    return get


def _mc(r: Result) -> dict | None:
    w = _weight(r)
    return w if (w is not None and "per_item" in w and "per_item" in r.baseline) else None


def _seeds(r: Result) -> list | None:
    rand = r.random_rows(r.claim_rate)
    if _weight(r) is None or not rand:
        return None
    if why := claims.too_few_seeds(len(rand), "--n-seeds"):
        raise claims.NotApplicable(why)
    return rand


_NEED_WEIGHT = (_weight, "the weight variant was not run")
_NEED_FULL = (lambda r: r.full_row(), "r = 1 was not run (--rates)")


def _random_measure(r: Result) -> claims.Nested:
    _seeds(r)  # raises NotApplicable with fewer than MIN_SEEDS seeds
    return claims.Nested(np.asarray(r.random_gaps()["per_text"], dtype=np.float64), unit="texts")


def _random_details(r: Result) -> str:
    rand, w, base = r.random_rows(r.claim_rate), _weight(r), r.baseline
    return (
        f"{_where(r)}; pooled perplexity random {_fmt_list(x['perplexity'] for x in rand)} (seeds "
        f"{[x['seed'] for x in rand]}) vs weight {w['perplexity']:.4g}, unmasked "
        f"{base['perplexity']:.4g}; a seed's dim set is shared by every text (per-text, per-seed "
        "gaps in the result's random_dims_gap)"
    )


def _full_details(r: Result) -> str:
    full = r.full_row()
    return (
        f"layers {r.layers[0]}..{r.layers[-1]}, every dim; perplexity {r.baseline['perplexity']:.4g} "
        f"→ {full['perplexity']:.4g}; top-1 agreement {full['top1']:.3f}; attention to position 0 "
        f"{r.baseline['sink']:.3f} → {full['sink']:.3f}"
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
        stat=lambda r: claims.Sample(_cols(r.baseline, _weight(r)), evaluation.PPL_CHANGE),
        unit="texts",
        applies=_applies(_NEED_WEIGHT),
        details=lambda r: (
            f"{_where(r)}; perplexity {r.baseline['perplexity']:.4g} → "
            f"{_weight(r)['perplexity']:.4g} over {r.n_texts} texts "
            f"({int(sum(r.baseline['per_text']['n_pred']))} predictions); KL "
            f"{_weight(r)['kl']:.3g} nats, top-1 agreement {_weight(r)['top1']:.3f}"
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
            np.column_stack(
                [r.baseline["per_item"]["correct"], _mc(r)["per_item"]["correct"]]
            ).astype(np.float64),
            _acc_dev,
            keys=range(r.n_items),  # every item is its own measurement
        ),
        unit="items",
        applies=_applies(_NEED_WEIGHT, (_mc, "MC items not scored (--mc none)")),
        details=lambda r: (
            f"{_where(r)}; accuracy {r.baseline['mc_accuracy']:.3f} → "
            f"{_mc(r)['mc_accuracy']:.3f} on {r.n_items} items; "
            f"{sum(a != b for a, b in zip(r.baseline['per_item']['correct'], _mc(r)['per_item']['correct']))} "
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
        stat=lambda r: claims.Sample(text_gap(_variant("magnitude")(r), _weight(r), r.baseline)),
        unit="texts",
        applies=_applies(
            _NEED_WEIGHT, (_variant("magnitude"), "the magnitude or weight variant was not run")
        ),
        details=lambda r: (
            f"{_where(r)}; pooled perplexity magnitude {_variant('magnitude')(r)['perplexity']:.4g} "
            f"vs weight {_weight(r)['perplexity']:.4g}, unmasked {r.baseline['perplexity']:.4g}"
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
            _cols(_weight(r), _variant("activation")(r)), evaluation.PPL_CHANGE
        ),
        unit="texts",
        applies=_applies(
            _NEED_WEIGHT, (_variant("activation"), "the activation or weight variant was not run")
        ),
        details=lambda r: (
            f"{_where(r)}; perplexity activation {_variant('activation')(r)['perplexity']:.4g} vs "
            f"weight {_weight(r)['perplexity']:.4g}; KL {_variant('activation')(r)['kl']:.3g} vs "
            f"{_weight(r)['kl']:.3g} nats"
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
        stat=lambda r: claims.Sample(_cols(r.baseline, r.full_row()), evaluation.PPL_RATIO),
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
            np.column_stack([r.baseline["per_text"]["sink"], r.full_row()["per_text"]["sink"]]),
            _sink_drop,
        ),
        unit="texts",
        applies=_applies(_NEED_FULL),
        details=lambda r: (
            f"attention to position 0 in layers {r.layers[0]}..{r.layers[-1]}: "
            f"{r.baseline['sink']:.3f} → {r.full_row()['sink']:.3f}"
        ),
    ),
)
claims.check_specs(SPECS)


def _fmt_list(xs) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"


# ------------------------------------------------------------------------------------------
# figures and summary
# ------------------------------------------------------------------------------------------


def _sweep_points(result: Result, variant: str, metric: str) -> list[tuple[float, float]]:
    """(rate, value) of one selection; several random seeds at a rate are averaged."""
    by: dict[float, list[float]] = {}
    for r in result.rows:
        if r["kind"] == "wemask" and r["variant"] == variant and metric in r:
            by.setdefault(r["rate"], []).append(r[metric])
    return sorted((k, float(np.mean(v))) for k, v in by.items())


def figures(result: Result) -> dict[str, go.Figure]:
    metrics = [m for m in (*METRICS, "mc_accuracy") if m in result.baseline]
    cols = 3
    nrows = (len(metrics) + cols - 1) // cols
    rate_fig = make_subplots(
        rows=nrows, cols=cols, subplot_titles=[METRIC_TITLES[m] for m in metrics]
    )
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in result.rows)]
    colors = dict(zip(VARIANTS, ("firebrick", "darkorange", "gray", "steelblue")))
    for i, m in enumerate(metrics):
        rr, cc = i // cols + 1, i % cols + 1
        for v in variants:
            pts = _sweep_points(result, v, m)
            rate_fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in pts],
                    y=[p[1] for p in pts],
                    mode="lines+markers",
                    name=v,
                    legendgroup=v,
                    showlegend=i == 0,
                    line_color=colors.get(v),
                ),
                row=rr,
                col=cc,
            )
        rand = result.random_rows(result.claim_rate)
        if m in METRICS and len(rand) > 1:
            rate_fig.add_trace(
                go.Scatter(
                    x=[result.claim_rate] * len(rand),
                    y=[r[m] for r in rand],
                    mode="markers",
                    marker={"color": "gray", "symbol": "circle-open"},
                    name="random, each seed",
                    legendgroup="seeds",
                    showlegend=i == 0,
                ),
                row=rr,
                col=cc,
            )
        rate_fig.update_xaxes(title_text="mask rate r", row=rr, col=cc)
        if m == "perplexity":
            rate_fig.update_yaxes(type="log", row=rr, col=cc)
    rate_fig.update_layout(
        title=f"WeMask mask-rate study — {result.model}<br><sup>masked positions: "
        f"{_pos_label(result.positions)}; layers {result.layers[0]}..{result.layers[-1]} (ME layer "
        f"{result.me_layer}, start '{result.start}'); {result.n_texts} texts</sup>",
        template="plotly_white",
        height=330 * nrows + 120,
    )
    soft_fig = make_subplots(
        rows=nrows, cols=cols, subplot_titles=[METRIC_TITLES[m] for m in metrics]
    )
    kinds = [
        k
        for k in ("dim_projection", "direction_projection")
        if any(r["kind"] == k for r in result.rows)
    ]
    for i, m in enumerate(metrics):
        rr, cc = i // cols + 1, i % cols + 1
        for k in kinds:
            pts = [(0.0, result.baseline[m])]
            pts += sorted((r["alpha"], r[m]) for r in result.rows if r["kind"] == k and m in r)
            soft_fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in pts],
                    y=[p[1] for p in pts],
                    mode="lines+markers",
                    name=k,
                    legendgroup=k,
                    showlegend=i == 0,
                ),
                row=rr,
                col=cc,
            )
        soft_fig.update_xaxes(title_text="α", row=rr, col=cc)
    soft_fig.update_layout(
        title=f"Soft alternatives: h − α P_S h (weight dims) and h − α proj_v h — {result.model}",
        template="plotly_white",
        height=330 * nrows + 120,
    )
    return {"mask_rate": rate_fig, "soft_alpha": soft_fig}


def _pos_label(positions: Any) -> str:
    if positions and isinstance(positions[0], (list, tuple)):
        return "detected massive positions " + str(sorted({p for row in positions for p in row}))
    return str(list(positions))


def summary(result: Result) -> str:
    head = (
        f"model: {result.model}   ME layer {result.me_layer} (1-based {result.me_layer + 1}); masked "
        f"layers {result.layers[0]}..{result.layers[-1]} at positions {_pos_label(result.positions)}; "
        f"{result.n_texts} texts, {result.n_tokens} tokens; {result.n_items} MC items; claims at "
        f"r = {result.claim_rate:g}"
    )
    metrics = [*METRICS, "mc_accuracy"]
    cell = lambda r, m: r.get(m, "-")  # noqa: E731
    rows = [("baseline", "-", "-", "-", "-", *(cell(result.baseline, m) for m in metrics))]
    rows += [
        (r["kind"], r["variant"], r["rate"], r["alpha"], r["seed"], *(cell(r, m) for m in metrics))
        for r in result.rows
        if r.get("same_as") is None
    ]
    table = fmt_table(["kind", "variant", "rate", "alpha", "seed", *metrics], rows)
    return "\n".join([head, "", table])


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("mask_rate",)
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
