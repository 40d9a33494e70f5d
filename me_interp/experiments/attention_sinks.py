"""Attention sinks and representation geometry per layer and head, with the ME layer marked.

Tests paper.md §2 claims 4 and 6 (``probes.attention``, ``probes.geometry``): per layer and head, the mean
attention to the massive token (and to each massive position), the sink rate (share of heads whose mean
attention to the token reaches ``claims.THRESHOLDS['sink_attention']``; Gu et al. 2024), the
BOS-attention metric (attention from the second half of the queries to position 0) and the attention
entropy; per layer, the effective rank, participation ratio and mean pairwise cosine of the token
states, over all tokens and without the massive one. Does the sink appear only downstream of the ME
layer? Does the rank collapse there?

*Before* and *after* the massive activation: a layer's attention reads the layer's input, so for the
attention statistics the ME layer's own attention is *before* (layers ≤ ME vs > ME); the geometry is of
layer outputs, so there the ME layer is *after* (layers < ME vs ≥ ME).

Cost: one forward over every prompt records the norms (detection), the attention statistics towards
every key position and the geometry without position 0; prompts whose massive token is elsewhere are
re-run for the geometry without it (``probes.batching``).

    python -m me_interp.experiments.attention_sinks            # bundled model, built-in prompts

``result.json`` keys are documented in docs/probes.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from me_interp import claims, plotting
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.geometry import METRICS
from me_interp.probes.sinks import sink_scan
from me_interp.probes.site import Site
from me_interp.study import BackendConfig, DetectConfig, Experiment, Inputs, command, prepare
from me_interp.study.layer_report import LayerReport, as_array, detect

NAME = "attention_sinks"


@dataclass(frozen=True)
class Config(DetectConfig, BackendConfig):
    """Attention-sink settings (those of :class:`DetectConfig`; the sink threshold is
    ``claims.THRESHOLDS['sink_attention']``).

    Attributes:
        backend: ``tl`` (TransformerLens) or ``nnsight`` (a plain HF model under nnsight with eager
            attention; the statistics are reduced inside the trace, ``docs/remote.md``).
        remote: with ``nnsight``: run on NDIF (key in ``NDIF_API_KEY``; needs a model served with
            attention weights).
    """


@dataclass(frozen=True)
class Layer:
    """Per layer (means over prompts): the sink rate (share of heads at or above the sink
    threshold), the attention to the massive token, the BOS metric, the attention entropy (means
    over heads, and per head), and the geometry of the layer output (``probes.geometry.METRICS``,
    with all tokens and without the massive token)."""

    layer: int
    layer_1based: int
    sink_rate: float
    attn_to_massive: float
    bos_attention: float
    attn_entropy: float
    head_sink_rate: list[float]
    head_attn_to_massive: list[float]
    head_attn_entropy: list[float]
    mean_cos: float
    mean_cos_others: float
    effective_rank: float
    effective_rank_others: float
    participation_ratio: float
    participation_ratio_others: float


@dataclass(frozen=True)
class PerPrompt:
    """``[prompt][layer]``: ``sink_rate`` (share of heads at or above the sink threshold),
    ``attn_to_massive`` and ``attn_entropy`` (means over heads), ``effective_rank`` and
    ``effective_rank_others``."""

    sink_rate: list[list[float]]
    attn_to_massive: list[list[float]]
    attn_entropy: list[list[float]]
    effective_rank: list[list[float]]
    effective_rank_others: list[list[float]]


@dataclass(frozen=True)
class Result(LayerReport):
    """What :func:`run` measured (see :class:`Layer`, :class:`PerPrompt`); ``attn_to_each_position``:
    per key position, the mean attention to it per layer."""

    eps: float
    reference_positions: list[int]
    massive_positions: list[list[int]]
    layers: list[Layer]
    attn_to_each_position: dict[int, list[float]]
    per_prompt: PerPrompt


def inputs(cfg: Config, model: LoadedModel) -> Inputs:
    """The prompts and one forward pass: norms, attention statistics and geometry (``made``)."""
    batch = model.tokenize(cfg.load_prompts())
    sc = sink_scan(model, batch)
    return Inputs(batch, sc.norms, made=(sc,))


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Measure sinks, entropy and geometry at every layer. No printing, no files.

    Raises:
        claims.NotApplicable: the model has no massive activation and ``cfg.layer`` is not given.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    batch, (sc,) = site.batch, site.inputs.made
    eps = claims.threshold("sink_attention")
    det = detect(site)
    ref = det.reference
    att = sc.attention
    gs = sc.geometry(ref)  # "others" without each prompt's massive token
    mpos = [sorted(set(ps) | {r}) for ps, r in zip(det.massive_positions, ref)]
    ap = att.probe(reference=ref, massive_positions=mpos, eps=eps)
    to_ref = ap.to_ref  # [layer batch head]
    sink_pp = (to_ref >= eps).float().mean(-1)  # [layer batch]
    hs = (to_ref >= eps).float().mean(1).tolist()  # [layer head]
    sink = sink_pp.mean(-1).tolist()
    to_m, bos, ent = ap.mean_to_ref(), ap.mean_bos(), ap.mean_entropy()
    hto, hent = ap.head_to_ref(), ap.head_entropy()
    g = {(m, t): gs.mean(m, t) for m in METRICS for t in ("all", "others")}
    layers = [
        Layer(
            layer=i,
            layer_1based=i + 1,
            sink_rate=sink[i],
            attn_to_massive=to_m[i],
            bos_attention=bos[i],
            attn_entropy=ent[i],
            head_sink_rate=hs[i],
            head_attn_to_massive=hto[i],
            head_attn_entropy=hent[i],
            **{m: g[(m, "all")][i] for m in METRICS},
            **{f"{m}_others": g[(m, "others")][i] for m in METRICS},
        )
        for i in range(model.n_layers)
    ]
    er = gs.values["effective_rank"]
    return Result(
        **det.report_fields(cfg, model, batch),
        eps=eps,
        reference_positions=list(ap.reference),
        massive_positions=ap.massive_positions,
        layers=layers,
        attn_to_each_position=ap.mean_to_each(),
        per_prompt=PerPrompt(
            sink_rate=sink_pp.T.tolist(),
            attn_to_massive=to_ref.mean(-1).T.tolist(),
            attn_entropy=ap.entropy.mean(-1).T.tolist(),
            effective_rank=er["all"].T.tolist(),
            effective_rank_others=er["others"].T.tolist(),
        ),
    )


def _attention_applies(r: Result) -> str | None:
    if r.me_layer == len(r.layers) - 1:
        return "the ME layer is the last layer: no attention reads the massive activation"
    return None


def _geometry_applies(r: Result) -> str | None:
    if r.me_layer == 0:
        return "the ME layer is layer 0: no layer output before it"
    return None


def _sink(r: Result, me: int | None = None) -> claims.Sample:
    me = r.me_layer if me is None else me
    return claims.Sample(
        as_array(r.per_prompt.attn_to_massive), claims.of_means(lambda m: claims.rise_after(m, me))
    )


def _placebo(stat: Callable[[Result, int], claims.Measure]) -> Callable[[Result], claims.Placebo]:
    """Every other split (layers ≤ l against > l, l < the last layer) in the ME layer's place."""
    return claims.placebo_of(stat, lambda r: r.me_layer, lambda r: range(len(r.layers) - 1))


