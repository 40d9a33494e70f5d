"""Massive-direction transplant: write token p's massive component into another token — does the sink move?

At the output of the ME layer (measured), the massive component of the massive token ``p`` is
``c_b = P_D(h_p − h̄)`` (``D`` = massive dims, ``h̄`` = mean of the other tokens; ``--component full``
keeps every dim). Two interventions against the unmodified run (``interventions.causal.transplant``):

* ``add``  — ``h_dst ← h_dst + c`` (a second massive token);
* ``move`` — additionally ``h_p ← h_p − c`` (the component moved from ``p`` to ``dst``).

``--mode difference`` adds each prompt's own ``c_b``; ``--mode direction`` adds the prompt-mean unit
direction at matched norm ``‖c_b‖``. Measured per prompt, later layer and head (one forward per
condition): the attention of the queries ``q > max(p, dst)`` (they can see both tokens) to the old
position ``p`` and to the new position ``dst``. *Sink heads* are the heads after the ME layer whose
unmodified attention to ``p`` reaches the ``sink_attention`` threshold of
:data:`me_interp.claims.THRESHOLDS`. Prompts too short for ``dst`` (no query after it) are skipped and
counted (``prompts.n_skipped_short``), never an error.

Claims (:data:`SPECS`, both of kind claim), bootstrapped over prompts: under ``move`` the sink
*follows* the component (the sink heads' attention to ``dst`` reaches the ``restore`` fraction of
their unmodified attention to ``p``); under ``add`` ``dst`` becomes a *second sink* (the sink heads'
mean attention to it reaches ``sink_attention``). Both are not applicable without a massive
activation, without a sink head, or when the ME layer is the last layer (no later layer whose
attention could follow: the run then skips the forwards instead of failing).

    python -m me_interp.experiments.transplant
    python -m me_interp.experiments.transplant --dst 5 --mode direction --component full
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from me_interp import claims, names, plotting
from me_interp.interventions import causal
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.attention import attention_src_dst
from me_interp.probes.batching import record
from me_interp.probes.site import Site, locate
from me_interp.study import Experiment, SiteConfig, checked, command, model_for
from me_interp.terminal import fmt_table

NAME = "transplant"
CONDITIONS = ("baseline", "add", "move")


def _why(r: Result) -> str | None:
    """Why the transplant claims do not apply (``None`` when they do)."""
    s = r.site
    if not s.massive:
        return s.why_not
    if not r.later_layers:
        return (
            f"the ME layer {s.layer} is the last layer: there is no later layer whose attention "
            "could follow the component"
        )
    return s.sink_why_not(r.sink_heads)


def _details(cond: str):
    def details(r: Result) -> str:
        s = r.site
        b_old, b_new = r.sink_to("baseline")
        old, new = r.sink_to(cond)
        ro, rn = (float(x.mean()) for x in r.ratios[cond])
        return (
            f"{r.component} component of position {s.position} -> position {r.dst} ({r.mode}) at "
            f"ME layer {s.layer} (1-based {s.layer + 1}); {len(r.sink_heads())} sink heads; n = "
            f"{len(r.prompts.indices)} prompts ({r.prompts.n_short} skipped as too short); sink "
            f"heads -> old / new position: baseline {b_old:.3g} / {b_new:.3g}, {cond} {old:.3g} / "
            f"{new:.3g}; ME-layer norm ratio old / new under {cond} {ro:.3g} / {rn:.3g}"
        )

    return details


def _follows(r: Result) -> claims.Sample:
    rows = np.stack(
        [
            r.sink_per_prompt("move", 1).double().numpy(),
            r.sink_per_prompt("baseline", 1).double().numpy(),
            r.sink_per_prompt("baseline", 0).double().numpy(),
        ],
        1,
    )
    return claims.Sample(rows, _share_stat)


SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "transplant.sink_follows",
        "§2.6, §3 (massive-direction transplant)",
        "The attention sink follows the massive component: moving it from the massive token into "
        "another token moves the sink heads' attention there",
        "the sink heads' attention to dst under 'move' minus their unmodified attention to dst, "
        "over their unmodified attention to p (prompt means; 1 = the whole sink moved, 0 = none)",
        ">=",
        "restore",
        control="the unmodified run (the sink heads' attention to dst before the move)",
        stat=_follows,
        applies=_why,
        details=_details("move"),
    ),
    claims.Spec(
        "transplant.second_sink",
        "§2.6, §3 (massive-direction transplant)",
        "Adding the massive component to another token makes it a second attention sink",
        "the sink heads' mean attention to dst under 'add' (mean over prompts)",
        ">=",
        "sink_attention",
        control="the unmodified run (the sink heads' attention to dst before the edit)",
        stat=lambda r: claims.Sample(r.sink_per_prompt("add", 1).double().numpy()),
        applies=_why,
        details=_details("add"),
    ),
)
SPEC = claims.index(SPECS)


@dataclass(frozen=True)
class Config(SiteConfig):
    """Transplant settings.

    Attributes:
        dst: the position that receives the component (0-based; must differ from ``p``). Prompts
            without a query after ``max(p, dst)`` are skipped and counted.
        mode: ``difference`` (each prompt's own component ``c_b``) or ``direction`` (the prompt-mean
            unit direction at each prompt's norm ``‖c_b‖``).
        component: ``massive_dims`` (only the massive dims of ``h_p − h̄``) or ``full`` (every dim).
        max_tokens: prompts are cut to their first ``max_tokens`` tokens (>= 2).
        max_prompts: how many prompts to use, spread evenly over the prompt list (``None``: all).
            Three forwards in all; the default keeps the bundled model's run around 20 s on two CPU
            cores.
    """

    dst: int = checked(8, ge=0)
    mode: Literal["difference", "direction"] = "difference"
    component: Literal["massive_dims", "full"] = "massive_dims"
    max_tokens: int = checked(32, ge=2)
    max_prompts: int | None = checked(40, ge=1)


@dataclass
class Result:
    model: str
    bos: str
    site: Site
    prompts: causal.PromptBatch
    dst: int
    mode: str
    component: str
    later_layers: list[int]
    attention: dict[str, torch.Tensor]  # condition -> [layer, old/new, batch, head]
    ratios: dict[str, torch.Tensor]  # condition -> [old/new, batch] ME-layer norm ratios
    component_norm: list[float]
    seed: int = 0

    def sink_heads(self) -> list[tuple[int, int]]:
        """(index into later_layers, head) whose unmodified attention to ``p`` (mean over prompts)
        reaches the ``sink_attention`` threshold."""
        base = self.attention["baseline"][:, 0].mean(1)  # [layer head]
        t = claims.threshold("sink_attention")
        return [
            (i, h)
            for i in range(base.shape[0])
            for h in range(base.shape[1])
            if float(base[i, h]) >= t
        ]

    def sink_per_prompt(self, cond: str, which: int) -> torch.Tensor:
        """``[batch]`` mean attention of the sink heads to p (``which=0``) or dst (``1``)."""
        heads = self.sink_heads()
        a = self.attention[cond]
        if not heads:
            return torch.full((a.shape[2],), float("nan"))
        return torch.stack([a[i, which, :, h] for i, h in heads]).mean(0)

    def sink_to(self, cond: str) -> tuple[float, float]:
        """Mean attention of the sink heads to (old position p, new position dst)."""
        return (
            float(self.sink_per_prompt(cond, 0).mean()),
            float(self.sink_per_prompt(cond, 1).mean()),
        )

    def per_layer(self, cond: str, which: int) -> list[float]:
        """Mean over prompts and heads, per later layer (which: 0 = to p, 1 = to dst)."""
        return self.attention[cond][:, which].mean((1, 2)).tolist()

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "bos": self.bos,
            "massive_site": self.site.to_dict(),
            "prompts": self.prompts.to_dict(),
            "dst": self.dst,
            "mode": self.mode,
            "component": self.component,
            "component_norm": float(np.mean(self.component_norm)),
            "sink_attention_threshold": claims.threshold("sink_attention"),
            "sink_heads": [[self.later_layers[i], h] for i, h in self.sink_heads()],
            "conditions": {
                c: {
                    "sink_heads_to_old": self.sink_to(c)[0],
                    "sink_heads_to_new": self.sink_to(c)[1],
                    "me_ratio_old": float(self.ratios[c][0].mean()),
                    "me_ratio_new": float(self.ratios[c][1].mean()),
                }
                for c in self.attention
            },
            "per_prompt": {
                "component_norm": self.component_norm,
                **{
                    c: {
                        "sink_heads_to_old": self.sink_per_prompt(c, 0).tolist(),
                        "sink_heads_to_new": self.sink_per_prompt(c, 1).tolist(),
                        "me_ratio_old": self.ratios[c][0].tolist(),
                        "me_ratio_new": self.ratios[c][1].tolist(),
                    }
                    for c in self.attention
                },
            },
            "later_layers": self.later_layers,
            "per_layer": {
                c: {"to_old": self.per_layer(c, 0), "to_new": self.per_layer(c, 1)}
                for c in self.attention
            },
            "per_head": {c: a.mean(2).tolist() for c, a in self.attention.items()},
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Baseline, add and move. No printing, no files.

    Raises:
        claims.NotApplicable: no massive activation on this model and no ``layer`` given.
        ValueError: ``dst`` is the massive position, or ``max_tokens`` leaves no query after it.
    """
    model = model_for(cfg, model)
    pb = causal.prompt_batch(model, cfg.load_prompts(), cfg.max_tokens, cfg.max_prompts)
    site = locate(model, pb.batch, layer=cfg.layer, position=cfg.position, seed=cfg.seed)
    site.require("pass --layer to intervene anyway")
    p, L, dst = site.position, site.layer, cfg.dst
    if dst == p:
        raise ValueError(f"dst ({dst}) must differ from the massive position ({p})")
    if max(p, dst) + 2 > cfg.max_tokens:
        raise ValueError(
            f"dst {dst} leaves no query after it within max_tokens = {cfg.max_tokens} tokens"
        )
    later = list(range(L + 1, model.n_layers))  # empty at the last layer: the claims say so
    pb = pb.at_least(max(p, dst) + 2)  # too short for dst: skipped and counted
    batch = pb.batch
    dims = site.dims if cfg.component == "massive_dims" else None
    acts = Activations(model, batch, [names.resid_post(L)])
    record(model, batch, [acts], last_layer=L, max_tokens=None)
    hooks: dict[str, list] = {"baseline": []}
    norm = torch.zeros(len(batch))
    for cond, remove in (("add", False), ("move", True)):
        t = causal.transplant(model, batch, L, p, dst, dims, cfg.mode, remove, acts=acts)
        hooks[cond], norm = t.hooks, t.norm
    attention, ratios = {}, {}
    for cond, h in hooks.items():
        attention[cond], ratios[cond] = attention_src_dst(model, batch, p, dst, later, h, L)
    return Result(
        model=model.name,
        bos=model.bos,
        site=site,
        prompts=pb,
        dst=dst,
        mode=cfg.mode,
        component=cfg.component,
        later_layers=later,
        attention=attention,
        ratios=ratios,
        component_norm=norm.tolist(),
        seed=cfg.seed,
    )


@claims.of_means
def _share_stat(m: np.ndarray) -> np.ndarray | float:
    """Columns ``[to dst after, to dst before, to p before]`` (means ``m``) → the share of the sink
    that moved, ``(mean(after) − mean(dst before)) / mean(p before)`` (the unmodified attention to
    dst is the control, subtracted)."""
    return claims.divide(m[..., 0] - m[..., 1], m[..., 2])


def figures(result: Result) -> dict[str, Any]:
    if not result.later_layers:
        return {}  # no later layer: nothing to plot
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
        rows.append(
            (c, old, new, float(result.ratios[c][0].mean()), float(result.ratios[c][1].mean()))
        )
    s = result.site
    return "\n".join(
        [
            f"model: {result.model}   ME layer {s.layer} (1-based {s.layer + 1}); {result.component} "
            f"component of position {s.position} -> position {result.dst} ({result.mode}); "
            f"{len(result.sink_heads())} sink heads; {len(result.prompts.indices)} prompts "
            f"({result.prompts.n_short} skipped as too short)",
            fmt_table(["condition", "sink->old", "sink->new", "ratio old", "ratio new"], rows),
        ]
    )


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("attention_old_new",)
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
