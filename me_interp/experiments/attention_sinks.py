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

Claims (:data:`SPECS`; thresholds from ``claims.THRESHOLDS``; intervals bootstrapped over prompts). On
a model without a massive activation ``run`` raises ``claims.NotApplicable``.

    python -m me_interp.experiments.attention_sinks            # bundled model, built-in prompts

``result.json`` keys are documented in docs/probes.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, names, plotting
from me_interp.experiments._layer_report import (
    DetectConfig,
    LayerReport,
    as_array,
    detect,
    relative_drop,
)
from me_interp.experiments.common import cli_main, model_for
from me_interp.models import LoadedModel
from me_interp.probes.attention import AttentionRecorder
from me_interp.probes.batching import record
from me_interp.probes.geometry import METRICS, GeometryRecorder
from me_interp.probes.norms import NormRecorder

NAME = "attention_sinks"

SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "attention_sinks.sink_downstream",
        "§2.4, §2.6",
        "The attention sink on the massive token appears downstream of the ME layer and not before",
        statistic="(mean sink rate over layers > ME − max sink rate over layers ≤ ME) / the larger of "
        "the two; sink rate = share of heads whose mean attention to the massive token reaches "
        "the sink threshold (per-layer means over prompts)",
        op=">=",
        threshold="relative_rise",
        control="the layers up to the ME layer, whose attention runs before the massive activation",
    ),
    claims.Spec(
        "attention_sinks.entropy_drop",
        "§2.4",
        "Attention collapses after the ME layer: the attention entropy is lower downstream",
        statistic="1 − mean entropy over layers > ME / mean entropy over layers ≤ ME (per prompt: "
        "mean over heads and queries)",
        op=">=",
        threshold="relative_drop",
        control="the same prompts' attention at the layers up to the ME layer",
    ),
    claims.Spec(
        "attention_sinks.rank_drop_all",
        "§2.4",
        "The effective rank of the token states (all tokens) drops from the ME layer on — implied by "
        "one token whose norm is much larger than the others' (a sanity check, not evidence)",
        statistic="1 − mean effective rank over layers ≥ ME / mean over layers < ME (all real "
        "tokens of each prompt)",
        op=">=",
        threshold="relative_drop",
        control="rank_drop_others (without the massive token)",
        kind="sanity",
    ),
    claims.Spec(
        "attention_sinks.rank_drop_others",
        "§2.4",
        "The other tokens' representations collapse from the ME layer on (effective rank of the token "
        "states without the massive token drops)",
        statistic="1 − mean effective rank over layers ≥ ME / mean over layers < ME (real tokens "
        "of each prompt except the massive one)",
        op=">=",
        threshold="relative_drop",
        control="the same prompts' layer outputs before the ME layer",
    ),
)
SINK_DOWNSTREAM, ENTROPY_DROP, RANK_DROP_ALL, RANK_DROP_OTHERS = SPECS


@dataclass(frozen=True)
class Config(DetectConfig):
    """Attention-sink settings (those of :class:`DetectConfig`; the sink threshold is
    ``claims.THRESHOLDS['sink_attention']``)."""