def _sink_details(r: Result) -> str:
    me = r.me_layer
    parts = []
    for values, what in (
        (r.per_prompt.attn_to_massive, "mean attention to the massive token"),
        (r.per_prompt.sink_rate, f"sink rate (heads ≥ {r.eps:g})"),
    ):
        curve = as_array(values).mean(0)
        parts.append(
            f"{what}: max over layers ≤ ME {curve[: me + 1].max():.3g} (layer "
            f"{int(curve[: me + 1].argmax())}), at ME {curve[me]:.3g}, mean over layers > ME "
            f"{curve[me + 1 :].mean():.3g}"
        )
    return f"ME layer {r.me_text()}; " + "; ".join(parts)


def _entropy_rows(r: Result, me: int | None = None) -> np.ndarray:
    ent, me = as_array(r.per_prompt.attn_entropy), r.me_layer if me is None else me
    return claims.paired(ent[:, : me + 1].mean(1), ent[:, me + 1 :].mean(1))


def _entropy(r: Result, me: int | None = None) -> claims.Sample:
    return claims.Sample(_entropy_rows(r, me), claims.relative_drop)


def _entropy_details(r: Result) -> str:
    eb, ea = _entropy_rows(r).mean(0)
    return (
        f"ME layer {r.me_text()}; mean attention entropy over layers ≤ ME {eb:.3g} nats, over "
        f"layers > ME {ea:.3g} nats"
    )


