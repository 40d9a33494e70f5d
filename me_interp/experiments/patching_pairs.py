"""Activation patching on your own clean/corrupt pairs: the ``--pairs`` mode of activation_patching.

    python -m me_interp.experiments.activation_patching --pairs ioi.jsonl --metric logit_diff
    python -m me_interp.experiments.activation_patching --pairs ioi.jsonl \
        --sites resid_pre attn_head_out --head-positions each

Every site of ``--sites`` is swept over every layer and position (per-head sites: every layer and
head, over all positions at once or, with ``--head-positions each``, by position), batched
(:func:`me_interp.patching.patch_sweep`), and scored by ``--metric``:

* ``logit_diff`` — ``logit(answer) − logit(wrong)`` at each pair's last real token;
* ``prob`` — the answer's probability there;
* ``kl`` — ``KL(clean ‖ patched)`` of the next-token distributions there;
* ``projection`` / ``sink`` / ``norm_ratio`` — the massive-activation metrics of the built-in
  question, at the massive token located on the clean texts.

``--method attribution`` estimates every cell from one forward and one backward pass instead
(:mod:`me_interp.patching.attribution`); ``--method both`` runs both and reports their rank
correlation over the cells of each site.

A cell's value is normalised the TransformerLens way, ``(m_patched − m_corrupt) / (m_clean −
m_corrupt)`` on pair means (clean = 1, corrupt = 0), with a percentile bootstrap over pairs. The
result holds every cell with its interval and the per-pair values; the summary lists the top cells;
one heat map per site. This mode answers your question, not the paper's: it has no claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, names
from me_interp.loading.loaded import LoadedModel
from me_interp.patching import (
    HEAD_SITES,
    NormRatio,
    PatchMetric,
    Projection,
    SinkMass,
    SweepResult,
    attribution_sweep,
    patch_sweep,
    rank_agreement,
)
from me_interp.patching.pairs import (
    LOGIT_METRICS,
    PairBatch,
    logit_metric,
    read_pairs,
    tokenize_pairs,
)
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record
from me_interp.probes.site import locate
from me_interp.study import model_for
from me_interp.terminal import fmt_table

MASSIVE_METRICS = ("projection", "sink", "norm_ratio")
METRICS = (*LOGIT_METRICS, *MASSIVE_METRICS)
TOP = 5
"""How many top cells of each site the summary lists."""


def cell_label(sw: SweepResult, at: tuple[int, ...], tokens: list[str]) -> str:
    """``L3 p5 'John' h7``-style name of grid index ``at`` of sweep ``sw``."""
    parts = [f"L{sw.layers[at[0]]}"]
    k = 1
    if sw.positions is not None:
        p = sw.positions[at[k]]
        parts.append(f"p{p} {tokens[p]!r}" if p < len(tokens) else f"p{p}")
        k += 1
    if sw.heads is not None:
        parts.append(f"h{sw.heads[at[k]]}")
    return " ".join(parts)


def bootstrap_cells(sw: SweepResult, metric: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap over pairs of every cell's normalised value: ``(lo, hi)`` grids.

    Each resample draws the pairs with replacement and recomputes ``(mean patched − mean corrupt) /
    (mean clean − mean corrupt)`` on the same draw for every cell."""
    vals = sw.values[metric].double().cpu().numpy()
    shape, B = vals.shape[:-1], vals.shape[-1]
    flat = vals.reshape(-1, B)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, B, size=(claims.N_BOOTSTRAP, B))
    w = np.zeros((claims.N_BOOTSTRAP, B))
    np.add.at(w, (np.arange(claims.N_BOOTSTRAP)[:, None], idx), 1.0 / B)  # resample weights
    clean = w @ sw.clean[metric].double().cpu().numpy()
    corrupt = w @ sw.corrupt[metric].double().cpu().numpy()
    denom = clean - corrupt
    with np.errstate(divide="ignore", invalid="ignore"):
        boot = (flat @ w.T - corrupt) / np.where(denom == 0, np.nan, denom)  # [cells N]
    alpha = (1 - claims.LEVEL) / 2
    lo, hi = (
        np.nanquantile(boot, [alpha, 1 - alpha], axis=1)
        if np.isfinite(boot).any()
        else (
            np.full(len(flat), np.nan),
            np.full(len(flat), np.nan),
        )
    )
    return lo.reshape(shape), hi.reshape(shape)


