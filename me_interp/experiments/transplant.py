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

A third condition, ``full``, moves every dim of ``h_p − h̄`` (the whole state's deviation, so ``p``
is left an ordinary token): the reference for ``move``. A move is judged only where it leaves ``p``
ordinary (:mod:`me_interp.probes.removal`); at the last layer the forwards are skipped.

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
from me_interp.interventions.causal import PromptsUsed
from me_interp.interventions.conditions import Conditions
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.attention import attention_src_dst
from me_interp.probes.batching import record
from me_interp.probes.removal import not_ordinary
from me_interp.probes.site import Site
from me_interp.probes.to_position import heads_mean, sink_claims_why, sink_heads
from me_interp.study.cli import command
from me_interp.study.config import SiteConfig, checked
from me_interp.study.experiment import Experiment, prepare, prompt_inputs
from me_interp.study.result import Headed, RunHeader, run_header
from me_interp.terminal import fmt_table

NAME = "transplant"
CONDITIONS = ("baseline", "add", "move", "full")
_MOVES = {"move": "moving the component", "full": "moving the whole state"}


@dataclass(frozen=True)
class Condition:
    """One condition's measurements (``baseline``: the unmodified run; ``full``: the full-state move).

    Attributes:
        to_old, to_new: per prompt, the sink heads' mean attention to ``p`` and to ``dst``.
        layer_old, layer_new: per later layer, the same over every head (mean over prompts).
        ratio_old, ratio_new: per prompt, the norm ratios of ``p`` and ``dst`` at the ME layer
            (each over the tokens other than ``p`` and ``dst``).
    """

    name: str
    to_old: list[float]
    to_new: list[float]
    layer_old: list[float]
    layer_new: list[float]
    ratio_old: list[float]
    ratio_new: list[float]


@dataclass(frozen=True)
class Result(Headed, Conditions):
    """The transplants and what they did (``header``: the ME layer, position ``p`` and dims).

    Attributes:
        why_not: why the claims about a massive activation at the layer do not apply (``None``).
        later_layers: the layers after the ME layer; ``sink_heads``: ``(layer, head)`` among them
            whose unmodified attention to ``p`` reaches the ``sink_attention`` threshold.
        component_norm: per prompt, ``‖c_b‖`` of the component moved by ``add`` / ``move``.
    """

    header: RunHeader
    prompts: PromptsUsed
    why_not: str | None
    dst: int
    mode: str
    component: str
    later_layers: list[int]
    sink_heads: list[tuple[int, int]]
    conditions: list[Condition]
    component_norm: list[float]

    def sink_to(self, name: str) -> tuple[float, float]:
        """Mean attention of the sink heads to (old position p, new position dst)."""
        c = self.of(name)
        return float(np.mean(c.to_old)), float(np.mean(c.to_new))


def _why(name: str | None):
    def why(r: Result) -> str | None:
        h = r.header
        n = h.layer + 1 + len(r.later_layers)
        why = sink_claims_why(r.why_not, h.layer, n, h.position, r.sink_heads)
        if why is not None:
            return why
        if name in _MOVES:
            return not_ordinary({"the ME layer": r.of(name).ratio_old}, _MOVES[name])
        return None

    return why


def _details(name: str):
    def details(r: Result) -> str:
        h, c = r.header, r.of(name)
        b_old, b_new = r.sink_to("baseline")
        old, new = r.sink_to(name)
        what = "whole-state" if name == "full" else f"{r.component} ({r.mode})"
        return (
            f"{what} component of position {h.position} -> position {r.dst} at ME layer {h.layer} "
            f"(1-based {h.layer + 1}); {len(r.sink_heads)} sink heads; n = {len(r.prompts.indices)} "
            f"prompts ({r.prompts.n_short} skipped as too short); sink heads -> old / new "
            f"position: baseline {b_old:.3g} / {b_new:.3g}, {name} {old:.3g} / {new:.3g}; "
            f"ME-layer norm ratio old / new under {name} {np.mean(c.ratio_old):.3g} / "
            f"{np.mean(c.ratio_new):.3g}"
        )

    return details


@claims.of_means
def _share_stat(m: np.ndarray) -> np.ndarray | float:
    """Columns ``[to dst after, to dst before, to p before]`` (means ``m``) → the share of the sink
    that moved, ``(mean(after) − mean(dst before)) / mean(p before)`` (the unmodified attention to
    dst is the control, subtracted)."""
    return claims.divide(m[..., 0] - m[..., 1], m[..., 2])


