"""Attention sinks and representation geometry per layer and head, with the ME layer marked.

Tests paper.md §2 claims 4 and 6 (``probes.attention``, ``probes.geometry``): per layer and head, the mean
attention to the massive token (and to each massive position), the sink rate of Gu et al. (share of
heads whose mean attention to the token exceeds ε), the BOS-attention metric (attention from the second
half of the queries to position 0) and the attention entropy; per layer, the effective rank,
participation ratio and mean pairwise cosine of the token states, over all tokens and without the
massive one. Does the sink appear only downstream of the ME layer? Does the rank collapse there?

    python -m me_interp.experiments.attention_sinks            # bundled model, built-in prompts
    python -m me_interp.experiments.attention_sinks --eps 0.5

``result.json`` keys are documented in docs/probes.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

from me_interp import plotting
from me_interp.experiments.common import (
    cli_main,
    fmt_verdicts,
    model_for,
)
from me_interp.experiments.mechanism import DetectConfig, LayerReport, detect
from me_interp.models import LoadedModel
from me_interp.probes.attention import attention_probe
from me_interp.probes.geometry import METRICS, geometry_scan

NAME = "attention_sinks"
MARGIN = 0.05  # a "lower after ME" verdict needs a relative drop of at least 5 %


@dataclass(frozen=True)
class Config(DetectConfig):
    """Attention-sink settings.

    Attributes:
        eps: sink threshold ε of the sink rate (Gu et al.: 0.3).
    """

    eps: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"eps must be in [0, 1), got {self.eps}")


@dataclass
class Result(LayerReport):
    eps: float
    reference_positions: list[int]
    massive_positions: list[list[int]]
    attn_to_each_position: dict[int, list[float]]
    verdicts: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "n_prompts": self.n_prompts,
            "eps": self.eps,
            "reference_positions": self.reference_positions,
            "massive_positions": self.massive_positions,
            "verdicts": self.verdicts,
            "layers": self.layers,
            "attn_to_each_position": {str(k): v for k, v in self.attn_to_each_position.items()},
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Measure sinks, entropy and geometry at every layer. No printing, no files."""
    model = model_for(cfg, model)
    batch = model.tokenize(cfg.load_prompts())
    loc, ref = detect(model, batch, cfg.criterion, cfg.position)
    ref_list = ref if ref is not None else [0] * len(batch)
    mpos = None
    if ref is not None and loc.massive_positions:
        mpos = [sorted(set(ps) | {r}) for ps, r in zip(loc.massive_positions, ref_list)]
    ap = attention_probe(model, batch, reference=ref_list, massive_positions=mpos, eps=cfg.eps)
    geo = geometry_scan(model, batch, positions=ref)
    sink, to_ref, bos, ent = ap.sink_rate(), ap.mean_to_ref(), ap.mean_bos(), ap.mean_entropy()
    hs, hto, hent = ap.head_sink_rate(), ap.head_to_ref(), ap.head_entropy()
    g = {(m, t): geo.mean(m, t) for m in METRICS for t in ("all", "others")}
    layers = []
    for i in range(model.n_layers):
        row: dict[str, Any] = {
            "layer": i,
            "layer_1based": i + 1,
            "sink_rate": sink[i],
            "attn_to_massive": to_ref[i],
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
    result = Result(
        model=model.name,
        bos=model.bos,
        bos_prepended=model.bos_prepended(batch),
        n_prompts=len(batch),
        me_layer=loc.me_layer,
        eps=cfg.eps,
        reference_positions=list(ap.reference),
        massive_positions=ap.massive_positions,
        layers=layers,
        attn_to_each_position=ap.mean_to_each(),
    )
    result.verdicts = verdicts(result)
    return result


def _mean(xs) -> float:
    xs = [x for x in xs if isinstance(x, float) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def verdicts(result: Result) -> list[dict]:
    """Claims 4 and 6 on this model (None when there is no ME layer or no layer on one side)."""
    me = result.me_layer
    n = len(result.layers)
    if me is None or me == 0 or me >= n - 1:
        where = (
            "no ME layer detected" if me is None else f"ME layer {me} leaves no layer on one side"
        )
        return [
            {
                "claim": "The attention sink on the massive token appears downstream of the ME layer",
                "measured": f"{where}: nothing to compare",
                "holds": None,
            }
        ]
    before, after = range(0, me), range(me + 1, n)
    sink = result.series("sink_rate")
    sb, sa = max(sink[i] for i in before), _mean([sink[i] for i in after])
    out = [
        {
            "claim": "The attention sink on the massive token appears downstream of the ME layer and "
            "not before (max sink rate before ME ≤ half the mean sink rate after)",
            "measured": f"sink rate (ε = {result.eps}): max over layers < {me} = {sb:.3g}; mean over "
            f"layers > {me} = {sa:.3g}; at ME {sink[me]:.3g}",
            "holds": bool(sa > 0 and sb <= 0.5 * sa),
        }
    ]
    ent = result.series("attn_entropy")
    eb, ea = _mean([ent[i] for i in before]), _mean([ent[i] for i in after])
    out.append(
        {
            "claim": "Attention collapses onto the massive token after the ME layer: mean "
            f"attention entropy after ME at least {100 * MARGIN:.0f} % lower than before",
            "measured": f"mean entropy before {eb:.3g} nats, after {ea:.3g} nats",
            "holds": bool(ea < (1 - MARGIN) * eb),
        }
    )
    for key, who in (
        ("effective_rank", "all tokens"),
        ("effective_rank_others", "without the massive token"),
    ):
        er = result.series(key)
        rb, ra = _mean([er[i] for i in before]), _mean([er[i] for i in after])
        out.append(
            {
                "claim": f"The effective rank of the token states ({who}) is at least "
                f"{100 * MARGIN:.0f} % lower after the ME layer than before",
                "measured": f"mean effective rank before {rb:.3g}, after {ra:.3g}; at layer {me - 1}: "
                f"{er[me - 1]:.3g}, at ME {er[me]:.3g}",
                "holds": bool(ra < (1 - MARGIN) * rb),
            }
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
        f"sink rate (share of heads with mean attention > {result.eps})": result.series(
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
    ver = fmt_verdicts(result.verdicts)
    return "\n\n".join([head, table, ver])


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