@dataclass
class PairsResult:
    """The sweeps of a pairs run, each cell's bootstrap interval, and the top cells."""

    model: str
    bos: str
    metric: str
    pairs: PairBatch
    sweeps: dict[str, SweepResult]
    lo: dict[str, np.ndarray]
    hi: dict[str, np.ndarray]
    tokens: list[str]
    metric_note: str = ""
    seed: int = 0
    method: str = "exact"
    attribution: dict[str, SweepResult] | None = None
    agreement: dict[str, float] | None = None
    """With ``method="both"``: the attribution sweeps and their Spearman correlation with the exact
    ones over each site's cells."""

    def top_cells(self, k: int = TOP) -> list[dict[str, Any]]:
        """Each site's ``k`` cells with the largest ``|normalised|``, site by site."""
        out = []
        for site, sw in self.sweeps.items():
            rows = []
            grid = sw.normalized(self.metric).double().numpy()
            for flat in range(grid.size):
                at = tuple(int(i) for i in np.unravel_index(flat, grid.shape))
                v = float(grid[at])
                if np.isfinite(v):
                    rows.append(
                        {
                            "site": site,
                            "cell": cell_label(sw, at, self.tokens),
                            "normalised": v,
                            "lo": float(self.lo[site][at]),
                            "hi": float(self.hi[site][at]),
                        }
                    )
            out += sorted(rows, key=lambda r: -abs(r["normalised"]))[:k]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": "pairs",
            "method": self.method,
            "attribution_agreement": self.agreement,
            "attribution_sweeps": None
            if self.attribution is None
            else {s: sw.to_dict() for s, sw in self.attribution.items()},
            "model": self.model,
            "bos": self.bos,
            "metric": self.metric,
            "metric_note": self.metric_note,
            "n_pairs": len(self.pairs),
            "pairs": [
                {
                    "line": p.line,
                    "clean": p.clean,
                    "corrupt": p.corrupt,
                    "answer": p.answer,
                    "wrong": p.wrong,
                }
                for p in self.pairs.pairs
            ],
            "tokens_pair0": self.tokens,
            "normalisation": "(patched − corrupt) / (clean − corrupt) on pair means; clean = 1, corrupt = 0",
            "interval": f"{claims.LEVEL:.0%} percentile bootstrap over pairs ({claims.N_BOOTSTRAP} resamples)",
            "top_cells": self.top_cells(),
            "ci_low": {s: v.tolist() for s, v in self.lo.items()},
            "ci_high": {s: v.tolist() for s, v in self.hi.items()},
            "sweeps": {s: sw.to_dict() for s, sw in self.sweeps.items()},
        }


def _metric(name: str, cfg, model: LoadedModel, pb: PairBatch) -> tuple[PatchMetric, str]:
    if name in LOGIT_METRICS:
        clean_logits = _last_logits(model, pb) if name == "kl" else None
        return logit_metric(name, pb, clean_logits), f"{name} at each pair's last real token"
    site = locate(model, pb.clean, layer=cfg.layer, position=None, seed=cfg.seed)
    site.require("pass --layer to intervene anyway")
    p, L, last = site.position, site.layer, model.n_layers - 1
    note = f"massive token at position {p}, ME layer {L} (located on the clean texts)"
    if name == "norm_ratio":
        return NormRatio(last, p), note + f"; norm ratio at layer {last}"
    if name == "sink":
        if L >= last:
            raise claims.NotApplicable(
                f"the ME layer {L} is the last layer: no later layer has a sink"
            )
        return SinkMass(tuple(range(L + 1, model.n_layers)), p), note + "; sink of the later layers"
    acts = Activations(model, pb.clean, [names.resid_post(L)])
    record(model, pb.clean, [acts], last_layer=L, max_tokens=None)
    h = acts[names.resid_post(L)][:, p]
    return Projection(last, h.float().mean(0).cpu(), p), note + f"; projection at layer {last}"


def _last_logits(model: LoadedModel, pb: PairBatch) -> torch.Tensor:
    logits = model.run_with_hooks(pb.clean)
    return logits[torch.arange(len(pb)), pb.clean.attention_mask.sum(-1) - 1]


