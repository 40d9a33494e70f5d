"""Massive-direction transplant: write token p's massive component into another token — does the sink move?

At the output of the ME layer (measured), the massive component of the massive token ``p`` is
``c_b = P_D(h_p − h̄)`` (``D`` = massive dims, ``h̄`` = mean of the other tokens; ``--component full``
keeps every dim). Two interventions against the unmodified run (``interventions.causal.transplant``):

* ``add``  — ``h_dst ← h_dst + c`` (a second massive token);
* ``move`` — additionally ``h_p ← h_p − c`` (the component moved from ``p`` to ``dst``).

``--mode difference`` adds each prompt's own ``c_b``; ``--mode direction`` adds the prompt-mean unit
direction at matched norm ``‖c_b‖``. Measured per later layer and head: the attention of the queries
``q > dst`` (they can see both tokens) to the old position ``p`` and to the new position ``dst``.
*Sink heads* are the heads after the ME layer whose unmodified attention to ``p`` is at least
``--sink-threshold``. The sink *moves* with the component when, under ``move``, the sink heads attend
more to ``dst`` than to ``p``.

    python -m me_interp.experiments.transplant
    python -m me_interp.experiments.transplant --dst 5 --mode direction --component full
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from me_interp import names, plotting
from me_interp.experiments.common import SiteConfig, cli_main, fmt_table, model_for
from me_interp.interventions import causal
from me_interp.models import Batch, LoadedModel
from me_interp.patching import NormRatio, evaluate_metrics

NAME = "transplant"
CLAIM = (
    "The attention sink follows the massive component: moving token p's massive component into "
    "another token moves the sink there"
)


@dataclass(frozen=True)
class Config(SiteConfig):
    """Transplant settings.

    Attributes:
        dst: the position that receives the component; ``None`` = the middle of the shortest prompt.
            Must differ from ``p`` and leave a query after it.
        mode: ``difference`` (each prompt's own component ``c_b``) or ``direction`` (the prompt-mean
            unit direction at each prompt's norm ``‖c_b‖``).
        component: ``massive_dims`` (only the massive dims of ``h_p − h̄``) or ``full`` (every dim).
        sink_threshold: a head after the ME layer is a sink head when its unmodified attention to
            ``p`` is at least this, in (0, 1).
    """

    dst: int | None = None
    mode: Literal["difference", "direction"] = "difference"
    component: Literal["massive_dims", "full"] = "massive_dims"
    sink_threshold: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dst is not None and self.dst < 0:
            raise ValueError(f"dst must be >= 0, got {self.dst}")
        if self.mode not in ("difference", "direction"):
            raise ValueError(f"mode must be 'difference' or 'direction', got {self.mode!r}")
        if self.component not in ("massive_dims", "full"):
            raise ValueError(f"component must be 'massive_dims' or 'full', got {self.component!r}")
        if not 0 < self.sink_threshold < 1:
            raise ValueError("sink_threshold must be in (0, 1)")


def _attn_to(pattern, hook, *, store, layer, src, dst, qmask):
    a = pattern.detach().float()  # [batch head q k]
    qm = qmask.to(a.device, a.dtype)[:, None, :]  # [batch 1 q]
    n = qm.sum(-1)
    store[layer] = torch.stack(
        [((a[..., src] * qm).sum(-1) / n).mean(0), ((a[..., dst] * qm).sum(-1) / n).mean(0)]
    ).cpu()  # [2 head]: to src, to dst
    return pattern


def attention_src_dst(
    model: LoadedModel, batch: Batch, src: int, dst: int, layers: Sequence[int], fwd_hooks=()
) -> torch.Tensor:
    """``[layer, 2, head]``: mean over prompts and queries ``q > max(src, dst)`` of ``A[q, src]``,
    ``A[q, dst]``."""
    q = batch.attention_mask.bool().clone()
    q[:, : max(src, dst) + 1] = False
    if not q.any(-1).all():
        raise ValueError(f"every prompt needs a token after position {max(src, dst)}")
    store: dict[int, torch.Tensor] = {}
    hooks = [
        (names.pattern(lay), partial(_attn_to, store=store, layer=lay, src=src, dst=dst, qmask=q))
        for lay in layers
    ]
    model.run_with_hooks(batch, [*fwd_hooks, *hooks])
    return torch.stack([store[lay] for lay in layers])


@dataclass
class Result:
    model: str
    bos: str
    site: causal.MassiveSite
    dst: int
    mode: str
    component: str
    sink_threshold: float
    later_layers: list[int]
    attention: dict[str, list[list[list[float]]]]  # condition -> [layer][src/dst][head]
    component_norm: float
    ratios: dict[str, dict[str, float]]

    def sink_heads(self) -> list[tuple[int, int]]:
        base = self.attention["baseline"]
        return [
            (i, h)
            for i in range(len(self.later_layers))
            for h, a in enumerate(base[i][0])
            if a >= self.sink_threshold
        ]

    def sink_to(self, cond: str) -> tuple[float, float]:
        """Mean attention of the sink heads to (old position p, new position dst)."""
        heads = self.sink_heads()
        if not heads:
            return float("nan"), float("nan")
        a = self.attention[cond]
        return (
            sum(a[i][0][h] for i, h in heads) / len(heads),
            sum(a[i][1][h] for i, h in heads) / len(heads),
        )

    def per_layer(self, cond: str, which: int) -> list[float]:
        """Mean over heads, per later layer (which: 0 = to p, 1 = to dst)."""
        return [sum(x[which]) / len(x[which]) for x in self.attention[cond]]

    def holds(self) -> bool | None:
        if not self.sink_heads():
            return None
        old, new = self.sink_to("move")
        return bool(new > old)

    def to_dict(self) -> dict[str, Any]:
        b_old, b_new = self.sink_to("baseline")
        m_old, m_new = self.sink_to("move")
        a_old, a_new = self.sink_to("add")
        return {
            "claim": CLAIM,
            "baseline": {"sink_heads_to_old": b_old, "sink_heads_to_new": b_new},
            "intervened": {
                "condition": "move",
                "sink_heads_to_old": m_old,
                "sink_heads_to_new": m_new,
            },
            "verdict": {
                "holds": self.holds(),
                "new_minus_old": m_new - m_old,
                "rule": "under 'move' the sink heads attend more to the new position than the old",
            },
            "model": self.model,
            "bos": self.bos,
            "massive_site": self.site.to_dict(),
            "dst": self.dst,
            "mode": self.mode,
            "component": self.component,
            "component_norm": self.component_norm,
            "sink_threshold": self.sink_threshold,
            "sink_heads": [[self.later_layers[i], h] for i, h in self.sink_heads()],
            "add": {"sink_heads_to_old": a_old, "sink_heads_to_new": a_new},
            "norm_ratios": self.ratios,
            "later_layers": self.later_layers,
            "per_layer": {
                c: {"to_old": self.per_layer(c, 0), "to_new": self.per_layer(c, 1)}
                for c in self.attention
            },
            "per_head": self.attention,
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Baseline, add and move. No printing, no files."""
    model = model_for(cfg, model)
    batch = model.tokenize(cfg.load_prompts())
    site = causal.locate_massive(model, batch, cfg.layer, cfg.position)
    p = site.position
    shortest = min(batch.lengths)
    dst = shortest // 2 if cfg.dst is None else cfg.dst
    if dst == p:
        raise ValueError(f"dst ({dst}) must differ from the massive position ({p})")
    if not max(p, dst) < shortest - 1:
        raise ValueError(
            f"dst {dst} leaves no query after it in the shortest prompt ({shortest} tokens)"
        )
    later = list(range(site.layer + 1, model.n_layers))
    if not later:
        raise ValueError(f"the ME layer {site.layer} is the last layer: no later layer to measure")
    dims = site.dims if cfg.component == "massive_dims" else None
    hooks = {"baseline": []}
    comp_norm = float("nan")
    for cond, remove in (("add", False), ("move", True)):
        t = causal.transplant(model, batch, site.layer, p, dst, dims, cfg.mode, remove)
        hooks[cond] = t.hooks
        comp_norm = float(t.norm.mean())
    attention, ratios = {}, {}
    metrics = {"old": NormRatio(site.layer, p), "new": NormRatio(site.layer, dst)}
    for cond, h in hooks.items():
        attention[cond] = attention_src_dst(model, batch, p, dst, later, h).tolist()
        ratios[cond] = {
            k: float(v.mean()) for k, v in evaluate_metrics(model, batch, metrics, h).items()
        }
    return Result(
        model=model.name,
        bos=model.bos,
        site=site,
        dst=dst,
        mode=cfg.mode,
        component=cfg.component,
        sink_threshold=cfg.sink_threshold,
        later_layers=later,
        attention=attention,
        component_norm=comp_norm,
        ratios=ratios,
    )


def verdicts(result: Result) -> list[dict]:
    b_old, b_new = result.sink_to("baseline")
    m_old, m_new = result.sink_to("move")
    a_old, a_new = result.sink_to("add")
    n = len(result.sink_heads())
    return [
        {
            "claim": CLAIM,
            "measured": f"{n} sink heads; attention old/new position: baseline {b_old:.3f}/{b_new:.3f}, "
            f"move {m_old:.3f}/{m_new:.3f}",
            "holds": result.holds(),
        },
        {
            "claim": "Adding the massive component to another token makes it a second sink",
            "measured": f"sink heads' attention to the new position {b_new:.3f} -> {a_new:.3f} "
            f"(old position {b_old:.3f} -> {a_old:.3f})",
            "holds": None if not n else bool(a_new >= 2 * b_new and a_new >= result.sink_threshold),
        },
    ]


def figures(result: Result) -> dict[str, Any]:
    series = {}
    for c in result.attention:
        series[f"{c}: to old position {result.site.position}"] = result.per_layer(c, 0)
        series[f"{c}: to new position {result.dst}"] = result.per_layer(c, 1)
    fig = plotting.layer_lines(
        series,
        f"Attention to the old and new position after the transplant — {result.model}",
        "attention mass (mean over heads)",
    )
    fig.update_xaxes(
        tickvals=list(range(len(result.later_layers))),
        ticktext=[str(x) for x in result.later_layers],
    )
    return {"attention_old_new": fig}


def summary(result: Result) -> str:
    rows = []
    for c in result.attention:
        old, new = result.sink_to(c)
        rows.append((c, old, new, result.ratios[c]["old"], result.ratios[c]["new"]))
    s = result.site
    return "\n".join(
        [
            f"model: {result.model}   ME layer {s.layer} (1-based {s.layer + 1}); {result.component} "
            f"component of position {s.position} -> position {result.dst} ({result.mode}); sink "
            f"moves: {result.holds()}",
            fmt_table(["condition", "sink->old", "sink->new", "ratio old", "ratio new"], rows),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