def _ranks(r: Result, others: bool) -> np.ndarray:
    """``[prompt, layer]`` effective rank, without the massive token when ``others``."""
    return as_array(r.per_prompt.effective_rank_others if others else r.per_prompt.effective_rank)


def _rank_rows(r: Result, others: bool, split: int) -> np.ndarray:
    """Per prompt, the mean effective rank over layers < ``split`` and over layers ≥ ``split``."""
    er = _ranks(r, others)
    return claims.paired(er[:, :split].mean(1), er[:, split:].mean(1))


def _rank_others(r: Result, me: int | None = None) -> claims.Sample:
    """Layers ≤ ME against layers > ME: the other tokens meet the massive token only through the
    attention of the layers after it (the ME layer's own attention reads its input)."""
    me = r.me_layer if me is None else me
    return claims.Sample(_rank_rows(r, True, me + 1), claims.relative_drop)


def _rank_details(others: bool, shift: int = 0) -> Callable[[Result], str]:
    def details(r: Result) -> str:
        er, me = _ranks(r, others), r.me_layer + shift
        rb, ra = er[:, :me].mean(1).mean(), er[:, me:].mean(1).mean()
        return (
            f"ME layer {r.me_text()}; mean effective rank over layers < {me} {rb:.3g}, over layers "
            f"≥ {me} {ra:.3g}; at layer {me - 1} {er[:, me - 1].mean():.3g}, at layer {me} "
            f"{er[:, me].mean():.3g}"
        )

    return details


SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "attention_sinks.sink_downstream",
        "§2.4, §2.6",
        "The attention sink on the massive token appears downstream of the ME layer and not before",
        statistic="(mean over layers > ME − max over layers ≤ ME) / the larger of the two, of the "
        "attention to the massive token (per prompt and layer: the mean over heads and over the "
        "queries after it; per-layer means over prompts); the sink rate (share of heads at or "
        "above the sink threshold, a step function) in the details",
        op=">=",
        threshold="relative_rise",
        control="the layers up to the ME layer, whose attention runs before the massive activation",
        stat=_sink,
        applies=_attention_applies,
        details=_sink_details,
        placebo=_placebo(_sink),
    ),
    claims.Spec(
        "attention_sinks.entropy_drop",
        "§2.4",
        "Attention collapses after the ME layer: the attention entropy is lower downstream",
        statistic="1 − mean entropy over layers > ME / mean entropy over layers ≤ ME (per prompt: "
        "mean over heads and queries)",
        op=">=",
        threshold="relative_drop",
        control="the same prompts' attention at the layers up to the ME layer; placebo: the "
        "split at every other layer",
        stat=_entropy,
        applies=_attention_applies,
        details=_entropy_details,
        placebo=_placebo(_entropy),
    ),
    claims.Spec(
        "attention_sinks.rank_drop_all",
        "§2.4",
        "The effective rank of the token states (all tokens) drops from the ME layer on — implied "
        "by one token whose norm is much larger than the others' (a sanity check, not evidence)",
        statistic="1 − mean effective rank over layers ≥ ME / mean over layers < ME (all real "
        "tokens of each prompt)",
        op=">=",
        threshold="relative_drop",
        control="rank_drop_others (without the massive token)",
        kind="sanity",
        stat=lambda r: claims.Sample(_rank_rows(r, False, r.me_layer), claims.relative_drop),
        applies=_geometry_applies,
        details=_rank_details(False),
    ),
    claims.Spec(
        "attention_sinks.rank_drop_others",
        "§2.4",
        "The other tokens' representations collapse after the ME layer (effective rank of the "
        "token states without the massive token drops once later layers' attention reads it)",
        statistic="1 − mean effective rank over layers > ME / mean over layers ≤ ME (real tokens "
        "of each prompt except the massive one; the ME layer's own attention reads its input, "
        "before the massive activation)",
        op=">=",
        threshold="relative_drop",
        control="the same prompts' layer outputs up to the ME layer; placebo: the split at "
        "every other layer",
        stat=_rank_others,
        applies=_attention_applies,
        details=_rank_details(True, 1),
        placebo=_placebo(_rank_others),
    ),
)