def run(cfg, model: LoadedModel | None = None) -> PairsResult:
    """Sweep every site of ``cfg.sites`` on the pairs of ``cfg.pairs``. No printing, no files."""
    model = model_for(cfg, model)
    pb = tokenize_pairs(model, read_pairs(cfg.pairs))
    name = cfg.metric or "logit_diff"
    metric, note = _metric(name, cfg, model, pb)
    runs = {"exact": patch_sweep, "attribution": attribution_sweep}
    wanted = ("exact", "attribution") if cfg.method == "both" else (cfg.method,)
    got: dict[str, dict[str, SweepResult]] = {m: {} for m in wanted}
    for s in cfg.sites:
        head = s in HEAD_SITES
        kw = {
            "heads": cfg.heads if head else None,
            "per_position": not head or cfg.head_positions == "each",
        }
        for m in wanted:
            extra = {"batch_size": cfg.batch_size} if m == "exact" else {}
            got[m][s] = runs[m](model, pb.clean, pb.corrupt, s, {name: metric}, **kw, **extra)
    sweeps = got[wanted[0]]
    attribution = got.get("attribution") if cfg.method == "both" else None
    agreement = None
    if attribution is not None:
        agreement = {s: rank_agreement(attribution[s], sweeps[s], name) for s in sweeps}
    lo, hi = {}, {}
    for s, sw in sweeps.items():
        lo[s], hi[s] = bootstrap_cells(sw, name, cfg.seed)
    tokens = [model.tokenizer.decode([int(t)]) for t in pb.clean.tokens[0, : pb.clean.lengths[0]]]
    return PairsResult(
        model.name,
        model.bos,
        name,
        pb,
        sweeps,
        lo,
        hi,
        tokens,
        note,
        cfg.seed,
        cfg.method,
        attribution,
        agreement,
    )


def heatmap(sw: SweepResult, metric: str, tokens: list[str], title: str) -> go.Figure:
    """The normalised values of one sweep: layer × position, layer × head, or (layer, head) ×
    position (``tokens`` label the positions)."""
    grid = sw.normalized(metric).double().numpy()
    pos_labels = None
    if sw.positions is not None:
        pos_labels = [f"{p}: {tokens[p]!r}" if p < len(tokens) else str(p) for p in sw.positions]
    if sw.heads is None:  # [layer pos]
        z, x, y = grid.T, sw.layers, pos_labels
        xt, yt = "layer (0-based)", "position"
    elif sw.positions is None:  # [layer head]
        z, x, y = grid.T, sw.layers, [f"head {h}" for h in sw.heads]
        xt, yt = "layer (0-based)", "head (all positions patched)"
    else:  # [layer pos head] -> rows (layer, head), columns positions
        z = grid.transpose(0, 2, 1).reshape(-1, grid.shape[1])
        y = [f"L{ly} h{h}" for ly in sw.layers for h in sw.heads]
        x, xt, yt = pos_labels, "position", "layer, head"
    fig = go.Figure(
        go.Heatmap(
            z=z.tolist(),
            x=x,
            y=y,
            zmid=0,
            colorscale="RdBu",
            reversescale=True,
            colorbar={"title": "normalised"},
            hovertemplate="%{x}<br>%{y}<br>normalised %{z:.3f}<extra>" + sw.site + "</extra>",
        )
    )
    fig.update_yaxes(title_text=yt, autorange="reversed")
    fig.update_xaxes(title_text=xt)
    fig.update_layout(
        title=title,
        template="plotly_white",
        height=max(380, min(1600, 18 * len(y or []) + 200)),
    )
    return fig


def figures(result: PairsResult) -> dict[str, go.Figure]:
    """One heat map per site."""
    return {
        f"pairs_{site}": heatmap(
            sw,
            result.metric,
            result.tokens,
            f"Patching {site} on {len(result.pairs)} pairs, metric {result.metric} (clean = 1, "
            f"corrupt = 0) — {result.model}<br><sup>positions labelled by pair 0's tokens</sup>",
        )
        for site, sw in result.sweeps.items()
    }


def summary(result: PairsResult) -> str:
    sw0 = next(iter(result.sweeps.values()))
    m = result.metric
    head = (
        f"model: {result.model}   {len(result.pairs)} pairs; metric {m} ({result.metric_note}); "
        f"clean {float(sw0.clean[m].mean()):.4g}, corrupt {float(sw0.corrupt[m].mean()):.4g}"
    )
    rows = [
        (r["site"], r["cell"], r["normalised"], f"[{r['lo']:.3g}, {r['hi']:.3g}]")
        for r in result.top_cells()
    ]
    if result.method == "attribution":
        head += "\nmethod: attribution patching (first-order estimate, one forward + one backward)"
    if result.agreement:
        rho = ", ".join(f"{s} {v:.3f}" for s, v in result.agreement.items())
        head += f"\nattribution vs exact, Spearman rank correlation over cells: {rho}"
    table = fmt_table(
        ["site", "cell", "normalised (1 = clean)", f"{claims.LEVEL:.0%} CI over pairs"], rows
    )
    return f"{head}\n{table}"
