"""Super weights and the ME layer: which single ``W_down`` weight makes the massive activation?

Yu et al. (2024, arXiv 2411.07191) find one scalar of an early ``down_proj`` whose removal destroys
the model. The candidates are detected from activations (``probes.down_proj``) and zeroed
(``edits.down_weights_zeroed``): the *super weight* (the largest write on the most prompts, or
``--weight L ROW COL``) for the excess it leaves, the perplexity, Yu et al.'s restore of its
``y_row`` and random large weights of its matrix; and every layer's top candidates alone, each run
from the unedited prefix and only up to where it is measured. The texts (a perplexity) are run for
the few that remove most (:func:`text_candidates`); the *precursor* is the upstream one that
removes most.

    python -m me_interp.experiments.super_weight                    # bundled model, about a minute
    python -m me_interp.experiments.super_weight --model gemma-3-270m
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import plotly.graph_objects as go

from me_interp import claims, evaluation, plotting, terminal
from me_interp.claims import excess_fraction, excess_stat
from me_interp.edits import down_weights_zeroed
from me_interp.interventions.causal import set_ffn_own_at
from me_interp.loading.loaded import LoadedModel
from me_interp.probes import down_proj as dp
from me_interp.probes.batching import capture_prefix
from me_interp.probes.down_proj import Candidate, LayerCandidate
from me_interp.probes.measurement import short_batch
from me_interp.probes.site import Site, Units
from me_interp.prompts import read_prompts
from me_interp.study import Experiment, Headed, RunHeader, checked, command, run_header
from me_interp.study.config import WeightConfig
from me_interp.study.weights import fmt_value, inputs, setup
from me_interp.terminal import fmt_table

NAME = "super_weight"
EDITS = ("unedited", "zeroed", "restored", "random")
"""The perplexity conditions, in figure order."""
N_TEXT = 3
"""How many of the layer candidates that leave least of the excess also get a perplexity."""


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
class Result(Headed):
    """What :func:`run` measured (0-based layers; ``[layer][prompt]`` lists): the detection
    (``probes.down_proj``); the unedited ``R`` (``prompt_ratio``); every layer's top candidates
    zeroed alone (``layers``); the super weight zeroed, at ``check_layer`` (``ratio_zeroed``) and
    on the texts (``None`` without a super weight), where its activation was restored, the random
    draws and their ``pool``; ``given``: the weight of ``Config.weight``, else ``None``."""

    header: RunHeader
    prompt_lengths: list[int]
    positions: list[int]
    units: Units
    in_max: list[list[float]]
    out_max: list[list[float]]
    others_in_max: list[list[float]]
    others_out_max: list[list[float]]
    yu_layers: list[dp.YuSpike]
    candidates: list[Candidate]
    prompt_tops: list[tuple[int, int, int] | None]
    me_neurons: dp.MENeurons
    erasers: list[dp.Eraser]
    weight_only: list[dp.WeightOnlyTop]
    prompt_ratio: list[list[float]] = field(default_factory=list)
    layers: list[LayerCandidate] = field(default_factory=list)
    check_layer: int | None = None
    ratio_zeroed: list[float] = field(default_factory=list)
    massive_at_check: bool = False
    n_texts: int = 0
    text_lengths: list[int] = field(default_factory=list)
    texts: Perplexities | None = None
    restore_positions: list[int] = field(default_factory=list)
    restore_yu_positions: list[int] = field(default_factory=list)
    random_draws: list[list[tuple[int, int, float]]] = field(default_factory=list)
    pool: dp.Pool | None = None
    given: Candidate | None = None

    me_layer = property(lambda self: self.header.layer)
    massive_dims = property(lambda self: list(self.header.dims))

    @property
    def super_weight(self) -> Candidate | None:
        """The weight the causal tests zero: the given one, else the detected one."""
        return self.given if self.given is not None else self.detected

    @property
    def detected(self) -> Candidate | None:
        """The detected super weight (the candidate top on the most prompts), given one or not."""
        return self.candidates[0] if self.candidates and self.candidates[0].stability > 0 else None

    @property
    def ratio_unedited(self) -> list[float]:
        """Per prompt, the unedited ``R`` at ``check_layer``."""
        return self.prompt_ratio[self.check_layer] if self.check_layer is not None else []

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

    def layer_pairs(self, c: LayerCandidate) -> np.ndarray:
        """``[prompt, (zeroed, unedited)]`` ``R`` at ``c``'s check layer (``excess_stat``'s rows)."""
        return np.column_stack([c.ratio_zeroed, self.prompt_ratio[c.check_layer]])

    def left(self, c: LayerCandidate) -> float:
        """The excess ``c``'s zeroing leaves, ``c = (R̄(zeroed) − 1) / (R̄(unedited) − 1)``."""
        return float(excess_stat(self.layer_pairs(c)))

    def layer_ppl_ratio(self, c: LayerCandidate) -> float:
        """Pooled perplexity with ``c`` zeroed over the unedited one (NaN: texts not run)."""
        if c.nll is None:
            return math.nan
        return math.exp(np.sum(c.nll) / self.per_text("n_pred").sum()) / self.ppl("unedited")

    @property
    def precursor(self) -> LayerCandidate | None:
        """The candidate upstream of the ME layer whose zeroing leaves the least of the excess, if
        it removes at least the ``removed`` fraction of it (else ``None``)."""
        best = min((c for c in self.layers if c.layer < self.me_layer), key=self.left, default=None)
        ok = best is not None and self.left(best) <= 1 - claims.threshold("removed")
        return best if ok else None