def figures(result: Result) -> dict[str, go.Figure]:
    me, rows = result.me_layer, result.layers
    lines = {
        f"sink rate (share of heads with mean attention ≥ {result.eps:g})": [
            r.sink_rate for r in rows
        ],
        "mean attention to the massive token": [r.attn_to_massive for r in rows],
        "BOS metric: 2nd-half queries → position 0": [r.bos_attention for r in rows],
    }
    if len(result.attn_to_each_position) > 1:  # several massive positions: one line each
        for p, ys in result.attn_to_each_position.items():
            lines[f"mean attention to massive position {p}"] = ys
    return {
        "sink_rate": plotting.layer_lines(
            lines,
            "Attention sink on the massive token per layer (mean over prompts and heads)",
            "share / attention probability (0–1)",
            me,
        ),
        "attn_to_massive_heads": plotting.layer_head_heatmap(
            [r.head_attn_to_massive for r in rows],
            "Mean attention to the massive token per layer and head (mean over prompts and queries)",
            "attention",
            me,
            zmin=0,
            zmax=1,
            colorscale="Viridis",
        ),
        "attn_entropy_heads": plotting.layer_head_heatmap(
            [r.head_attn_entropy for r in rows],
            "Attention entropy per layer and head (nats; mean over prompts and queries)",
            "nats",
            me,
            colorscale="Cividis",
        ),
        "rank_curves": plotting.layer_lines(
            {
                "effective rank, all tokens": [r.effective_rank for r in rows],
                "effective rank, without the massive token": [
                    r.effective_rank_others for r in rows
                ],
                "participation ratio, all tokens": [r.participation_ratio for r in rows],
                "participation ratio, without the massive token": [
                    r.participation_ratio_others for r in rows
                ],
            },
            "Effective dimension of the token states (layer output) per layer, mean over prompts",
            "effective rank / participation ratio (number of dims)",
            me,
        ),
        "mean_cosine": plotting.layer_lines(
            {
                "all tokens": [r.mean_cos for r in rows],
                "without the massive token": [r.mean_cos_others for r in rows],
            },
            "Mean pairwise cosine of the token states (layer output) per layer",
            "cosine (1 = all tokens parallel)",
            me,
        ),
    }


def summary(result: Result) -> str:
    return result.layer_table(
        [f"eps: {result.eps}", f"ME layer: {result.me_text()}"],
        ["sink rate", "attn->m", "BOS", "entropy", "eff rank", "eff rank (others)"],
        lambda r: (
            r.sink_rate,
            r.attn_to_massive,
            r.bos_attention,
            r.attn_entropy,
            r.effective_rank,
            r.effective_rank_others,
        ),
    )


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("sink_rate",),
    inputs=inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