def _follows(name: str):
    def stat(r: Result) -> claims.Sample:
        base = r.of("baseline")
        rows = np.stack([r.of(name).to_new, base.to_new, base.to_old], 1).astype(np.float64)
        return claims.Sample(rows, _share_stat)

    return stat


_SHARE = (
    "the sink heads' attention to dst under '{}' minus their unmodified attention to dst, over "
    "their unmodified attention to p (prompt means; 1 = the whole sink moved, 0 = none)"
)
SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "transplant.sink_follows",
        "§2.6, §3 (massive-direction transplant)",
        "The attention sink follows the massive component: moving it from the massive token into "
        "another token (which leaves the massive token ordinary) moves the sink heads' attention "
        "there",
        _SHARE.format("move"),
        ">=",
        "restore",
        control="the unmodified run (the sink heads' attention to dst before the move); "
        "state_follows (the whole state moved)",
        stat=_follows("move"),
        applies=_why("move"),
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
        stat=lambda r: claims.Sample(np.asarray(r.of("add").to_new, dtype=np.float64)),
        applies=_why(None),
        details=_details("add"),
    ),
    claims.Spec(
        "transplant.state_follows",
        "§2.6 (the sink follows the whole state)",
        "The attention sink follows the massive token's whole state: moving every dim of its "
        "deviation from the other tokens' mean into another token moves the sink heads' attention "
        "there (nearly true by construction for a sink read from the token's state: a sanity "
        "check, the reference for sink_follows)",
        _SHARE.format("full"),
        ">=",
        "restore",
        kind="sanity",
        control="sink_follows (only the massive dims moved)",
        stat=_follows("full"),
        applies=_why("full"),
        details=_details("full"),
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


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Baseline, add and move. No printing, no files.

    Raises:
        claims.NotApplicable: no massive activation on this model and no ``layer`` given.
        ValueError: ``dst`` is the massive position, or ``max_tokens`` leaves no query after it.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    pb = site.inputs
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
    full = causal.transplant(model, batch, L, p, dst, None, "difference", True, acts=acts)
    hooks["full"] = full.hooks  # the whole state's deviation moved
    conds, heads = [], []
    for cond, h in hooks.items():
        if not later:  # no later layer: nothing to read (the claims say so)
            break
        att, ratios = attention_src_dst(
            model, batch, p, dst, later, h, L, apart=True
        )  # [layer 2 batch head]
        if cond == "baseline":
            heads = sink_heads(att[:, 0].mean(1))  # [layer head]: to p, mean over prompts
        sink = [heads_mean(att[:, w], heads) for w in (0, 1)]
        layer = att.mean((2, 3))  # [layer 2]
        conds.append(
            Condition(
                cond,
                *sink,
                layer[:, 0].tolist(),
                layer[:, 1].tolist(),
                ratios[0].tolist(),
                ratios[1].tolist(),
            )
        )
    header = run_header(cfg, model, len(batch), site)
    return Result(
        header,
        pb.used(),
        site.why_not,
        dst,
        cfg.mode,
        cfg.component,
        later,
        [(later[i], k) for i, k in heads],
        conds,
        norm.tolist(),
    )


def figures(result: Result) -> dict[str, Any]:
    if not result.later_layers:
        return {}  # no later layer: nothing to plot
    p, series = result.header.position, {}
    for c in result.conditions:
        series[f"{c.name}: to old position {p}"] = c.layer_old
        series[f"{c.name}: to new position {result.dst}"] = c.layer_new
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
    rows = [
        (c.name, *result.sink_to(c.name), float(np.mean(c.ratio_old)), float(np.mean(c.ratio_new)))
        for c in result.conditions
    ]
    h = result.header
    return "\n".join(
        [
            f"model: {h.model}   ME layer {h.layer} (1-based {h.layer_1based}); {result.component} "
            f"component of position {h.position} -> position {result.dst} ({result.mode}); "
            f"{len(result.sink_heads)} sink heads; {len(result.prompts.indices)} prompts "
            f"({result.prompts.n_short} skipped as too short)",
            fmt_table(["condition", "sink->old", "sink->new", "ratio old", "ratio new"], rows),
        ]
    )


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("attention_old_new",),
    inputs=prompt_inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