def text_candidates(res: Result) -> list[LayerCandidate]:
    """The layer candidates worth a perplexity (a forward of the texts each): the ME layer's, the
    upstream one that leaves least of the excess (the precursor, when it removes enough) and the
    :data:`N_TEXT` that leave least of it anywhere."""
    by = sorted(res.layers, key=res.left)
    up = [c for c in by if c.layer < res.me_layer][:1]
    keep = {c.coord for c in [*by[:N_TEXT], *up] + [c for c in by if c.layer == res.me_layer]}
    return [c for c in res.layers if c.coord in keep]


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Detect the super weight and every layer's top candidate, zero them, restore the super
    activation, draw the controls (``NotApplicable`` without a massive activation and no
    ``layer``; ``ValueError`` on a layer out of range)."""
    s = setup(EXPERIMENT, cfg, model, site)
    m, model = s.layer, s.model
    positions = list(s.site.reference)
    spikes = dp.down_proj_spikes(model, s.batch, positions)
    dims = list(s.site.dims)
    cands, tops, me, erasers = dp.candidates(model, spikes, m, dims, cfg.top_k)
    given = cfg.weight and dp.candidate_at(model, spikes, cfg.weight, m, dims, me.top_neurons)
    yu = dp.yu_spike_layers(spikes)
    res = Result(
        header=run_header(cfg, model, len(s.batch), s.site),
        prompt_lengths=s.batch.lengths,
        positions=positions,
        units=s.site.units,
        in_max=spikes.in_max().tolist(),
        out_max=spikes.out_max().tolist(),
        others_in_max=spikes.others_x.tolist(),
        others_out_max=spikes.others_y.tolist(),
        yu_layers=yu,
        candidates=cands,
        prompt_tops=tops,
        me_neurons=me,
        erasers=erasers,
        weight_only=dp.weight_only_tops(model),
        prompt_ratio=s.baseline.prompt_ratio,
        given=given or None,
    )
    sw = res.super_weight
    if sw is None:
        return res
    check = max(m, sw.layer)
    found = dp.layer_candidates(model, spikes, yu, m) if res.detected else []
    # the prompts: each zeroing runs blocks L..max(m, L) only, from the unedited prefix
    pp = capture_prefix(model, s.batch, [sw.layer, *(c.layer for c in found)], max_tokens=None)

    def ratio(coord: tuple[int, int, int]) -> list[float]:
        with down_weights_zeroed(model, [coord]):
            return dp.output_ratio(model, s.batch, max(m, coord[0]), pp, coord[0])

    bar = terminal.bar(found, desc=f"{NAME}: every layer")
    layers = [replace(c, ratio_zeroed=ratio(c.coord)) for c in bar]
    res = replace(res, layers=layers, check_layer=check, ratio_zeroed=ratio(sw.coord))
    # the texts: blocks L.. of each zeroing, from the unedited prefix
    source = cfg.load_prompts() if cfg.texts is None else read_prompts(cfg.texts)
    tb = short_batch(model, source, cfg.max_texts, cfg.text_tokens)
    chosen = text_candidates(res)
    tp = capture_prefix(model, tb, [sw.layer, *(c.layer for c in chosen)], max_tokens=None)
    sa, logits = dp.super_activation(model, tb, sw.layer, sw.row, check, tp)
    clean = evaluation.text_nll(logits, tb.tokens, tb.attention_mask)
    pool = dp.control_pool(model, sw.layer, sw.row, sw.col, cfg.pool)
    draws = [dp.draw(pool, cfg.control_weights, cfg.seed + i) for i in range(cfg.n_random)]
    nll = partial(evaluation.forward_nll, model, tb, prefix=tp, start=sw.layer)
    with down_weights_zeroed(model, [sw.coord]):
        zero, rest = nll(), nll(set_ffn_own_at(sw.layer, sw.row, sa.positions, sa.values))
    rand = []
    for d in terminal.bar(draws, desc=NAME):
        with down_weights_zeroed(model, [(sw.layer, r, c) for r, c, _ in d]):
            rand.append(nll().nll)
    for c in terminal.bar(chosen, desc=f"{NAME}: perplexities"):
        with down_weights_zeroed(model, [c.coord]):
            layers[layers.index(c)] = replace(c, nll=nll(start=c.layer).nll)
    return replace(
        res,
        layers=layers,
        massive_at_check=bool(s.baseline.has_massive[check]),
        n_texts=len(tb),
        text_lengths=tb.lengths,
        texts=Perplexities(clean.n, clean.nll, zero.nll, rest.nll, rand),
        restore_positions=sa.positions,
        restore_yu_positions=sa.yu_positions,
        random_draws=draws,
        pool=dp.Pool.of(pool, sw.weight),
    )


def _need_sw(r: Result) -> str | None:
    if r.super_weight is not None:
        return None
    best = fmt_value(max((max(v) for v in r.out_max), default=math.nan))
    return (
        f"no super weight: no single W_down weight writes {claims.threshold('super_weight_spike'):g} "
        "(threshold 'super_weight_spike') into the residual stream at the massive token of any "
        f"prompt (largest down_proj output there {best})"
    )


def _need_texts(r: Result) -> str | None:
    return _need_sw(r) or (None if r.texts is not None else "not measured in this run: no texts")


def _need_massive(r: Result) -> str | None:
    if r.super_weight is None or r.massive_at_check:
        return _need_sw(r)
    return (
        f"no massive activation at layer {r.check_layer} of the unedited model (the ME layer was "
        "given, not detected): there is nothing for the zeroing to remove"
    )


def _need_damage(r: Result) -> str | None:
    if why := _need_texts(r):
        return why
    thr, damage = claims.threshold("ppl_damage"), r.ppl("zeroed") / r.ppl("unedited")
    if damage >= thr:
        return None
    return (
        f"zeroing the super weight does not hurt (perplexity × {damage:.3g} < {thr:g}, threshold "
        "'ppl_damage'): there is no damage for the restored activation to take back"
    )


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
    return (
        f"{'given weight' if r.given else 'super weight'} {sw.label()} (1-based layer "
        f"{sw.layer + 1}) = {sw.weight:.4g}, top on {sw.stability:.0%} of {r.n_prompts} prompts, "
        f"write {fmt_value(sw.write)} at the massive token; ME layer {r.me_layer}"
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
    return claims.Sample(pairs, excess_stat)


def _removes_details(r: Result) -> str:
    before, after = np.mean(r.ratio_unedited), np.mean(r.ratio_zeroed)
    return (
        f"{_where(r)}; at layer {r.check_layer} R̄ {fmt_value(before)} → {fmt_value(after)} "
        f"(c = {fmt_value(excess_fraction(after, before))}); its share of the super activation "
        f"{fmt_value(r.super_weight.share)}"
    )


def _me_share(m: np.ndarray, me: np.ndarray) -> np.ndarray:
    """``ρ_me / (ρ_me + max_other ρ)`` of ``[zeroed, unedited]`` column pairs (one per candidate,
    means ``m``), ``ρ = max(0, 1 − c)`` and ``ρ_me`` the largest over the ME layer's candidates
    (``me``, a mask over the pairs)."""
    c = claims.divide(m[..., 0::2] - 1.0, m[..., 1::2] - 1.0)  # [..., candidate]
    rho = np.clip(1.0 - c, 0.0, None)
    a, b = rho[..., me].max(-1), rho[..., ~me].max(-1)
    return claims.divide(a, a + b)


def _beats(r: Result) -> claims.Sample:
    me = np.array([c.layer == r.me_layer for c in r.layers])
    if me.all() or not me.any():
        raise claims.NotApplicable("no candidate outside (or in) the ME layer to compare with")
    cols = np.column_stack([r.layer_pairs(c) for c in r.layers])
    return claims.Sample(cols, claims.of_means(partial(_me_share, me=me)))


def _layer_details(r: Result) -> str:
    def ppl(c: LayerCandidate) -> str:
        return "" if c.nll is None else f", perplexity ×{r.layer_ppl_ratio(c):.3g}"

    pre, by = r.precursor, sorted(r.layers, key=r.left)
    if pre is not None:  # the excess it leaves, with its interval over the prompts
        m = claims.with_units(claims.Sample(r.layer_pairs(pre), excess_stat), r)
        est = claims.measure_estimate(m, "prompts", "<=", claims.threshold("removed"), r.seed)[0]
        left = f"leaves {est.text().split(' (')[0]} of the excess at layer {pre.check_layer}"
    each = "; ".join(f"{c.label()} ({c.why}): {fmt_value(r.left(c))}{ppl(c)}" for c in by[:6])
    return (
        f"ME layer {r.me_layer}; precursor upstream of it: "
        f"{'none' if pre is None else f'{pre.label()} ({pre.why}) {left}{ppl(pre)}'}; the excess "
        f"left by each layer's candidate zeroed (at max(ME layer, its layer)), least first "
        f"({len(by)} candidates; perplexity for the ME layer's, the best upstream and the "
        f"{N_TEXT} best): {each}"
    )


def _random_details(r: Result) -> str:
    p, base, n = r.pool, r.per_text("unedited"), r.per_text("n_pred").sum()
    per = ", ".join(f"{math.exp(np.sum(s - base) / n):.3g}" for s in np.asarray(r.texts.random))
    return (
        f"{_text_details(r)}; ratio per seed {per}; each draw zeroes "
        f"{len(r.random_draws[0])} of the {p.size} largest other weights of the matrix "
        f"(|W| {fmt_value(p.smallest)}…{fmt_value(p.largest)}; {p.n_at_least} at least "
        f"as large as the super weight's {fmt_value(p.super_weight)})"
    )


def _restore_details(r: Result) -> str:
    agree = sum(a == b for a, b in zip(r.restore_positions, r.restore_yu_positions, strict=True))
    return (
        f"{_text_details(r)}; restored at positions {sorted(set(r.restore_positions))} (the "
        f"largest |y_row| is there in {agree} of {r.n_texts} texts)"
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
        massive_state=True,
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
        applies=lambda r: _need_texts(r) or claims.too_few_seeds(len(r.texts.random), "--n-random"),
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
        "sanity check, not evidence: where the zeroed weight's neuron fires only at the massive "
        "token, restoring its output there gives back the unedited forward exactly (1 by "
        "construction); it can fail only where the weight also acts on other tokens",
        kind="sanity",
        stat=lambda r: claims.Sample(_cols(r, "unedited", "zeroed", "restored"), _recovered),
        unit="texts",
        applies=_need_damage,
        details=_restore_details,
    ),
    claims.Spec(
        f"{NAME}.in_me_layer",
        "§2 claim 1 (the ME layer) against Yu et al. 2024 (an early down_proj)",
        "The super weight lies in the ME layer: zeroing the ME layer's top candidate removes more "
        "of the massive activation than zeroing any other layer's",
        "ρ_me / (ρ_me + max over the other layers' candidates of ρ), ρ = max(0, 1 − c) the share of "
        "the excess a candidate's zeroing removes (c at max(ME layer, its layer)); each layer's "
        "candidates: its largest building W_down write at the massive token and Yu et al.'s "
        "coordinate of a spike layer; bootstrap over the prompts (distinct massive-token prefixes)",
        ">=",
        "super_weight_layer",
        "every other layer's top candidates zeroed alone on the same prompts (0.5: a tie)",
        stat=_beats,
        unit="prompts",
        massive_state=True,
        details=_layer_details,
        applies=lambda r: (
            _need_sw(replace(r, given=None)) or (None if r.layers else "no layer candidates")
        ),
    ),
)
claims.check_specs(SPECS)


def figures(result: Result) -> dict[str, go.Figure]:
    thr, sw = claims.threshold("super_weight_spike"), result.super_weight
    panels = {  # [series, layer, prompt]
        "down_proj input: max |x| (σ(gate)·up)": (result.in_max, result.others_in_max),
        "down_proj output: max |y| (before any post-norm)": (result.out_max, result.others_out_max),
    }
    series = ("massive token", "other tokens (max)")  # the median over prompts
    spikes = plotting.layer_panels(
        {t: dict(zip(series, np.median(v, -1).tolist(), strict=True)) for t, v in panels.items()},
        f"down_proj spikes at the massive token (median over {result.n_prompts} prompts) — "
        f"{result.model}<br><sup>dotted: Yu et al.'s spike threshold {thr:g}; super weight: "
        f"{sw.label() if sw else 'none'}</sup>",
        result.me_layer,
        colors=("firebrick", "gray"),
        hline=thr,
    )
    if result.texts is None:
        return {"down_proj_spikes": spikes}
    base, damage = result.ppl("unedited"), claims.threshold("ppl_damage")
    labels = ("unedited", "super weight zeroed", "zeroed + super activation restored")
    values = {k: result.ppl(e) for k, e in zip(labels, EDITS, strict=False)}
    values |= {
        f"{c.label()} zeroed": base * result.layer_ppl_ratio(c) for c in result.layers if c.nll
    }
    seeds = [base * r for r in np.exp(result.random_cells().mean(0))]
    ppl = plotting.bars(
        values,
        f"Perplexity under each zeroing — {result.model}<br><sup>{result.n_texts} texts of ≤ "
        f"{max(result.text_lengths)} tokens; dashed: the unedited perplexity × {damage:g} "
        "('ppl_damage')</sup>",
        "perplexity",
        base * damage,
        points={"random large weights zeroed (each seed)": seeds},
    )
    return {"down_proj_spikes": spikes, "perplexity": ppl}


def summary(result: Result) -> str:
    sw = result.super_weight
    lines = [
        f"model: {result.model}   ME layer {result.me_layer} (1-based {result.me_layer + 1})   "
        f"{result.n_prompts} prompts   {'given weight' if result.given else 'super weight'}: "
        + (f"{sw.label()} = {sw.weight:.4g} (stability {sw.stability:.0%})" if sw else "none"),
        "",
        fmt_table(dp.CANDIDATE_COLUMNS, [c.cells() for c in result.candidates[:10]])
        if result.candidates
        else "(no candidate)",
    ]
    if result.texts is not None:
        ppl = ", ".join(f"{k} {result.ppl(k):.4g}" for k in EDITS)
        lines += ["", f"perplexity: {ppl} ({result.n_texts} texts)"]
    if result.layers:
        p = result.precursor
        rows = [(*c.coord, c.why, result.left(c), result.layer_ppl_ratio(c)) for c in result.layers]
        lines += [
            "",
            f"every layer's top candidate zeroed alone (precursor: {p.label() if p else 'none'}):",
            fmt_table(["layer", "row", "col", "why", "excess left", "ppl ×"], rows),
        ]
    return "\n".join(lines)


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, ("down_proj_spikes",), inputs=inputs
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
