"""Super weights and the ME layer: which single ``W_down`` weight makes the massive activation?

Yu et al. (2024, "The Super Weight in Large Language Models", arXiv 2411.07191) find one scalar of an
early ``down_proj`` whose removal destroys the model: at the massive token its input neuron ``c``
spikes, its output dim ``r`` spikes (the *super activation*), and ``W_down[r, c]`` joins the two.
Their released code keeps a table of coordinates for 8 models; this experiment detects them from
activations on any model and tests them causally against the ME layer of the paper.

**Detection** (one forward over the prompts, ``probes.down_proj``), at the massive token ``p_b`` of
each prompt ``b`` (its largest-norm massive token at the ME layer ``m``) and in every layer ``L``:

* the *spikes* (Yu et al.'s plot): ``max_c |x_{L,c}|`` of ``down_proj``'s input ``x = σ(W_gate ĥ) ⊙
  W_up ĥ`` (``mlp.hook_post``) and ``max_r |y_{L,r}|`` of its output ``y = W_down x`` (``mlp.hook_out``,
  the FFN's own output, before any post-FFN norm), and the same maxima over the other tokens; a layer
  is a *Yu spike layer* when both maxima (medians over prompts) exceed ``THRESHOLDS
  ['super_weight_spike']`` (50, the ``spike_threshold`` of their ``plot_down_proj_input_output``), and
  its Yu coordinate is ``(L, argmax_r |y|, argmax_c |x|)``;
* the *candidates*: every weight ranked by its write into the residual stream at the massive token,
  ``w_{L,b}[r, c] = x_{L,b,c} · W_down[r, c] · f_{L,b,r}`` with ``f = 1`` on a block without a
  post-FFN norm and ``f_r = g_r / sqrt(mean(y²) + ε)`` on a sandwich block (Gemma 2/3: the post-FFN
  norm's gain over the rms it divides by, the norm linearised at the unedited output; ``f ⊙ y`` is
  the post-norm's output). A write *builds* the activation when ``|h_r + w| > |h_r|`` (``h`` the
  residual stream it is added to, ``resid_mid``) and *erases* it otherwise; a weight is a candidate
  when its building write ``s = |w|`` reaches ``super_weight_spike`` on some prompt (each layer's
  largest erasing write is reported apart, ``Result.erasers``); the *top candidate of a prompt* is
  its largest building ``s`` over every layer and entry, its *stability* the fraction of prompts on
  which it is the top one, and the *super weight* is the candidate that is top on the most prompts
  (ties: the larger mean ``s``), unless ``--weight L ROW COL`` names the weight to test;
* the *weight-only variant* (no activations): ``ω_L[r, c] = |W_down[r, c]| · ‖W_gate[c, :] ⊙ g‖₂ ·
  ‖W_up[c, :] ⊙ g‖₂`` with ``g`` the pre-FFN RMSNorm's effective gain. Since ``x = ĥ ⊙ g`` with
  ``‖ĥ‖² = d``, ``|σ(W_gate x)_c (W_up x)_c| ≲ ‖x‖² ‖W_gate[c] ⊙ g‖ ‖W_up[c] ⊙ g‖`` where the gate is
  open (``σ(z) ≈ z``), so ``ω`` bounds the largest write of entry ``(r, c)`` for any input (the gain
  included: the paper's RMSNorm alignment); reported per layer, with the super weight's rank under
  ``ω`` and under plain ``|W_down|`` in its matrix;
* the relation to the ME layer: whether the super weight lies in ``m``, whether its row is a massive
  dim, whether its column is one of the ME layer's top neurons (shares ``s_n = x_n ⟨W_down[:, n], y⟩ /
  ‖y‖²`` of the massive token's FFN output, ``Σ_n s_n = 1``, as ``probes.ffn.neuron_contributions``),
  and its own share ``x_c W_down[r, c] / y_r`` of the super activation.

**Causal tests** (``edits.down_weights_zeroed`` restores the weights exactly; the restore is the
hook ``interventions.causal.set_ffn_own_at``):

* *zeroing* the super weight: the massive activation at ``L* = max(m, L_sw)`` (the first layer where
  both the emergence and the weight have acted), ``c = (R̄(zeroed) − 1) / (R̄(unedited) − 1)`` with
  ``R_b = max_t ‖h_t‖ / mean_{t≠argmax} ‖h_t‖`` (as ``ffn_svd_ablation``), on the prompts;
* perplexity ``exp(Σ_b nll_b / Σ_b n_b)`` on the texts (by default the prompts, cut to
  ``text_tokens``): unedited, zeroed, zeroed with the super activation *restored* (as Yu et al.'s
  ``removeSW_restoreSA``: the unedited value of ``y_r`` written into the zeroed model's ``down_proj``
  output, but at each text's massive token, its largest-norm token at the output of ``L*``; their
  hook takes the position of the largest ``|y_r|``, the same token unless a post-FFN norm rescales
  the output, and the result records both), and the random control: for each of
  ``n_random`` seeds, ``control_weights`` weights drawn from the ``pool`` largest-magnitude other
  weights of the same matrix (those at least as large as the super weight first) zeroed instead.

Claims (:data:`SPECS`, judged by :func:`me_interp.claims.judge`): ``zeroing_removes`` (the excess
left ``c ≤ removed``, bootstrap over the prompts' massive-token prefixes), ``zeroing_hurts``
(perplexity ratio ≥ ``ppl_damage``, bootstrap over texts), ``restoring_recovers`` (the fraction of
the log-perplexity damage the restored super activation takes back, ``(Σ nll_zeroed − Σ nll_restored)
/ (Σ nll_zeroed − Σ nll_unedited) ≥ restore``; applies where zeroing hurts), ``in_me_layer`` (per
distinct massive-token prefix, is its top candidate in the ME layer; Clopper–Pearson, ≥
``super_weight_layer``), and the control ``random_weights_harmless`` (the geometric mean over seeds of
the perplexity ratio of the random draws stays below ``ppl_damage``; two-way crossed bootstrap over
texts × seeds). A model without a massive activation raises :class:`me_interp.claims.NotApplicable`;
one whose massive activation no single weight writes (no candidate) answers "not applicable" for the
claims that need a super weight.

    python -m me_interp.experiments.super_weight                    # bundled model, about a minute
    python -m me_interp.experiments.super_weight --model gemma-3-270m
    python -m me_interp.experiments.super_weight --model synthetic:planted-needsink
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from me_interp import claims, evaluation, names, plotting, terminal
from me_interp.claims import excess_fraction, excess_stat
from me_interp.edits import down_weights_zeroed
from me_interp.experiments._weights import (
    WeightConfig,
    fmt_value,
    measure,
    prepare,
    short_batch,
)
from me_interp.interventions.causal import set_ffn_own_at
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record
from me_interp.probes.down_proj import (
    Candidate,
    Eraser,
    MENeurons,
    WeightOnlyTop,
    YuSpike,
    candidate_at,
    candidates,
    control_pool,
    down_proj_spikes,
    draw,
    survey,
    weight_only_tops,
    yu_spike_layers,
)
from me_interp.probes.down_proj import survey_text as survey_text  # the survey's cell
from me_interp.probes.massive import Criterion
from me_interp.probes.site import Units
from me_interp.prompts import read_prompts
from me_interp.study import Experiment, Headed, RunHeader, checked, command, run_header
from me_interp.terminal import fmt_table

NAME = "super_weight"
EDITS = ("unedited", "zeroed", "restored", "random")
"""The perplexity conditions, in figure order."""


@dataclass(frozen=True)
class Config(WeightConfig):
    """Super-weight settings.

    Attributes:
        top_k: candidates kept per layer and prompt (the largest writes ``s``), at least 1.
        texts: text file (one text per line) for the perplexities; ``None``: the prompts themselves.
        max_texts: how many texts, spread evenly over the file or the prompts (``0`` = all); the
            perplexity claims' intervals are over texts.
        text_tokens: cut every text to its first ``text_tokens`` tokens (at least 2).
        n_random: seeds (``seed, seed+1, …``) of the random-weight control (the control needs at
            least 5).
        pool: the random control draws from this many of the largest-magnitude other weights of the
            super weight's matrix (every weight at least as large as it comes first).
        control_weights: how many pool weights each random draw zeroes (1: as many as the super
            weight).
        weight: ``layer row col`` of a ``W_down`` weight to test instead of the detected super
            weight (e.g. one of Yu et al.'s published coordinates); empty: the detected one.
    """

    n_prompts: int = checked(16, ge=0)
    sink: bool = False
    top_k: int = checked(5, ge=1)
    texts: str | None = None
    max_texts: int = checked(16, ge=0)
    text_tokens: int = checked(48, ge=2)
    n_random: int = checked(5, ge=0)
    pool: int = checked(100, ge=1)
    control_weights: int = checked(1, ge=1)
    weight: tuple[int, ...] = checked((), length=3, ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.control_weights > self.pool:
            raise ValueError(
                f"control_weights must be <= pool ({self.pool}), got {self.control_weights}"
            )


def survey_entry(
    model: LoadedModel,
    prompts: Sequence[str],
    criterion: Criterion | None = None,
    n_prompts: int = 16,
    max_tokens: int = 16,
) -> dict[str, Any]:
    """The survey's super-weight column (:func:`me_interp.probes.down_proj.survey`, no perplexity)
    on ``n_prompts`` prompts spread over ``prompts``, cut to ``max_tokens`` tokens."""
    return survey(model, short_batch(model, prompts, n_prompts, max_tokens), criterion)


# ------------------------------------------------------------------------------------------
# perplexity per text
# ------------------------------------------------------------------------------------------


def text_nll(model: LoadedModel, batch: Batch, hooks: Sequence = ()) -> evaluation.TextNLL:
    """Per-text next-token NLL sums and counts under ``hooks`` (one forward)."""
    logits = model.run_with_hooks(batch, hooks)
    return evaluation.text_nll(logits, batch.tokens, batch.attention_mask)


# ------------------------------------------------------------------------------------------
# result
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Perplexities:
    """Per text: ``n_pred`` predictions and the NLL sums ``unedited``, ``zeroed``, ``restored``;
    ``random`` ``[seed][text]``."""

    n_pred: list[int]
    unedited: list[float]
    zeroed: list[float]
    restored: list[float]
    random: list[list[float]]


@dataclass(frozen=True)
class Pool:
    """What the random draws came from: ``size`` of the largest other weights of the matrix,
    ``n_at_least`` of them at least as large as the super weight; their ``|W|`` range and the
    super weight's ``|W|``."""

    size: int
    n_at_least: int
    largest: float
    smallest: float
    super_weight: float


@dataclass(frozen=True)
class Result(Headed):
    """What :func:`run` measured (0-based layers; per-layer lists are ``[layer][prompt]``).

    Attributes:
        header: the run; its ``layer`` is the ME layer ``m`` (given or detected), its ``dims`` the
            massive dims.
        positions: each prompt's massive position; ``units`` the prompts grouped by massive-token
            prefix (distinct measurements).
        in_max, out_max, others_in_max, others_out_max: the spikes of the module docstring.
        yu_layers: Yu et al.'s spike layers and coordinates.
        candidates: every candidate (:class:`Candidate`), the super weight first.
        prompt_tops: each prompt's top candidate ``(layer, row, col)`` or ``None``.
        me_neurons: the ME layer's top neurons and their shares.
        erasers: per layer, the weight whose write most *shrinks* ``|h_row|`` at the massive token
            (not a candidate: it erases the activation).
        weight_only: per layer, the largest ``ω`` entry and the largest ``|W_down|`` entry.
        check_layer: ``L*``, where the zeroing is measured; ``ratio_unedited`` / ``ratio_zeroed`` the
            per-prompt ``R_b`` there.
        texts: the per-text NLL sums (:class:`Perplexities`); ``None`` without a super weight.
        restore_positions: per text, where the super activation was restored: its massive token
            (largest-norm token at the output of ``L*``); ``restore_yu_positions`` where Yu et al.'s
            hook would have (the largest ``|y_row|``).
        random_draws: per seed, the zeroed ``(row, col, value)`` entries; ``pool`` what they were drawn
            from.
        given: the weight of ``Config.weight`` (tested instead of the detected one), else ``None``.
    """

    header: RunHeader
    prompt_lengths: list[int]
    positions: list[int]
    units: Units
    in_max: list[list[float]]
    out_max: list[list[float]]
    others_in_max: list[list[float]]
    others_out_max: list[list[float]]
    yu_layers: list[YuSpike]
    candidates: list[Candidate]
    prompt_tops: list[tuple[int, int, int] | None]
    me_neurons: MENeurons
    erasers: list[Eraser]
    weight_only: list[WeightOnlyTop]
    check_layer: int | None = None
    ratio_unedited: list[float] = field(default_factory=list)
    ratio_zeroed: list[float] = field(default_factory=list)
    massive_at_check: bool = False
    n_texts: int = 0
    text_lengths: list[int] = field(default_factory=list)
    texts: Perplexities | None = None
    restore_positions: list[int] = field(default_factory=list)
    restore_yu_positions: list[int] = field(default_factory=list)
    random_draws: list[list[tuple[int, int, float]]] = field(default_factory=list)
    pool: Pool | None = None
    given: Candidate | None = None

    @property
    def me_layer(self) -> int:
        """The ME layer ``m`` (given or detected)."""
        return self.header.layer

    @property
    def massive_dims(self) -> list[int]:
        return list(self.header.dims)

    @property
    def super_weight(self) -> Candidate | None:
        """The weight the causal tests zero: the given one (``Config.weight``), else the candidate
        that is top on the most prompts (``None``: no candidate)."""
        return self.given if self.given is not None else self.detected

    @property
    def detected(self) -> Candidate | None:
        """The detected super weight (the candidate top on the most prompts), given one or not."""
        return self.candidates[0] if self.candidates and self.candidates[0].stability > 0 else None

    def per_text(self, kind: str) -> np.ndarray:
        """``[text]`` NLL sums of ``kind`` (``unedited``, ``zeroed``, ``restored``, ``n_pred``)."""
        return np.asarray(getattr(self.texts, kind), dtype=np.float64)

    def ppl(self, kind: str) -> float:
        """Pooled perplexity of ``kind`` (the geometric mean over seeds for ``random``)."""
        n = self.per_text("n_pred").sum()
        if kind == "random":
            seeds = self.texts.random
            return float(np.exp(np.mean([np.sum(s) for s in seeds]) / n)) if seeds else math.nan
        return math.exp(self.per_text(kind).sum() / n)

    def random_cells(self) -> np.ndarray:
        """``[text, seed]``: ``(nll_{b,s} − nll_b) / n̄`` (``n̄`` the mean prediction count), whose
        mean is the log of the geometric mean over seeds of the pooled perplexity ratio."""
        base, n = self.per_text("unedited"), self.per_text("n_pred")
        rand = np.asarray(self.texts.random, dtype=np.float64)  # [seed text]
        return ((rand - base[None]) / n.mean()).T


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Detect the super weight, zero it, restore its activation, draw the controls.

    Raises:
        NotApplicable: no ``layer`` given and the model has no massive activation.
        ValueError: a layer out of range.
    """
    s = prepare(cfg, model)
    m, model = s.layer, s.model
    positions = list(s.site.reference)
    spikes = down_proj_spikes(model, s.batch, positions)
    dims = list(s.site.dims)
    cands, tops, me, erasers = candidates(model, spikes, m, dims, cfg.top_k)
    res = Result(
        header=run_header(cfg, model, len(s.batch), s.site),
        prompt_lengths=s.batch.lengths,
        positions=positions,
        units=s.site.units,
        in_max=spikes.in_max().tolist(),
        out_max=spikes.out_max().tolist(),
        others_in_max=spikes.others_x.tolist(),
        others_out_max=spikes.others_y.tolist(),
        yu_layers=yu_spike_layers(spikes),
        candidates=cands,
        prompt_tops=tops,
        me_neurons=me,
        erasers=erasers,
        weight_only=weight_only_tops(model),
        given=None
        if not cfg.weight
        else candidate_at(model, spikes, cfg.weight, m, dims, me.top_neurons),
    )
    sw = res.super_weight
    if sw is None:
        return res
    check = max(m, sw.layer)
    with down_weights_zeroed(model, [sw.coord]):
        after = measure(model, s.batch, s.criterion, s.positions, sink=False)
    texts = cfg.texts
    source = cfg.load_prompts() if texts is None else read_prompts(texts)
    tb = short_batch(model, source, cfg.max_texts, cfg.text_tokens)
    acts = Activations(model, tb, [names.ffn_own(sw.layer), names.resid_post(check)])
    logits = record(model, tb, [acts], logits=True)
    clean = evaluation.text_nll(logits, tb.tokens, tb.attention_mask)
    y = acts[names.ffn_own(sw.layer)][..., sw.row].float().cpu()  # [batch pos]
    norm = acts[names.resid_post(check)].float().norm(dim=-1).cpu()  # [batch pos]
    real = tb.attention_mask.bool().cpu()
    where = norm.masked_fill(~real, -1.0).argmax(-1)  # each text's massive token
    yu = y.abs().masked_fill(~real, -1.0).argmax(-1)  # Yu et al.'s: the largest |y_row|
    values = y[torch.arange(len(tb)), where]
    pool = control_pool(model, sw.layer, sw.row, sw.col, cfg.pool)
    draws = [draw(pool, cfg.control_weights, cfg.seed + i) for i in range(cfg.n_random)]
    with down_weights_zeroed(model, [sw.coord]):
        zero = text_nll(model, tb)
        rest = text_nll(model, tb, set_ffn_own_at(sw.layer, sw.row, where.tolist(), values))
    rand = []
    for d in terminal.bar(draws, desc=NAME):
        with down_weights_zeroed(model, [(sw.layer, r, c) for r, c, _ in d]):
            rand.append(text_nll(model, tb).nll)
    return replace(
        res,
        check_layer=check,
        ratio_unedited=s.baseline.prompt_ratio_at(check),
        ratio_zeroed=after.prompt_ratio_at(check),
        massive_at_check=bool(s.baseline.has_massive[check]),
        n_texts=len(tb),
        text_lengths=tb.lengths,
        texts=Perplexities(clean.n, clean.nll, zero.nll, rest.nll, rand),
        restore_positions=where.tolist(),
        restore_yu_positions=yu.tolist(),
        random_draws=draws,
        pool=Pool(
            size=len(pool),
            n_at_least=sum(abs(v) >= abs(sw.weight) for _, _, v in pool),
            largest=abs(pool[0][2]) if pool else math.nan,
            smallest=abs(pool[-1][2]) if pool else math.nan,
            super_weight=abs(sw.weight),
        ),
    )


# ------------------------------------------------------------------------------------------
# claims
# ------------------------------------------------------------------------------------------


def _need_sw(r: Result) -> str | None:
    if r.super_weight is None:
        thr = claims.threshold("super_weight_spike")
        best = max((max(v) for v in r.out_max), default=math.nan)
        return (
            f"no super weight: no single W_down weight writes {thr:g} (threshold "
            f"'super_weight_spike') into the residual stream at the massive token of any prompt "
            f"(largest down_proj output there {fmt_value(best)})"
        )
    return None


def _need_detected(r: Result) -> str | None:
    return None if r.detected is not None else _need_sw(replace(r, given=None))


def _need_texts(r: Result) -> str | None:
    return _need_sw(r) or (None if r.texts is not None else "not measured in this run: no texts")


def _need_massive(r: Result) -> str | None:
    if why := _need_sw(r):
        return why
    if not r.massive_at_check:
        return (
            f"no massive activation at layer {r.check_layer} of the unedited model (the ME layer "
            "was given, not detected): there is nothing for the zeroing to remove"
        )
    return None


def _damage(r: Result) -> float:
    return r.ppl("zeroed") / r.ppl("unedited")


def _need_damage(r: Result) -> str | None:
    if why := _need_texts(r):
        return why
    thr = claims.threshold("ppl_damage")
    if not _damage(r) >= thr:
        return (
            f"zeroing the super weight does not hurt (perplexity × {_damage(r):.3g} < {thr:g}, "
            "threshold 'ppl_damage'): there is no damage for the restored activation to take back"
        )
    return None


def _cols(r: Result, *kinds: str) -> np.ndarray:
    return np.column_stack([r.per_text("n_pred"), *(r.per_text(k) for k in kinds)])


@claims.of_means
def _recovered(m: np.ndarray) -> np.ndarray | float:
    """``(Σ nll_zeroed − Σ nll_restored) / (Σ nll_zeroed − Σ nll_unedited)`` of ``[n, unedited,
    zeroed, restored]`` rows (column means ``m``: the sums over n)."""
    damage = m[..., 2] - m[..., 1]
    return claims.divide(m[..., 2] - m[..., 3], damage, damage > 0)


def _where(r: Result) -> str:
    sw = r.super_weight
    which = "given weight" if r.given is not None else "super weight"
    return (
        f"{which} {sw.label()} (1-based layer {sw.layer + 1}) = {sw.weight:.4g}, top on "
        f"{sw.stability:.0%} of {r.n_prompts} prompts, write {fmt_value(sw.write)} at the massive "
        f"token; ME layer {r.me_layer}"
    )


def _text_details(r: Result) -> str:
    return (
        f"{_where(r)}; perplexity over {r.n_texts} texts ({int(r.per_text('n_pred').sum())} "
        f"predictions): unedited {r.ppl('unedited'):.4g}, zeroed {r.ppl('zeroed'):.4g}, restored "
        f"{r.ppl('restored'):.4g}, random weights {r.ppl('random'):.4g} (geometric mean over "
        f"{len(r.texts.random)} seeds)"
    )


def _removes(r: Result) -> claims.Sample:
    pairs = np.column_stack([r.ratio_zeroed, r.ratio_unedited])
    return claims.Sample(pairs, excess_stat, keys=list(r.units.keys))


def _removes_details(r: Result) -> str:
    before, after = np.mean(r.ratio_unedited), np.mean(r.ratio_zeroed)
    return (
        f"{_where(r)}; at layer {r.check_layer} R̄ {fmt_value(before)} → {fmt_value(after)} "
        f"(c = {fmt_value(excess_fraction(after, before))}); its share of the super activation "
        f"{fmt_value(r.super_weight.share)}"
    )


def _layer_outcomes(r: Result) -> claims.Outcomes:
    out, labels = [], []
    for group in r.units.groups:
        b = group[0]  # a prefix is one measurement: its prompts share the massive token's state
        top = r.prompt_tops[b]
        out.append(top is not None and top[0] == r.me_layer)
        where = "none" if top is None else f"layer {top[0]}"
        name = f"prompt {b}" if len(group) == 1 else f"prompts {group[0]}…{group[-1]}"
        labels.append(f"{name} ({where})")
    return claims.Outcomes(out, labels, unit="massive-token prefixes")


def _layer_details(r: Result) -> str:
    sw = r.detected
    yu = ", ".join(f"{d.layer} [{d.row}, {d.col}]" for d in r.yu_layers) or "none"
    me = r.me_neurons
    return (
        f"{_where(r)}; row {sw.row} {'is' if sw.massive_dim else 'is not'} a massive dim "
        f"{r.massive_dims[:4]}; ME layer's top neurons {me.top_neurons} (shares "
        f"{[round(x, 3) for x in me.top_shares]}); Yu et al.'s spike layers: {yu}; "
        f"{len(r.candidates)} candidates"
    )


def _yu_agree(r: Result) -> int:
    return sum(a == b for a, b in zip(r.restore_positions, r.restore_yu_positions, strict=True))


def _random_applies(r: Result) -> str | None:
    return _need_texts(r) or claims.too_few_seeds(len(r.texts.random), "--n-random")


def _random_details(r: Result) -> str:
    p = r.pool
    per = ", ".join(
        f"{math.exp(np.sum(s - r.per_text('unedited')) / r.per_text('n_pred').sum()):.3g}"
        for s in np.asarray(r.texts.random)
    )
    return (
        f"{_text_details(r)}; ratio per seed {per}; each draw zeroes "
        f"{len(r.random_draws[0])} of the {p.size} largest other weights of the matrix "
        f"(|W| {fmt_value(p.smallest)}…{fmt_value(p.largest)}; {p.n_at_least} at least "
        f"as large as the super weight's {fmt_value(p.super_weight)})"
    )


_SECTION = "Yu et al. 2024 (super weight); §2 claim 3 (the ME layer's FFN)"
SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        f"{NAME}.zeroing_removes",
        _SECTION,
        "Zeroing the super weight alone removes the massive activation",
        "c = (R̄(zeroed) − 1) / (R̄(unedited) − 1) at L* = max(ME layer, the weight's layer), R the "
        "largest token norm over the mean of the others, mean over prompts; bootstrap over the "
        "prompts (distinct massive-token prefixes)",
        "<=",
        "removed",
        "the same prompts unedited (paired); the random weights of super_weight."
        "random_weights_harmless",
        stat=_removes,
        unit="prompts",
        applies=_need_massive,
        details=_removes_details,
    ),
    claims.Spec(
        f"{NAME}.zeroing_hurts",
        _SECTION,
        "Zeroing the super weight multiplies the perplexity by at least the damage threshold",
        "perplexity(zeroed) / perplexity(unedited), pooled over the texts",
        ">=",
        "ppl_damage",
        "as many weights of at least its magnitude zeroed instead "
        "(super_weight.random_weights_harmless)",
        stat=lambda r: claims.Sample(_cols(r, "unedited", "zeroed"), evaluation.PPL_RATIO),
        unit="texts",
        applies=_need_texts,
        details=_text_details,
    ),
    claims.Spec(
        f"{NAME}.random_weights_harmless",
        "Yu et al. 2024 (control: other large weights)",
        "Zeroing as many weights drawn from the largest of the same matrix does not multiply the "
        "perplexity by the damage threshold",
        "geometric mean over the random draws (seeds) of perplexity(random weights zeroed) / "
        "perplexity(unedited); two-way (crossed) bootstrap over texts × seeds of "
        "(nll_{b,s} − nll_b) / n̄",
        "<",
        "ppl_damage",
        "the super weight zeroed (super_weight.zeroing_hurts)",
        kind="control",
        stat=lambda r: claims.Nested(
            r.random_cells(), statistic=lambda a: math.exp(float(a.mean())), unit="texts"
        ),
        unit="texts",
        applies=_random_applies,
        details=_random_details,
    ),
    claims.Spec(
        f"{NAME}.restoring_recovers",
        "Yu et al. 2024 (restoring the super activation)",
        "With the super weight zeroed, restoring the super activation brings most of the "
        "perplexity back",
        "(Σ nll_zeroed − Σ nll_restored) / (Σ nll_zeroed − Σ nll_unedited) over the texts (1: "
        "all of it back, 0: none); the unedited y_row written back at each text's massive token "
        "(its largest-norm token at the output of L*)",
        ">=",
        "restore",
        "the zeroed model without the restore (0 by definition) and the unedited one (1)",
        stat=lambda r: claims.Sample(_cols(r, "unedited", "zeroed", "restored"), _recovered),
        unit="texts",
        applies=_need_damage,
        details=lambda r: (
            f"{_text_details(r)}; restored at positions {sorted(set(r.restore_positions))} (the "
            f"largest |y_row| is there in {_yu_agree(r)} of {r.n_texts} texts)"
        ),
    ),
    claims.Spec(
        f"{NAME}.in_me_layer",
        "§2 claim 1 (the ME layer) against Yu et al. 2024 (an early down_proj)",
        "The super weight lies in the ME layer",
        "fraction of the distinct massive-token prefixes whose top candidate (largest single "
        "W_down write at the massive token) is in the ME layer",
        ">=",
        "super_weight_layer",
        "the other layers' candidates on the same prompts (under exchangeable layers the chance "
        "is 1 / n_layers)",
        stat=_layer_outcomes,
        unit="massive-token prefixes",
        applies=_need_detected,
        details=_layer_details,
    ),
)
claims.check_specs(SPECS)


# ------------------------------------------------------------------------------------------
# figures and summary
# ------------------------------------------------------------------------------------------


def _median(rows: list[list[float]]) -> list[float]:
    return [float(np.median(v)) for v in rows]


def figures(result: Result) -> dict[str, go.Figure]:
    thr = claims.threshold("super_weight_spike")
    spikes = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=(
            "down_proj input: max |x| (σ(gate)·up)",
            "down_proj output: max |y| (before any post-norm)",
        ),
    )
    for col, (at, others) in enumerate(
        ((result.in_max, result.others_in_max), (result.out_max, result.others_out_max)), 1
    ):
        for name, rows, color in (
            ("massive token", at, "firebrick"),
            ("other tokens (max)", others, "gray"),
        ):
            ys = _median(rows)
            xs = list(range(len(ys)))
            spikes.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines+markers",
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    line_color=color,
                    customdata=[x + 1 for x in xs],
                    hovertemplate="layer %{x} (1-based %{customdata}): %{y:.4g}<extra>"
                    + name
                    + "</extra>",
                ),
                row=1,
                col=col,
            )
        spikes.add_hline(y=thr, line_dash="dot", line_color="black", row=1, col=col)
        spikes.update_yaxes(type="log", row=1, col=col)
        spikes.update_xaxes(
            title_text="layer (0-based)", range=[-0.5, len(xs) - 0.5], row=1, col=col
        )
    sw = result.super_weight
    plotting.mark_layer(spikes, result.me_layer)
    spikes.update_layout(
        title=f"down_proj spikes at the massive token (median over {result.n_prompts} prompts) — "
        f"{result.model}<br><sup>dotted: Yu et al.'s spike threshold {thr:g}; super weight: "
        f"{sw.label() if sw else 'none'}</sup>",
        template="plotly_white",
        margin={"t": 130},
    )
    out = {"down_proj_spikes": spikes}
    if result.texts is not None:
        labels = ["unedited", "super weight zeroed", "zeroed + super activation restored"]
        values = [result.ppl(k) for k in ("unedited", "zeroed", "restored")]
        n, base = result.per_text("n_pred"), result.per_text("unedited")
        seeds = [
            math.exp((np.sum(s) - base.sum()) / n.sum()) * result.ppl("unedited")
            for s in np.asarray(result.texts.random)
        ]
        ppl = go.Figure(
            go.Bar(
                x=labels,
                y=values,
                marker_color=["seagreen", "firebrick", "steelblue"],
                name="pooled perplexity",
            )
        )
        if seeds:
            ppl.add_trace(
                go.Scatter(
                    x=["random large weights zeroed"] * len(seeds),
                    y=seeds,
                    mode="markers",
                    marker={"color": "gray", "size": 9},
                    name="random weights (each seed)",
                )
            )
        damage = claims.threshold("ppl_damage")
        # no annotation on the line: on a log axis plotly reads an annotation's y as log10(y)
        ppl.add_hline(y=result.ppl("unedited") * damage, line_dash="dash", line_color="gray")
        ppl.update_layout(
            title=f"Perplexity under each ablation of {sw.label()} — {result.model}<br><sup>"
            f"{result.n_texts} texts of ≤ {max(result.text_lengths)} tokens; dashed: the "
            f"unedited perplexity × {damage:g} ('ppl_damage')</sup>",
            yaxis_title="perplexity",
            yaxis_type="log",
            template="plotly_white",
        )
        out["perplexity"] = ppl
    return out


def summary(result: Result) -> str:
    sw = result.super_weight
    head = (
        f"model: {result.model}   ME layer {result.me_layer} (1-based {result.me_layer + 1})   "
        f"{result.n_prompts} prompts   {'given weight' if result.given else 'super weight'}: "
        + (f"{sw.label()} = {sw.weight:.4g} (stability {sw.stability:.0%})" if sw else "none")
    )
    rows = [
        (
            c.layer,
            c.row,
            c.col,
            c.weight,
            c.write,
            c.share,
            c.stability,
            "yes" if c.in_me_layer else "no",
            "yes" if c.massive_dim else "no",
            c.abs_rank,
            c.weight_only_rank,
        )
        for c in result.candidates[:10]
    ]
    cols = ["layer", "row", "col", "W", "write", "share", "stable", "ME", "mdim", "|W| rk", "ω rk"]
    lines = [head, "", fmt_table(cols, rows) if rows else "(no candidate)"]
    if result.texts is not None:
        lines += [
            "",
            "perplexity: "
            + ", ".join(f"{k} {result.ppl(k):.4g}" for k in EDITS)
            + f" ({result.n_texts} texts)",
        ]
    return "\n".join(lines)


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("down_proj_spikes",)
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
