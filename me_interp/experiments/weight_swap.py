"""Weight swap: exchange the ME layer's parameters with another layer's — does the emergence move?

For each part (``attn_norm``, ``ffn_norm``, ``ffn``, ``attn``, ``block``; ``me_interp.edits``) and each
partner layer ``p``, the part of the ME layer ``m`` and of ``p`` are exchanged
(``θ_m ↔ θ_p``, :func:`me_interp.edits.swapped_layers`) and the ME layer is located again
(``probes.find_me_layer``). The emergence *moved* when the new ME layer is ``p``, *stayed* when it is
``m``, *vanished* when no layer output is massive. Also measured after each swap: the massive ratio
``R_l = median_prompts max_t ‖h_{l,t}‖ / mean_{t≠argmax} ‖h_{l,t}‖`` at the partner layer, the ME layer
and the last layer, and the attention sink (attention mass on the baseline's massive position, largest
head, mean over prompts; ``probes.attention_stats``) downstream of ``m``.

Defaults run on the bundled model: the detected ME layer against every other layer, parts
``ffn_norm ffn attn block``, 4 built-in prompts cut to 12 tokens (``4 × 29`` swaps).

    python -m me_interp.experiments.weight_swap
    python -m me_interp.experiments.weight_swap --parts block --partners 0 5 20 --model synthetic:planted

What the four weight experiments share (:class:`WeightConfig`, :func:`prepare`, :func:`measure`) is
in ``me_interp.experiments._weights``; it is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from tqdm.auto import tqdm

from me_interp.edits import PARTS, check_part, swapped_layers
from me_interp.experiments._weights import (
    Measurement,
    Setup,
    WeightConfig,
    check_layers,
    measure,
    prepare,
    short_batch,
)
from me_interp.experiments.common import INDEX_CONVENTION, cli_main, fmt_table
from me_interp.models import LoadedModel

NAME = "weight_swap"


# ------------------------------------------------------------------------------------------
# the experiment
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config(WeightConfig):
    """Weight-swap settings.

    Attributes:
        partners: layers to swap with (``()`` = every other layer).
        parts: the components to swap, each separately.
    """

    partners: tuple[int, ...] = ()
    parts: tuple[str, ...] = ("ffn_norm", "ffn", "attn", "block")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.parts:
            raise ValueError(f"give at least one part to swap ({', '.join(PARTS)})")
        for p in self.parts:
            check_part(p)


@dataclass
class Result:
    model: str
    bos: str
    layer: int
    partners: list[int]
    parts: list[str]
    baseline: Measurement
    rows: list[dict[str, Any]]
    n_prompts: int
    prompt_lengths: list[int]

    def fractions(self, part: str) -> dict[str, float]:
        rows = [r for r in self.rows if r["part"] == part]
        n = max(len(rows), 1)
        return {
            "moved": sum(r["outcome"] == "moved" for r in rows) / n,
            "stayed": sum(r["outcome"] == "stayed" for r in rows) / n,
            "vanished": sum(r["outcome"] == "vanished" for r in rows) / n,
            "elsewhere": sum(r["outcome"] == "elsewhere" for r in rows) / n,
        }

    def headline(self) -> dict[str, Any]:
        ffn_parts = [p for p in self.parts if p in ("ffn_norm", "ffn", "block")]
        if not ffn_parts:
            return {"holds": None, "reason": "no FFN-path part (ffn_norm, ffn, block) was swapped"}
        best = max(ffn_parts, key=lambda p: self.fractions(p)["moved"])
        moved = self.fractions(best)["moved"]
        return {
            "holds": moved >= 0.5,
            "moved_fraction": round(moved, 4),
            "part": best,
            "rule": "holds when swapping some FFN-path part (ffn_norm, ffn or block) moves the ME "
            "layer to the partner layer for at least half of the partners",
        }

    def to_dict(self) -> dict[str, Any]:
        b = self.baseline
        return {
            "claim": "The massive activation is made by the ME layer's own FFN-path weights (pre-FFN "
            "RMSNorm gain and FFN): exchanging them with another layer's moves the emergence to that layer.",
            "baseline": {
                "me_layer": b.me_layer,
                "me_layer_1based": None if b.me_layer is None else b.me_layer + 1,
                "ratio_at_layer": b.ratio_at(self.layer),
                "ratio_last": b.top_ratio[-1],
                "sink_downstream": b.sink_after(self.layer),
            },
            "intervened": {
                p: {
                    **self.fractions(p),
                    "me_layers": [r["me_layer"] for r in self.rows if r["part"] == p],
                }
                for p in self.parts
            },
            "verdict": self.headline(),
            "model": self.model,
            "bos": self.bos,
            "index_convention": INDEX_CONVENTION,
            "layer": self.layer,
            "layer_1based": self.layer + 1,
            "partners": self.partners,
            "parts": self.parts,
            "n_prompts": self.n_prompts,
            "prompt_lengths": self.prompt_lengths,
            "rows": self.rows,
            "baseline_detail": b.to_dict(),
        }


def outcome(me_after: int | None, layer: int, partner: int) -> str:
    """``moved`` (ME layer = partner), ``stayed`` (= the original layer), ``vanished`` or ``elsewhere``."""
    if me_after is None:
        return "vanished"
    if me_after == partner:
        return "moved"
    return "stayed" if me_after == layer else "elsewhere"


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Swap each part of the ME layer with each partner layer and measure. No printing, no files.

    Raises:
        ValueError: a partner out of range or equal to the layer (a swap with itself).
    """
    s = prepare(cfg, model)
    m = s.layer
    assert m is not None  # prepare(require_layer=True) raises otherwise
    if cfg.partners:
        partners = check_layers(s.model, cfg.partners, "--partners")
        if m in partners:
            raise ValueError(
                f"--partners contains the swapped layer {m}: cannot swap a layer with itself"
            )
    else:
        partners = [p for p in range(s.model.n_layers) if p != m]
    rows = []
    todo = [(part, p) for part in cfg.parts for p in partners]
    for part, p in tqdm(todo, desc=f"{NAME} (layer {m})", disable=None):
        with swapped_layers(s.model, m, p, part):
            after = measure(s.model, s.batch, s.criterion, s.positions, cfg.sink)
        rows.append(
            {
                "part": part,
                "partner": p,
                "me_layer": after.me_layer,
                "outcome": outcome(after.me_layer, m, p),
                "event_layers": after.event_layers,
                "ratio_at_partner": after.ratio_at(p),
                "ratio_at_layer": after.ratio_at(m),
                "ratio_last": after.top_ratio[-1],
                "sink_downstream": after.sink_after(m),
                "top_ratio": after.top_ratio,
                "sink": after.sink,
            }
        )
    return Result(
        model=s.model.name,
        bos=s.model.bos,
        layer=m,
        partners=partners,
        parts=list(cfg.parts),
        baseline=s.baseline,
        rows=rows,
        n_prompts=len(s.batch),
        prompt_lengths=s.batch.lengths,
    )