@dataclass
class Result(LayerReport):
    """What :func:`run` measured. ``per_prompt`` holds ``[prompt][layer]``: ``sink_rate`` (share of
    heads at or above the sink threshold), ``attn_to_massive`` and ``attn_entropy`` (means over
    heads), ``effective_rank`` and ``effective_rank_others``."""

    eps: float
    reference_positions: list[int]
    massive_positions: list[list[int]]
    attn_to_each_position: dict[int, list[float]]
    per_prompt: dict[str, list] = field(default_factory=dict)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "n_prompts": self.n_prompts,
            "eps": self.eps,
            "reference_positions": self.reference_positions,
            "massive_positions": self.massive_positions,
            "layers": self.layers,
            "attn_to_each_position": {str(k): v for k, v in self.attn_to_each_position.items()},
            "per_prompt": self.per_prompt,
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Measure sinks, entropy and geometry at every layer. No printing, no files.

    Raises:
        claims.NotApplicable: the model has no massive activation and ``cfg.layer`` is not given.
    """
    model = model_for(cfg, model)
    batch = model.tokenize(cfg.load_prompts())
    eps = claims.threshold("sink_attention")
    norms = NormRecorder(model, batch, names.SITES)
    att = AttentionRecorder(model, batch)
    geo = GeometryRecorder(model, batch)  # "others" without position 0
    record(model, batch, [norms, att, geo])
    det = detect(cfg, model, norms.result())
    ref = det.reference
    moved = [b for b, r in enumerate(ref) if r != 0]
    if moved:  # the geometry without the massive token, where it is not the first token
        geo.reference = torch.tensor(ref, dtype=torch.long)
        record(model, batch, [geo], rows=moved)
    mpos = [sorted(set(ps) | {r}) for ps, r in zip(det.massive_positions, ref)]
    ap = att.probe(reference=ref, massive_positions=mpos, eps=eps)
    gs = geo.result()
    to_ref = ap.to_ref  # [layer batch head]
    sink_pp = (to_ref >= eps).float().mean(-1)  # [layer batch]
    hs = (to_ref >= eps).float().mean(1).tolist()  # [layer head]
    sink = sink_pp.mean(-1).tolist()
    to_m, bos, ent = ap.mean_to_ref(), ap.mean_bos(), ap.mean_entropy()
    hto, hent = ap.head_to_ref(), ap.head_entropy()
    g = {(m, t): gs.mean(m, t) for m in METRICS for t in ("all", "others")}
    layers = []
    for i in range(model.n_layers):
        row: dict[str, Any] = {
            "layer": i,
            "layer_1based": i + 1,
            "sink_rate": sink[i],
            "attn_to_massive": to_m[i],
            "bos_attention": bos[i],
            "attn_entropy": ent[i],
            "head_sink_rate": hs[i],
            "head_attn_to_massive": hto[i],
            "head_attn_entropy": hent[i],
        }
        for m in METRICS:
            row[m] = g[(m, "all")][i]
            row[f"{m}_others"] = g[(m, "others")][i]
        layers.append(row)
    er = gs.values["effective_rank"]
    result = Result(
        model=model.name,
        bos=model.bos,
        bos_prepended=model.bos_prepended(batch),
        n_prompts=len(batch),
        me_layer=det.me_layer,
        detected_me_layer=det.location.me_layer,
        eps=eps,
        reference_positions=list(ap.reference),
        massive_positions=ap.massive_positions,
        layers=layers,
        attn_to_each_position=ap.mean_to_each(),
        per_prompt={
            "sink_rate": sink_pp.T.tolist(),
            "attn_to_massive": to_ref.mean(-1).T.tolist(),
            "attn_entropy": ap.entropy.mean(-1).T.tolist(),
            "effective_rank": er["all"].T.tolist(),
            "effective_rank_others": er["others"].T.tolist(),
        },
        seed=cfg.seed,
    )
    return result


def _sink_shift(a: np.ndarray, me: int) -> float:
    """``(mean after − max before) / max(both)`` of the per-layer mean sink rate (0 when both are 0)."""
    curve = a.mean(0)
    before, after = curve[: me + 1].max(), curve[me + 1 :].mean()
    top = max(before, after)
    return 0.0 if top == 0 else float((after - before) / top)


def verdicts(result: Result) -> list[claims.Claim]:
    """Claims 4 and 6 on this model, with intervals bootstrapped over prompts."""
    me, seed, pp = result.me_layer, result.seed, result.per_prompt
    n = len(result.layers)
    at = f"ME layer {result.me_text()}"
    out: list[claims.Claim] = []
    if me == n - 1:
        why = "the ME layer is the last layer: no attention reads the massive activation"
        out += [SINK_DOWNSTREAM.not_applicable(why), ENTROPY_DROP.not_applicable(why)]
    else:
        sink = as_array(pp, "sink_rate")
        curve = sink.mean(0)
        out.append(
            SINK_DOWNSTREAM.judge(
                claims.bootstrap(sink, lambda a: _sink_shift(a, me), seed=seed),
                details=f"{at}; sink threshold {result.eps:g}; per-layer sink rate: max over layers "
                f"≤ ME {curve[: me + 1].max():.3g} (layer {int(curve[: me + 1].argmax())}), at ME "
                f"{curve[me]:.3g}, mean over layers > ME {curve[me + 1 :].mean():.3g}",
            )
        )
        ent = as_array(pp, "attn_entropy")
        eb, ea = ent[:, : me + 1].mean(1), ent[:, me + 1 :].mean(1)
        out.append(
            ENTROPY_DROP.judge(
                relative_drop(eb, ea, seed),
                details=f"{at}; mean attention entropy over layers ≤ ME {eb.mean():.3g} nats, over "
                f"layers > ME {ea.mean():.3g} nats",
            )
        )
    if me == 0:
        why = "the ME layer is layer 0: no layer output before it"
        out += [RANK_DROP_ALL.not_applicable(why), RANK_DROP_OTHERS.not_applicable(why)]
        return out
    for spec, key in (
        (RANK_DROP_ALL, "effective_rank"),
        (RANK_DROP_OTHERS, "effective_rank_others"),
    ):
        er = as_array(pp, key)
        rb, ra = er[:, :me].mean(1), er[:, me:].mean(1)
        out.append(
            spec.judge(
                relative_drop(rb, ra, seed),
                details=f"{at}; mean effective rank over layers < ME {rb.mean():.3g}, over layers "
                f"≥ ME {ra.mean():.3g}; at layer {me - 1} {er[:, me - 1].mean():.3g}, at ME "
                f"{er[:, me].mean():.3g}",
            )
        )
    return out


def _head_heatmap(z: list[list[float]], title: str, cbar: str, me: int | None, **kw) -> go.Figure:
    fig = go.Figure(
        go.Heatmap(
            z=[list(r) for r in zip(*z)],  # heads on y, layers on x
            x=list(range(len(z))),
            y=list(range(len(z[0]) if z else 0)),
            colorbar_title=cbar,
            hovertemplate="layer %{x}, head %{y}: %{z:.3g}<extra></extra>",
            **kw,
        )
    )
    fig.update_layout(
        title=title, xaxis_title="layer (0-based)", yaxis_title="head", template="plotly_white"
    )
    return plotting.mark_layer(fig, me)


def figures(result: Result) -> dict[str, go.Figure]:
    me = result.me_layer
    lines = {
        f"sink rate (share of heads with mean attention ≥ {result.eps:g})": result.series(
            "sink_rate"
        ),
        "mean attention to the massive token": result.series("attn_to_massive"),
        "BOS metric: 2nd-half queries → position 0": result.series("bos_attention"),
    }
    if len(result.attn_to_each_position) > 1:  # several massive positions: one line each
        for p, ys in result.attn_to_each_position.items():
            lines[f"mean attention to massive position {p}"] = ys
    sink = plotting.layer_lines(
        lines,
        "Attention sink on the massive token per layer (mean over prompts and heads)",
        "share / attention probability (0–1)",
        me,
    )
    to = _head_heatmap(
        result.series("head_attn_to_massive"),
        "Mean attention to the massive token per layer and head (mean over prompts and queries)",
        "attention",
        me,
        zmin=0,
        zmax=1,
        colorscale="Viridis",
    )
    ent = _head_heatmap(
        result.series("head_attn_entropy"),
        "Attention entropy per layer and head (nats; mean over prompts and queries)",
        "nats",
        me,
        colorscale="Cividis",
    )
    rank = plotting.layer_lines(
        {
            "effective rank, all tokens": result.series("effective_rank"),
            "effective rank, without the massive token": result.series("effective_rank_others"),
            "participation ratio, all tokens": result.series("participation_ratio"),
            "participation ratio, without the massive token": result.series(
                "participation_ratio_others"
            ),
        },
        "Effective dimension of the token states (layer output) per layer, mean over prompts",
        "effective rank / participation ratio (number of dims)",
        me,
    )
    cos = plotting.layer_lines(
        {
            "all tokens": result.series("mean_cos"),
            "without the massive token": result.series("mean_cos_others"),
        },
        "Mean pairwise cosine of the token states (layer output) per layer",
        "cosine (1 = all tokens parallel)",
        me,
    )
    return {
        "sink_rate": sink,
        "attn_to_massive_heads": to,
        "attn_entropy_heads": ent,
        "rank_curves": rank,
        "mean_cosine": cos,
    }


def summary(result: Result) -> str:
    head = (
        f"model: {result.model}   bos: {result.bos}   prompts: {result.n_prompts}   eps: {result.eps}"
        "   ME layer: " + result.me_text()
    )
    table = result.layer_table(
        ["sink rate", "attn->m", "BOS", "entropy", "eff rank", "eff rank (others)"],
        lambda r: (
            r["sink_rate"],
            r["attn_to_massive"],
            r["bos_attention"],
            r["attn_entropy"],
            r["effective_rank"],
            r["effective_rank_others"],
        ),
    )
    return "\n\n".join([head, table])


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
