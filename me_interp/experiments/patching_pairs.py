"""Activation patching on your own clean/corrupt pairs: the ``--pairs`` mode of activation_patching.

    python -m me_interp.experiments.activation_patching --pairs ioi.jsonl --metric logit_diff
    python -m me_interp.experiments.activation_patching --pairs ioi.jsonl \
        --sites resid_pre attn_head_out --head-positions each

From Python, pairs are a JSONL path or Python objects (``(clean, corrupt[, answer, wrong])`` tuples
or dicts; :func:`me_interp.patching.pairs.as_pairs`)::

    r = activation_patching.patch_pairs(model, [("When Mary and John went out, John gave it to",
                                                 "When Mary and John went out, Mary gave it to",
                                                 " Mary", " John")])

Every site of ``--sites`` is swept over every layer and position
(:func:`me_interp.patching.patch_sweep`) and scored by ``--metric``: ``logit_diff`` (``logit(answer)
− logit(wrong)`` at each pair's last real token), ``prob`` (the answer's probability there), ``kl``
(``KL(clean ‖ patched)`` there), or the massive-activation metrics ``projection`` / ``sink`` /
``norm_ratio`` at the massive token located on the clean texts.

A cell's value is normalised ``(m_patched − m_corrupt) / (m_clean − m_corrupt)`` on pair means
(clean = 1, corrupt = 0), with a percentile bootstrap over pairs. Two guards keep the top cells
honest:

* a metric that does not separate clean from corrupt beyond its own bootstrap noise (the interval
  of ``mean clean − mean corrupt`` over pairs contains 0) is refused in one line before the sweep:
  every normalised value would divide by noise;
* the top cells of each site are *chosen* on one half of the pairs (:func:`me_interp.claims.halves`)
  and *reported* (value and interval) on the other half, with the number of cells searched.

This mode answers your question, not the paper's: it has no claims.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from me_interp import claims, names, plotting
from me_interp.interventions.causal import PromptBatch
from me_interp.loading.loaded import LoadedModel
from me_interp.patching import (
    HEAD_SITES,
    NormRatio,
    PatchMetric,
    Projection,
    SinkMass,
    attribution_sweep,
    evaluate_metrics,
    patch_sweep,
    rank_agreement,
)
from me_interp.patching.cells import TOP, Cells, Separation, TopCell, separation, top_cells
from me_interp.patching.pairs import (
    LOGIT_METRICS,
    Pair,
    PairBatch,
    PairsLike,
    as_pairs,
    logit_metric,
    tokenize_pairs,
)
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record
from me_interp.probes.site import Site
from me_interp.study import (
    Headed,
    Inputs,
    RunHeader,
    locate_inputs,
    model_for,
    prompt_inputs,
    run_header,
)
from me_interp.terminal import fmt_table

MASSIVE_METRICS = ("projection", "sink", "norm_ratio")
METRICS = (*LOGIT_METRICS, *MASSIVE_METRICS)


@dataclass(frozen=True)
class SiteCells:
    """One swept site: its exact (or attribution) cells; with ``method="both"`` also the
    attribution estimate and its Spearman correlation with the exact cells."""

    cells: Cells
    attribution: Cells | None = None
    agreement: float | None = None


@dataclass(frozen=True)
class PairsResult(Headed):
    """A pairs run (see the module docstring).

    Attributes:
        separation: whether the metric separates clean from corrupt (it does: else the run is
            refused).
        select, test: the pairs the top cells are chosen on and reported on (the same pairs when
            there are fewer than 2).
        n_searched: the cells the top cells were chosen among (finite ones, over every site).
    """

    header: RunHeader
    metric: str
    metric_note: str
    method: str
    pairs: list[Pair]
    tokens: list[str]
    separation: Separation
    sites: list[SiteCells]
    select: list[int]
    test: list[int]
    top: list[TopCell]
    n_searched: int

    def cells(self, site: str) -> Cells:
        return next(s.cells for s in self.sites if s.cells.site == site)

    def __repr__(self) -> str:
        best = max(self.top, key=lambda t: abs(t.selected), default=None)  # as chosen
        shown = (
            "" if best is None else f", top {best.site} {best.cell}: held out {best.normalised:.3g}"
        )
        return (
            f"PairsResult({self.model}, {len(self.pairs)} pairs, metric {self.metric}: clean "
            f"{self.separation.clean:.4g}, corrupt {self.separation.corrupt:.4g}{shown}; "
            f"{len(self.top)} top cells of {self.n_searched})"
        )


def inputs(cfg, model: LoadedModel, pairs: PairsLike | None = None) -> PromptBatch | Inputs | None:
    """What ``activation_patching`` locates its Site on: its prompts (``study.prompt_inputs``);
    with pairs (``pairs``, else ``cfg.pairs``) the tokenised pairs, the Site located on their clean
    texts, or ``None`` (no Site) for a metric on the logits."""
    if pairs is None and cfg.pairs is None:
        return prompt_inputs(cfg, model)
    if (cfg.metric or "logit_diff") in LOGIT_METRICS:
        return None
    pb = tokenize_pairs(model, as_pairs(cfg.pairs if pairs is None else pairs))
    return Inputs(pb.clean, made=(pb,))


def _metric(
    name: str, model: LoadedModel, pb: PairBatch, site: Site | None
) -> tuple[PatchMetric, str]:
    if name in LOGIT_METRICS:
        clean_logits = None
        if name == "kl":
            logits = model.run_with_hooks(pb.clean)
            clean_logits = logits[torch.arange(len(pb)), pb.clean.attention_mask.sum(-1) - 1]
        return logit_metric(name, pb, clean_logits), f"{name} at each pair's last real token"
    assert site is not None  # inputs locates one for every metric but the logits
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


def run(
    cfg,
    model: LoadedModel | None = None,
    site: Site | None = None,
    pairs: PairsLike | None = None,
) -> PairsResult:
    """Sweep every site of ``cfg.sites`` on the pairs (``pairs``, else ``cfg.pairs``). No printing,
    no files. ``site``: the Site located on :func:`inputs` (located here when not given).

    Raises:
        ValueError: the metric does not separate clean from corrupt (one line, with the numbers).
    """
    model = model_for(cfg, model)
    if site is None:
        site = locate_inputs(cfg, model, inputs(cfg, model, pairs))
    if site is None:  # a metric on the logits: no Site
        pb = tokenize_pairs(model, as_pairs(cfg.pairs if pairs is None else pairs))
    else:
        (pb,) = site.inputs.made
    name = cfg.metric or "logit_diff"
    metric, note = _metric(name, model, pb, site)
    ends = [
        evaluate_metrics(model, b, {name: metric})[name].tolist() for b in (pb.clean, pb.corrupt)
    ]
    sep = separation(*ends, cfg.seed)
    if not sep.separates:
        raise ValueError(
            f"{sep.text(name)}: the metric does not separate clean from corrupt beyond its "
            "bootstrap noise, so every normalised cell would divide by noise; choose another "
            "metric or pairs"
        )
    wanted = ("exact", "attribution") if cfg.method == "both" else (cfg.method,)
    sites = []
    for s in cfg.sites:
        heads = cfg.heads if s in HEAD_SITES else None
        each = s not in HEAD_SITES or cfg.head_positions == "each"
        got = [
            patch_sweep(
                model,
                pb.clean,
                pb.corrupt,
                s,
                {name: metric},
                heads=heads,
                per_position=each,
                batch_size=cfg.batch_size,
            )
            if m == "exact"
            else attribution_sweep(
                model, pb.clean, pb.corrupt, s, {name: metric}, heads=heads, per_position=each
            )
            for m in wanted
        ]
        agree = rank_agreement(got[1], got[0], name) if len(got) > 1 else None
        att = Cells.of(got[1]) if len(got) > 1 else None
        sites.append(SiteCells(Cells.of(got[0]), att, agree))
    tokens = model.token_texts(pb.clean)
    everyone = list(range(len(pb)))
    select, test = everyone, everyone
    if len(pb) >= 2:
        select, test = (h.tolist() for h in claims.halves(len(pb), cfg.seed))
    top, searched = top_cells([s.cells for s in sites], name, select, test, tokens, cfg.seed)
    return PairsResult(
        run_header(cfg, model, len(pb)),
        name,
        note,
        cfg.method,
        list(pb.pairs),
        tokens,
        sep,
        sites,
        select,
        test,
        top,
        searched,
    )


def figures(result: PairsResult) -> dict[str, go.Figure]:
    """One heat map per site (all pairs)."""
    return {
        f"pairs_{s.cells.site}": plotting.cells_heatmap(
            s.cells,
            s.cells.normalized(result.metric),
            result.tokens,
            f"Patching {s.cells.site} on {len(result.pairs)} pairs, metric {result.metric} (clean "
            f"= 1, corrupt = 0) — {result.model}<br><sup>positions labelled by pair 0's tokens</sup>",
        )
        for s in result.sites
    }


def summary(result: PairsResult) -> str:
    head = f"model: {result.model}   {len(result.pairs)} pairs; {result.separation.text(result.metric)} ({result.metric_note})"
    if result.method == "attribution":
        head += "\nmethod: attribution patching (first-order estimate, one forward + one backward)"
    rho = [f"{s.cells.site} {s.agreement:.3f}" for s in result.sites if s.agreement is not None]
    if rho:
        head += f"\nattribution vs exact, Spearman rank correlation over cells: {', '.join(rho)}"
    same = result.select == result.test
    head += f"\ntop {TOP} cells per site of {result.n_searched} searched, " + (
        "chosen and reported on the same pairs (fewer than 2: nothing held out)"
        if same
        else f"chosen on {len(result.select)} pairs, reported on the other {len(result.test)}"
    )
    rows = [
        (t.site, t.cell, t.selected, t.normalised, f"[{t.lo:.3g}, {t.hi:.3g}]") for t in result.top
    ]
    cols = ["site", "cell", "chosen on", "normalised (1 = clean)", f"{claims.LEVEL:.0%} CI"]
    return f"{head}\n{fmt_table(cols, rows)}"