def _grid(result: Result, key: str) -> list[list[Any]]:
    index = {(r["part"], r["partner"]): r[key] for r in result.rows}
    return [[index.get((part, p)) for p in result.partners] for part in result.parts]


def figures(result: Result) -> dict[str, go.Figure]:
    xs = [str(p) for p in result.partners]
    me = _grid(result, "me_layer")
    z_me = [[-1 if v is None else v for v in row] for row in me]
    text = [["none" if v is None else str(v) for v in row] for row in me]
    fig_me = go.Figure(
        go.Heatmap(
            z=z_me,
            x=xs,
            y=result.parts,
            text=text,
            texttemplate="%{text}",
            colorscale="Viridis",
            zmin=-1,
            colorbar_title="ME layer<br>(-1: none)",
            hovertemplate="swap %{y} of layer "
            + str(result.layer)
            + " with layer %{x}<br>ME layer after: %{text}<extra></extra>",
        )
    )
    fig_me.update_layout(
        title=f"ME layer after swapping layer {result.layer}'s part with the partner layer — {result.model}"
        f"<br><sup>baseline ME layer {result.baseline.me_layer} (0-based); 'moved' = ME layer equals the partner</sup>",
        xaxis_title="partner layer (0-based)",
        yaxis_title="swapped part",
        template="plotly_white",
    )
    ratio = _grid(result, "ratio_at_partner")
    fig_ratio = go.Figure(
        go.Heatmap(
            z=[[math.log10(v) if v and v > 0 else None for v in row] for row in ratio],
            x=xs,
            y=result.parts,
            customdata=ratio,
            colorscale="Magma",
            colorbar_title="log10 ratio",
            hovertemplate="swap %{y} with layer %{x}<br>massive ratio at the partner layer: "
            "%{customdata:.4g}<extra></extra>",
        )
    )
    fig_ratio.update_layout(
        title=f"Massive ratio (max token / mean others) at the partner layer after the swap — {result.model}"
        f"<br><sup>baseline ratio at layer {result.layer}: {result.baseline.ratio_at(result.layer):.4g}</sup>",
        xaxis_title="partner layer (0-based)",
        yaxis_title="swapped part",
        template="plotly_white",
    )
    return {"me_layer_after_swap": fig_me, "ratio_at_partner": fig_ratio}


def verdicts(result: Result) -> list[dict[str, Any]]:
    """One verdict per swapped part, and the headline (see :meth:`Result.headline`)."""
    out = []
    head = result.headline()
    out.append(
        {
            "claim": "The emergence moves with the ME layer's FFN-path weights (weight swap)",
            "measured": f"best FFN-path part {head.get('part')}: ME layer moved to the partner for "
            f"{head.get('moved_fraction', 0):.0%} of {len(result.partners)} partners",
            "holds": head["holds"],
        }
    )
    for part in result.parts:
        f = result.fractions(part)
        out.append(
            {
                "claim": f"Swapping the ME layer's {part} into another layer moves the emergence there",
                "measured": f"moved {f['moved']:.0%}, stayed {f['stayed']:.0%}, vanished "
                f"{f['vanished']:.0%}, elsewhere {f['elsewhere']:.0%} (layer {result.layer}, "
                f"{len(result.partners)} partners)",
                "holds": f["moved"] >= 0.5,
            }
        )
    return out


def summary(result: Result) -> str:
    b = result.baseline
    lines = [
        f"model: {result.model}   ME layer {result.layer} (1-based {result.layer + 1})   baseline ratio "
        f"{b.ratio_at(result.layer):.4g}   prompts {result.n_prompts}",
        "",
        fmt_table(
            ["part", "moved", "stayed", "vanished", "elsewhere"],
            [(p, *(f"{v:.0%}" for v in result.fractions(p).values())) for p in result.parts],
        ),
    ]
    head = result.headline()
    lines.append("")
    lines.append(
        f"verdict: holds={head['holds']} ({head.get('part')}: moved {head.get('moved_fraction')})"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "Config",
    "Measurement",
    "Result",
    "Setup",
    "WeightConfig",
    "figures",
    "main",
    "measure",
    "outcome",
    "prepare",
    "run",
    "short_batch",
    "summary",
    "verdicts",
]
