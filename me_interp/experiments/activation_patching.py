"""Activation patching of the massive activation: what writes it, what carries it, what it causes.

Clean run: the prompts (``--max-prompts`` of them spread over the prompt list, each cut to its first
``--max-tokens`` tokens). Corrupt run, chosen by ``--corruption`` so that the massive activation
*never forms* in it:

* ``first_token`` — token 0 replaced by token 1 (the prompt without its first token, the next token
  doubled to keep the length). On a model whose sink token is BOS (the planted model) this removes
  the massive activation; nothing inside the model is overwritten;
* ``remove_input`` — same tokens, but the massive token's residual stream *entering* the ME layer
  (the output of the layer before) is set to the other tokens' mean (``interventions.causal.
  remove_massive`` at ``resid_pre``, per prompt). The ME layer then never sees the direction it
  amplifies. (On SmolLM2 the massive activation appears at position 0 whatever the first token is, so
  this is the corruption that removes it there.)
* ``remove_ffn`` — the ME layer's FFN output of the massive token set to the other tokens' mean:
  the cell the claims are about is then the one the corruption overwrote, so ``ffn_writes`` is not
  applicable and that cell is only the sanity check;
* ``auto`` — ``first_token`` when it removes the massive activation (the ``removed`` rule of
  :data:`me_interp.claims.THRESHOLDS` on the point estimate), else ``remove_input``.

For each site (``resid_pre``, ``attn_out``, ``mlp_out``; any of ``patching.PATCH_SITES``) every layer
(``resid_pre``: up to the layer after the ME layer — later, patching the massive token's whole state
restores it trivially) is patched at the massive position ``p`` from the clean run (every layer and
position with ``--all-positions``), batched (``me_interp.patching.patch_sweep``), and two metrics are
read per prompt:

* ``projection`` — the *signed* projection ``⟨h_p, u⟩`` of the massive token's state at the output of
  ``--metric-layer`` (default: the last layer) onto the clean massive direction ``u`` (the unit
  prompt-mean of the clean massive token's state at the ME-layer output; ``patching.Projection``). A
  norm cannot tell a write along ``u`` from one against it: a late FFN that *erases* the massive
  activation (output cosine ≈ −1 with ``u``) inflates ``‖h_p‖`` when patched into a run where the
  activation never formed, but lowers the projection;
* ``sink`` — mean attention to ``p`` over the heads, queries ``q > p`` and the layers after the ME
  layer.

A patch's normalised value is ARENA's ``(m_patched − m_corrupt) / (m_clean − m_corrupt)`` on prompt
means (clean = 1, corrupt = 0), bootstrapped over prompts. A value above 1 is an *overshoot* (the
patched run has more of the massive direction than the clean run): the details say so, and it is not
called a restore.

Claims (:data:`SPECS`; kinds in brackets): the corruption removed the activation (``removal``, a
precondition) [sanity]; patching back the cell the corruption overwrote gives 1 (``undo``) [sanity];
the ME layer's FFN output alone brings the massive direction back downstream (``ffn_writes``)
[claim] — unless that output *is* the massive token's state (cosine > 0.99 and 95–105 % of its norm,
``probes.ffn.ffn_share``), as on the planted model and on SmolLM2 (cosine 0.99998),
where the activation appears suddenly in one FFN: then the same patch is patching the state back,
and it is judged as ``ffn_is_state`` [sanity] instead; the massive token's clean state after the
ME layer restores the downstream sink (``state_causes_sink``) [sanity]; no later attention or FFN output brings the massive direction back
(``not_rewritten``) [claim] — a later sub-layer that writes *against* it (erases it) gives a negative
value and is named in the details. None is decided by a cell the corruption overwrote, and none but
the precondition applies when the corruption did not remove the activation.

Per head (:mod:`me_interp.experiments.patching_heads`): the heads after the ME layer with the most
attention to the massive token, chosen on half of the prompts, have their clean outputs patched
together into the corrupt run; on the other half they restore at least half of the clean
next-token distribution (``sink_heads_restore``) [claim], and at least ``head_excess`` more than as
many random heads of the same layers (``sink_heads_beat_random``) [claim]. The figure
``sink_heads`` maps every head's attention to the massive token and its own restore.

With ``--pairs FILE.jsonl`` it answers *your* question instead: your clean/corrupt pairs, scored by
``--metric`` (``logit_diff``, ``prob``, ``kl``, or a massive-activation metric), every layer and
position of every site (per-head sites: ``attn_head_out``, ``attn_head_pattern``, ``q``, ``k``,
``v``), with no claims (:mod:`me_interp.experiments.patching_pairs`).

    python -m me_interp.experiments.activation_patching
    python -m me_interp.experiments.activation_patching --model synthetic:planted --prompts p.txt
    python -m me_interp.experiments.activation_patching --pairs ioi.jsonl --metric logit_diff
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from me_interp import claims, names, plotting
from me_interp.experiments import patching_heads, patching_pairs
from me_interp.interventions import causal
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.patching import (
    HEAD_SITES,
    PATCH_SITES,
    Projection,
    SinkMass,
    SweepResult,
    patch_sweep,
)
from me_interp.patching.pairs import read_pairs
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record
from me_interp.probes.ffn import FfnShare, ffn_share
from me_interp.probes.site import Site, locate
from me_interp.study import CommonConfig, Experiment, checked, command, model_for
from me_interp.terminal import fmt_table

NAME = "activation_patching"
FFN_SITES = ("mlp_out", "ffn_out")
PROJECTION = "projection"
OVERSHOOT = 1 + 1e-6
"""A normalised value above this (1 up to float noise) is an overshoot, not a restore."""
RESTORE = "normalised {metric} (clean = 1, corrupt = 0; ratio of prompt means; above 1: overshoot)"
_PROJ = "signed projection ⟨h_p, u⟩ at the metric layer onto the clean massive direction u"


def _why_massive(r: Result) -> str | None:
    return None if r.site.massive else r.site.why_not


def _why_removed(r: Result) -> str | None:
    """Why the patching claims do not apply: no massive activation, or the corruption did not remove
    it (the ``removed`` rule on the point estimate: there is nothing for a patch to restore)."""
    why = _why_massive(r)
    if why is None and not r.removal_fraction() <= claims.threshold("removed"):
        why = (
            f"the corruption ({r.corruption}) did not remove the massive activation (ME-layer "
            f"(R − 1) corrupt / clean = {r.removal_fraction():.3g} > "
            f"{claims.threshold('removed'):g}, threshold 'removed'): there is nothing for a patch "
            "to restore"
        )
    return why


def _why_ffn(r: Result, *, state: bool) -> str | None:
    """``ffn_writes`` (``state=False``) applies when the FFN output is not the state,
    ``ffn_is_state`` (``state=True``) when it is; neither when the corruption overwrote that cell or
    the metric is read before the ME layer."""
    why = _why_removed(r)
    if why is not None:
        return why
    L = r.site.layer
    if r.corruption == "remove_ffn":
        return (
            "the remove_ffn corruption overwrote this very cell: its restore is the 'undo' sanity "
            "check (use --corruption remove_input or first_token)"
        )
    if r.metric_layer < L:
        return f"the metric layer {r.metric_layer} is before the ME layer {L}: the patch cannot change it"
    if r.ffn.is_state() != state:
        if state:
            return f"{r.ffn.text()}: it is not the state, so the patch is evidence (ffn_writes)"
        return (
            f"{r.ffn.text()}: the FFN output is the state itself, so patching it is patching the "
            "state back — judged as the sanity check ffn_is_state"
        )
    return None


def _why_sink(r: Result) -> str | None:
    why = _why_removed(r)
    if why is None and r.site.layer + 1 >= r.n_layers:
        why = f"the ME layer {r.site.layer} is the last layer: no later layer, no downstream sink"
    return why


def _why_later(r: Result) -> str | None:
    why = _why_sink(r)
    if why is None and r.metric_layer <= r.site.layer + 1:
        why = (
            f"no layer lies between the ME layer {r.site.layer} and the metric layer "
            f"{r.metric_layer}: no later sub-layer can be patched without writing into the measured "
            "cell itself"
        )
    return why


def _cells_stat(key: str, metric: str):
    """The statistic of a claim decided by the cells ``Result.cells(key)``: per prompt
    ``[clean, corrupt, patched …]``, the largest normalised value over the cells."""

    def stat(r: Result) -> claims.Sample:
        cells = r.cells(key)
        rows = r.cell_rows(cells, metric)
        if rows is None:
            shown = ", ".join(f"{c} at layer {x}" for c, x, _ in cells[:3])
            raise claims.NotApplicable(
                f"the cells it needs ({shown}{', …' if len(cells) > 3 else ''}; metric {metric}) "
                "were not swept (see --sites)"
            )
        return claims.Sample(rows, _restore_stat)

    return stat


def _details(key: str, metric: str):
    def details(r: Result) -> str:
        s = r.site
        out = (
            f"corruption {r.corruption}; ME layer {s.layer} (1-based {s.layer + 1}), position "
            f"{s.position}; metric layer {r.metric_layer}; n = {len(r.me_ratio_clean)} prompts of "
            f"<= {r.prompts.max_tokens} tokens"
        )
        if key == "removal":
            return (
                f"{out}; ME-layer R clean {np.mean(r.me_ratio_clean):.4g}, corrupt "
                f"{np.mean(r.me_ratio_corrupt):.4g}"
            )
        rows = r.cell_rows(r.cells(key), metric)
        if rows is None:
            return out
        m = rows.mean(0)
        out += f"; {metric} clean {m[0]:.4g}, corrupt {m[1]:.4g}"
        if metric == PROJECTION:
            out += (
                f"; the clean state of p at the metric layer has cosine {r.direction_cos:.3g} with "
                "the ME-layer massive direction u"
            )
        if key in ("ffn_writes", "ffn_is_state"):
            out += f"; {r.ffn.text()}"
        norm = (m[2:] - m[1]) / (m[0] - m[1]) if m[0] != m[1] else np.full(len(m) - 2, np.nan)
        cells = r.cells(key)
        if len(cells) > 1 and np.isfinite(norm).any():
            hi, lo = int(np.nanargmax(norm)), int(np.nanargmin(norm))
            out += f"; largest {norm[hi]:.3g} at {cells[hi][0]} of layer {cells[hi][1]}"
            if norm[lo] < 0:
                out += f"; most negative {norm[lo]:.3g} at {cells[lo][0]} of layer {cells[lo][1]}"
                if norm[lo] <= -claims.threshold("restore"):
                    out += " (it writes against the massive direction: it erases it)"
        best = float(np.nanmax(norm)) if np.isfinite(norm).any() else float("nan")
        if best > OVERSHOOT:
            out += (
                f"; overshoot: {best:.3g} > 1 — the patched run has more along the massive direction "
                "than the clean run, which is not a restore"
            )
        return out

    return details


def _why_heads(r: Result) -> str | None:
    """Why the sink-heads claims do not apply: those of :func:`_why_removed`, the question not
    measured (``sink_heads_why``), or no sink head (no head after the ME layer attends to ``p``
    with at least ``sink_attention`` on the selection prompts)."""
    why = _why_removed(r) or r.sink_heads_why
    if why is None and r.sink_heads is None:
        why = "the sink-heads question was not measured in this run"
    if why is None:
        att = r.sink_heads.selection_attention()
        if float(att.max()) < claims.threshold("sink_attention"):
            why = (
                f"no sink head: no head after layer {r.site.layer} attends to position "
                f"{r.site.position} with at least {claims.threshold('sink_attention'):g} "
                f"(threshold 'sink_attention'; the most: {float(att.max()):.3g})"
            )
    return why


def _why_random_heads(r: Result) -> str | None:
    why = _why_heads(r)
    if why is None:
        why = claims.too_few_seeds(len(r.sink_heads.random_sets), "--n-random")
    return why


def _heads_details(r: Result) -> str:
    return (
        f"corruption {r.corruption}; ME layer {r.site.layer}, position {r.site.position}; "
        + patching_heads.details(r.sink_heads)
    )


_HEADS = (
    "the clean outputs (hook_z, every position) of the k sink heads — the heads after the ME layer "
    "with the most attention to the massive token on the selection half of the prompts — patched "
    "together into the corrupt run"
)
_KL = (
    "normalised KL(clean ‖ run) of the next-token distribution at the last token (clean = 1, "
    "corrupt = 0; ratio of held-out prompt means)"
)

SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "activation_patching.removal",
        "§3 (activation patching)",
        "Precondition: the corruption removes the massive activation at the ME layer, so there is "
        "something for a patch to restore",
        "(R − 1) of the massive token at the ME-layer output, corrupt over clean "
        "(R = ‖h_p‖ / median_{t≠p}‖h_t‖; ratio of prompt means)",
        "<=",
        "removed",
        control="the clean run",
        kind="sanity",
        stat=lambda r: claims.Sample(
            np.stack([r.me_ratio_corrupt, r.me_ratio_clean], 1), claims.excess_stat
        ),
        applies=_why_massive,
        details=_details("removal", ""),
    ),
    claims.Spec(
        "activation_patching.undo",
        "§3 (activation patching)",
        "Patching back the very cell the corruption overwrote gives the clean run (true by "
        "construction: the fixed point of the metric)",
        RESTORE.format(metric=_PROJ) + " of that patch",
        ">=",
        "restore",
        control="the corrupt run (0)",
        kind="sanity",
        stat=_cells_stat("undo", PROJECTION),
        applies=_why_removed,
        details=_details("undo", PROJECTION),
    ),
    claims.Spec(
        "activation_patching.ffn_writes",
        "§2.1, §3",
        "The ME layer's FFN writes the massive activation: its output at the massive token, patched "
        "alone from the clean run into a run where the activation never formed, brings back at "
        "least half of the clean massive direction downstream (applies only where that output is "
        "not the massive token's whole state)",
        RESTORE.format(metric=_PROJ) + " of the mlp_out patch at (ME layer, p)",
        ">=",
        "restore",
        control="the corrupt run (0); the mlp_out patches of the other layers (figure)",
        stat=_cells_stat("ffn_writes", PROJECTION),
        applies=lambda r: _why_ffn(r, state=False),
        details=_details("ffn_writes", PROJECTION),
    ),
    claims.Spec(
        "activation_patching.ffn_is_state",
        "§2.1, §3",
        "Where the ME layer's FFN output at the massive token is its whole state (cosine > 0.99, "
        "95–105 % of the norm), patching that output back is patching the state back: it brings the "
        "clean massive direction back downstream (a sanity check, not evidence about the FFN)",
        RESTORE.format(metric=_PROJ) + " of the mlp_out patch at (ME layer, p)",
        ">=",
        "restore",
        control="the corrupt run (0)",
        kind="sanity",
        stat=_cells_stat("ffn_writes", PROJECTION),
        applies=lambda r: _why_ffn(r, state=True),
        details=_details("ffn_writes", PROJECTION),
    ),
    claims.Spec(
        "activation_patching.state_causes_sink",
        "§2.6",
        "Patching the massive token's whole clean state after the ME layer into the corrupt run "
        "restores the later layers' sink (nearly true by construction: for p = 0 every later state "
        "of p is then exactly clean, and only the ME layer's attention saw the corrupted p; a "
        "sanity check, not evidence — sink_causality tests the cause)",
        RESTORE.format(metric="sink (attention to p, layers after the ME layer)")
        + " of the resid_pre patch at (ME layer + 1, p)",
        ">=",
        "restore",
        control="the corrupt run (0): the same prompts without the massive activation",
        kind="sanity",
        stat=_cells_stat("state_causes_sink", "sink"),
        applies=_why_sink,
        details=_details("state_causes_sink", "sink"),
    ),
    claims.Spec(
        "activation_patching.not_rewritten",
        "§2.1",
        "No later sub-layer rewrites the massive activation: no single attention or FFN output "
        "at the massive token after the ME layer, patched into the run where it never formed, "
        "brings back half of the clean massive direction (what carries it is not tested here; a "
        "sub-layer that erases it reads negative)",
        "largest "
        + RESTORE.format(metric=_PROJ)
        + " over the attn_out and mlp_out patches at p in the layers after the ME layer and before "
        "the metric layer",
        "<",
        "restore",
        control="the ME layer's own FFN patch (ffn_writes / ffn_is_state)",
        stat=_cells_stat("not_rewritten", PROJECTION),
        applies=_why_later,
        details=_details("not_rewritten", PROJECTION),
    ),
    claims.Spec(
        "activation_patching.sink_heads_restore",
        "§2.4, §2.6",
        "The massive activation acts on the output through the heads that attend to it: the clean "
        "outputs of the few heads with the most attention to the massive token (chosen on other "
        "prompts), patched together into the run where the activation never formed, restore at "
        "least half of the clean next-token distribution",
        f"{_KL} of {_HEADS}",
        ">=",
        "restore",
        control="as many random heads of the same layers (sink_heads_beat_random); each head "
        "alone (figure sink_heads)",
        stat=lambda r: claims.Sample(r.sink_heads.rows(), _restore_stat, unit="held-out prompts"),
        applies=_why_heads,
        details=_heads_details,
    ),
    claims.Spec(
        "activation_patching.sink_heads_beat_random",
        "§2.4, §2.6",
        "The heads that attend most to the massive token carry its effect on the output more than "
        "other heads of the same layers: patched together, they restore more of the clean "
        "next-token distribution than as many random heads of those layers, by at least the "
        "head_excess threshold",
        f"restore of {_HEADS}, minus that of as many random heads of the same layers (as many per "
        "layer); per held-out prompt × random draw (KL_random − KL_sink) / (mean KL_corrupt − "
        "mean KL_clean); two-way (crossed) bootstrap over held-out prompts × draws",
        ">=",
        "head_excess",
        control="the random heads of the same layers (the statistic's baseline)",
        stat=lambda r: claims.Nested(
            r.sink_heads.excess(), unit="held-out prompts", inner="random draws"
        ),
        applies=_why_random_heads,
        details=_heads_details,
    ),
)
SPEC = claims.index(SPECS)


@dataclass(frozen=True)
class Config(CommonConfig):
    """Activation-patching settings.

    Attributes:
        sites: sites to patch, each swept over every layer (``ffn_in``: the pre-FFN RMSNorm
            output; ``mlp_out``: the FFN output; the per-head sites: see ``heads``). The claims
            need ``resid_pre``, ``attn_out`` and ``mlp_out``; a claim whose site is not swept is not
            applicable.
        corruption: ``first_token`` (token 0 replaced by token 1), ``remove_input`` (the massive
            token's residual input to the ME layer set to the other tokens' mean), ``remove_ffn``
            (the ME layer's FFN output of the massive token set to the other tokens' mean) or
            ``auto`` (``first_token`` when it removes the massive activation, else
            ``remove_input``).
        max_tokens: prompts are cut to their first ``max_tokens`` tokens (>= 2).
        max_prompts: how many prompts to use, spread evenly over the prompt list (``None``: all).
            Every patched cell costs a forward of this many prompts from its layer on; the default
            keeps the bundled model's run under a minute on two CPU cores.
        all_positions: sweep every position and every layer of every site (heat maps) instead of
            the massive position (and ``resid_pre`` only up to the layer after the ME layer); costs
            ``max_tokens`` times more.
        metric_layer: layer (0-based) whose output gives the projection metric; ``None`` = the last
            layer.
        layer: the ME layer (0-based); ``None`` = detected on the prompts.
        batch_size: rows (patched prompts) per forward of the sweep.
        pairs: a JSONL file of your own pairs (``{"clean", "corrupt", "answer", "wrong"}`` a line):
            patch them instead of asking the built-in question (no claims; see
            :mod:`me_interp.experiments.patching_pairs`).
        metric: with ``pairs``: what a patched cell measures (``None``: ``logit_diff``).
        heads: heads to patch at the per-head sites (``attn_head_out``, ``attn_head_pattern``,
            ``q``, ``k``, ``v``); ``None`` = all.
        head_positions: per-head sites patch ``all`` positions at once (a layer × head grid) or
            ``each`` position (layer × position × head; for the pattern, the query position).
        method: with ``pairs``: ``exact`` patching, ``attribution`` patching (one forward and one
            backward estimate every cell) or ``both`` (with their rank correlation per site).
        n_sink_heads: the sink-heads question (:mod:`me_interp.experiments.patching_heads`): how
            many heads, those with the most attention to the massive token on the selection half of
            the prompts, are patched together; ``None`` = one per layer after the ME layer.
        n_random: draws of as many random heads of the same layers (the control; at least
            ``claims.MIN_SEEDS`` for its claim to be judged; 0 skips the sink-heads question).
    """

    sites: tuple[str, ...] = checked(
        ("resid_pre", "attn_out", "mlp_out"), choices=PATCH_SITES, nonempty=True
    )
    corruption: Literal["auto", "first_token", "remove_input", "remove_ffn"] = "auto"
    max_tokens: int = checked(32, ge=2)
    max_prompts: int | None = checked(16, ge=1)
    all_positions: bool = False
    metric_layer: int | None = checked(None, ge=0)
    layer: int | None = checked(None, ge=0)
    batch_size: int = checked(64, ge=1)
    pairs: str | None = None
    metric: str | None = checked(None, choices=patching_pairs.METRICS)
    heads: tuple[int, ...] | None = checked(None, ge=0)
    head_positions: Literal["all", "each"] = "all"
    method: Literal["exact", "attribution", "both"] = "exact"
    n_sink_heads: int | None = checked(None, ge=1)
    n_random: int = checked(10, ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pairs is not None:
            read_pairs(self.pairs)  # missing, not UTF-8, malformed: said before the model loads
        elif self.metric is not None:
            raise ValueError("metric applies only with pairs (the built-in question has its own)")
        if self.method != "exact" and self.pairs is None:
            raise ValueError(
                "method applies only with pairs (the built-in claims use exact patching)"
            )


def first_token_corrupt(clean: Batch) -> Batch:
    """Token 0 replaced by token 1 of each prompt (same length)."""
    t = clean.tokens.clone()
    t[:, 0] = t[:, 1]
    return Batch(t, clean.attention_mask.clone(), None)


def _corrupt_for(
    model: LoadedModel, corruption: str, layer: int, position: int, batch: Batch
) -> tuple[Batch, list]:
    """The corrupt run of ``batch`` under ``corruption`` (not ``auto``): its tokens and hooks."""
    if corruption == "first_token":
        return first_token_corrupt(batch), []
    where = "resid_pre" if corruption == "remove_input" else "ffn_out"
    return batch, causal.remove_massive(model, batch, layer, [position], None, site=where)


def median_ratios(
    model: LoadedModel, batch: Batch, layer: int, position: int, fwd_hooks: Sequence = ()
) -> torch.Tensor:
    """Per prompt ``‖h_p‖ / median_{t≠p} ‖h_t‖`` at the output of ``layer`` (under ``fwd_hooks``).

    The median, not the mean, of the others: a corruption that makes a *second* token massive
    (SmolLM2 does this when token 0 is doubled) must not count as removing the massive activation.
    """
    name = names.resid_post(layer)
    acts = Activations(model, batch, [name])
    record(model, batch, [acts], fwd_hooks=fwd_hooks, last_layer=layer, max_tokens=None)
    n = acts[name].float().norm(dim=-1).cpu()
    keep = batch.attention_mask.bool().cpu().clone()
    keep[:, position] = False
    others = n.masked_fill(~keep, float("nan")).nanmedian(-1).values
    return n[:, position] / others


@claims.of_means
def _restore_stat(m: np.ndarray) -> np.ndarray | float:
    """Columns ``[clean, corrupt, patched_1 … patched_k]`` → the largest restore over the cells, of
    the column means ``m``."""
    denom = m[..., 0] - m[..., 1]
    return np.max(claims.divide(m[..., 2:] - m[..., 1:2], denom[..., None]), axis=-1)


@dataclass
class Result:
    """The clean/corrupt pair, the sweeps, and what the claims need to know about the FFN output.

    Attributes:
        undo_cell: the (site, layer, position) the corruption overwrote.
        ffn: the ME layer's FFN output at ``p`` against the massive token's state there (clean run).
        direction_cos: mean over prompts of the cosine between the clean massive token's state at the
            metric layer and the massive direction ``u`` (ME-layer output) it is projected on.
    """

    model: str
    bos: str
    site: Site
    prompts: causal.PromptBatch
    corruption: str
    corruption_note: str
    undo_cell: tuple[str, int, int]
    n_layers: int
    metric_layer: int
    me_ratio_clean: list[float]
    me_ratio_corrupt: list[float]
    sweeps: dict[str, SweepResult]
    tokens: list[str]
    ffn: FfnShare
    direction_cos: float
    seed: int = 0
    sink_heads: patching_heads.SinkHeads | None = None
    sink_heads_why: str | None = None

    def _sweep(self, site: str) -> SweepResult | None:
        if site in FFN_SITES:
            return next((self.sweeps[s] for s in FFN_SITES if s in self.sweeps), None)
        return self.sweeps.get(site)

    def cell_rows(self, cells: Sequence[tuple[str, int, int]], metric: str) -> np.ndarray | None:
        """Per prompt ``[clean, corrupt, patched at each (site, layer, position) cell]``; ``None``
        when a cell was not swept or the metric was not read."""
        cols: list[torch.Tensor] = []
        for site, layer, pos in cells:
            sw = self._sweep(site)
            if sw is None or metric not in sw.values or layer not in sw.layers:
                return None
            if pos not in sw.positions:
                return None
            if not cols:
                cols = [sw.clean[metric], sw.corrupt[metric]]
            cols.append(sw.cell_values(metric, layer, pos))
        return torch.stack(cols, 1).double().numpy() if cols else None

    def restore(self, cell: tuple[str, int, int], metric: str = PROJECTION) -> float:
        """Point estimate of the normalised value of one cell (clean = 1, corrupt = 0; NaN when not
        swept)."""
        rows = self.cell_rows([cell], metric)
        return float("nan") if rows is None else _restore_stat(rows)

    def claim_cells(self) -> dict[str, tuple[str, int, int]]:
        """The cell each single-cell claim is decided by (``undo``: the overwritten one)."""
        L, p = self.site.layer, self.site.position
        return {
            "undo": self.undo_cell,
            "ffn_writes": ("mlp_out", L, p),
            "state_causes_sink": ("resid_pre", L + 1, p),
        }

    def cells(self, key: str) -> list[tuple[str, int, int]]:
        """The cells claim ``key`` is decided by."""
        return self.later_cells() if key == "not_rewritten" else [self.claim_cells()[key]]

    def removal_fraction(self) -> float:
        return claims.excess_fraction(
            float(np.mean(self.me_ratio_corrupt)), float(np.mean(self.me_ratio_clean))
        )

    def later_cells(self) -> list[tuple[str, int, int]]:
        """The attn_out and mlp_out cells at ``p`` of the layers after the ME layer and before the
        metric layer (the metric layer's own sub-layers write straight into the measured cell)."""
        p = self.site.position
        return [
            (s, layer, p)
            for layer in range(self.site.layer + 1, self.metric_layer)
            for s in ("attn_out", "mlp_out")
        ]

    def to_dict(self) -> dict[str, Any]:
        cells = self.claim_cells()
        restore = {
            k: {"cell": list(c), **{m: self.restore(c, m) for m in (PROJECTION, "sink")}}
            for k, c in cells.items()
        }
        for v in restore.values():
            v["overshoot"] = bool(v[PROJECTION] > OVERSHOOT or v["sink"] > OVERSHOOT)
        per_prompt: dict[str, Any] = {
            "me_ratio_clean": self.me_ratio_clean,
            "me_ratio_corrupt": self.me_ratio_corrupt,
        }
        for k, c in cells.items():
            for m in (PROJECTION, "sink"):
                rows = self.cell_rows([c], m)
                if rows is not None:
                    per_prompt[f"{k}.{m}"] = {
                        "clean": rows[:, 0].tolist(),
                        "corrupt": rows[:, 1].tolist(),
                        "patched": rows[:, 2].tolist(),
                    }
        return {
            "model": self.model,
            "bos": self.bos,
            "massive_site": self.site.to_dict(),
            "prompts": self.prompts.to_dict(),
            "corruption": self.corruption,
            "corruption_note": self.corruption_note,
            "removal_fraction": self.removal_fraction(),
            "metric_layer": self.metric_layer,
            "ffn_share": self.ffn.to_dict(),
            "direction_cos_at_metric_layer": self.direction_cos,
            "restore": restore,
            "per_prompt": per_prompt,
            "tokens_prompt0": self.tokens,
            "sweeps": {s: sw.to_dict() for s, sw in self.sweeps.items()},
            "sink_heads": None if self.sink_heads is None else self.sink_heads.to_dict(),
            "sink_heads_why": self.sink_heads_why,
        }


def specs_for(result: Result | patching_pairs.PairsResult) -> tuple[claims.Spec, ...]:
    """The claims judged on ``result``: none for a run on the user's own pairs."""
    return () if isinstance(result, patching_pairs.PairsResult) else SPECS


def run(cfg: Config, model: LoadedModel | None = None) -> Result | patching_pairs.PairsResult:
    """Build the clean/corrupt pair and sweep every site (with ``cfg.pairs``: the user's pairs,
    :func:`me_interp.experiments.patching_pairs.run`). No printing, no files.

    Raises:
        claims.NotApplicable: no massive activation on this model and no ``layer`` given.
    """
    if cfg.pairs is not None:
        return patching_pairs.run(cfg, model)
    model = model_for(cfg, model)
    pb = causal.prompt_batch(model, cfg.load_prompts(), cfg.max_tokens, cfg.max_prompts)
    site = locate(model, pb.batch, layer=cfg.layer, position=None, seed=cfg.seed)
    site.require("pass --layer to intervene anyway")
    p, L = site.position, site.layer
    pb = pb.at_least(p + 2)  # a query after the massive token
    clean = pb.batch
    last = model.n_layers - 1
    metric_layer = last if cfg.metric_layer is None else model.check_layer(cfg.metric_layer)
    acts = Activations(
        model, clean, [names.ffn_out(L), names.resid_post(L), names.resid_post(metric_layer)]
    )
    record(model, clean, [acts], last_layer=acts.last_layer, max_tokens=None)
    h_me = acts[names.resid_post(L)][:, p].float().cpu()  # [B d]
    u = h_me.mean(0)
    u = u / u.norm()  # the clean massive direction
    h_metric = acts[names.resid_post(metric_layer)][:, p].float().cpu()
    direction_cos = float(torch.nn.functional.cosine_similarity(h_metric, u[None], dim=-1).mean())
    metrics: dict[str, Any] = {PROJECTION: Projection(metric_layer, u, p)}
    if L < last:
        metrics["sink"] = SinkMass(tuple(range(L + 1, model.n_layers)), p)

    clean_me = median_ratios(model, clean, L, p)
    corruption, corrupt, hooks, note = cfg.corruption, clean, [], ""
    removed = claims.threshold("removed")
    if corruption in ("auto", "first_token"):
        corrupt = first_token_corrupt(clean)
        corrupt_me = median_ratios(model, corrupt, L, p)
        frac = claims.excess_fraction(float(corrupt_me.mean()), float(clean_me.mean()))
        note = (
            f"first-token replacement: ME-layer (R - 1) corrupt / clean = {frac:.3g} "
            f"(R = norm / median of the others: {float(clean_me.mean()):.4g} -> "
            f"{float(corrupt_me.mean()):.4g})"
        )
        if corruption == "auto":
            corruption = "first_token" if frac <= removed else "remove_input"
            note += f"; auto chose {corruption}"
    if corruption in ("remove_input", "remove_ffn"):
        corrupt, hooks = _corrupt_for(model, corruption, L, p, clean)
        corrupt_me = median_ratios(model, clean, L, p, hooks)
    undo = {
        "first_token": ("resid_pre", 0, 0),
        "remove_input": ("resid_pre", L, p),
        "remove_ffn": ("mlp_out", L, p),
    }[corruption]
    T = clean.tokens.shape[1]
    positions = list(range(T)) if cfg.all_positions else sorted({p, undo[2]})
    # after the ME layer, patching the massive token's whole residual state restores it trivially
    # (for p = 0 by causal attention): resid_pre is swept up to the layer after the ME layer
    short = list(range(min(L + 2, model.n_layers)))
    sweeps = {
        s: patch_sweep(
            model,
            clean,
            corrupt,
            s,
            metrics,
            layers=short if s == "resid_pre" and not cfg.all_positions else None,
            positions=positions if s not in HEAD_SITES or cfg.head_positions == "each" else None,
            batch_size=cfg.batch_size,
            corrupt_hooks=hooks,
            heads=cfg.heads if s in HEAD_SITES else None,
            per_position=s not in HEAD_SITES or cfg.head_positions == "each",
        )
        for s in cfg.sites
    }
    heads, heads_why = None, None
    if cfg.n_random > 0:
        try:
            heads = patching_heads.measure(
                model,
                clean,
                corrupt,
                hooks,
                partial(_corrupt_for, model, corruption, L, p),
                L,
                p,
                k=cfg.n_sink_heads,
                n_random=cfg.n_random,
                seed=cfg.seed,
                batch_size=cfg.batch_size,
            )
        except claims.NotApplicable as e:
            heads_why = str(e)
    else:
        heads_why = "not measured in this run (--n-random 0)"
    tokens = [model.tokenizer.decode([int(t)]) for t in clean.tokens[0, : clean.lengths[0]]]
    return Result(
        model=model.name,
        bos=model.bos,
        site=site,
        prompts=pb,
        corruption=corruption,
        corruption_note=note,
        undo_cell=undo,
        n_layers=model.n_layers,
        metric_layer=metric_layer,
        me_ratio_clean=clean_me.tolist(),
        me_ratio_corrupt=corrupt_me.tolist(),
        sweeps=sweeps,
        tokens=tokens,
        ffn=ffn_share(model, clean, L, p, acts=acts),
        direction_cos=direction_cos,
        seed=cfg.seed,
        sink_heads=heads,
        sink_heads_why=heads_why,
    )


def figures(result: Result | patching_pairs.PairsResult) -> dict[str, Any]:
    if isinstance(result, patching_pairs.PairsResult):
        return patching_pairs.figures(result)
    figs: dict[str, Any] = {}
    p, L = result.site.position, result.site.layer
    metric_names = next(iter(result.sweeps.values())).metric_names
    for metric in metric_names:
        series = {}
        for s, sw in result.sweeps.items():
            if sw.heads is None:  # per-head sweeps: the pairs-style heat map below
                series[s] = sw.normalized(metric)[:, sw.positions.index(p)].tolist()
        fig = plotting.layer_lines(
            series,
            f"Activation patching at position {p}, metric {metric} (clean = 1, corrupt = 0) — "
            f"{result.model}<br><sup>corruption: {result.corruption}</sup>",
            "normalised (clean = 1, corrupt = 0)",
            L,
        )
        figs[f"patching_{metric}"] = fig
        if any(sw.heads is None and len(sw.positions) > 2 for sw in result.sweeps.values()):
            figs[f"patching_{metric}_positions"] = _heatmaps(result, metric)
        for s, sw in result.sweeps.items():
            if sw.heads is not None:
                figs[f"patching_{metric}_{s}"] = patching_pairs.heatmap(
                    sw,
                    metric,
                    result.tokens,
                    f"Activation patching of {s}, metric {metric} (clean = 1, corrupt = 0) — "
                    f"{result.model}<br><sup>corruption: {result.corruption}</sup>",
                )
    if result.sink_heads is not None:
        figs["sink_heads"] = _sink_heads_figure(result)
    return figs


def _sink_heads_figure(result: Result) -> go.Figure:
    sh = result.sink_heads
    return patching_heads.figure(
        sh,
        f"Sink heads: attention to the massive token and restore of the output (KL), per head — "
        f"{result.model}<br><sup>corruption {result.corruption}; ME layer {result.site.layer}; "
        f"the {sh.k} sink heads (red) patched together restore {sh.restore(sh.kl_top):.3g}, "
        f"random heads of the same layers {np.mean(sh.random_restores() or [np.nan]):.3g}</sup>",
    )


def _heatmaps(result: Result, metric: str) -> go.Figure:
    labels = [f"{i}: {t!r}" for i, t in enumerate(result.tokens)]
    sites = [s for s, sw in result.sweeps.items() if sw.heads is None]
    fig = make_subplots(rows=1, cols=len(sites), subplot_titles=sites, shared_yaxes=True)
    for i, s in enumerate(sites):
        sw = result.sweeps[s]
        fig.add_trace(
            go.Heatmap(
                z=sw.normalized(metric).T.tolist(),
                x=sw.layers,
                y=[labels[q] if q < len(labels) else str(q) for q in sw.positions],
                zmin=-1,
                zmax=1,
                colorscale="RdBu",
                reversescale=True,
                showscale=i == 0,
                hovertemplate="layer %{x}<br>position %{y}<br>normalised %{z:.3f}<extra>"
                + s
                + "</extra>",
            ),
            row=1,
            col=i + 1,
        )
        fig.update_xaxes(title_text="layer (0-based)", row=1, col=i + 1)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(
        title=f"Activation patching, metric {metric} (clean = 1, corrupt = 0) — {result.model}"
        f"<br><sup>corruption: {result.corruption}; ME layer {result.site.layer}</sup>",
        template="plotly_white",
        height=max(350, 30 * len(labels) + 200),
    )
    return fig


def summary(result: Result | patching_pairs.PairsResult) -> str:
    if isinstance(result, patching_pairs.PairsResult):
        return patching_pairs.summary(result)
    s = result.site
    rows = []
    for name, sw in result.sweeps.items():
        for metric in sw.metric_names:
            grid = sw.normalized(metric)
            if sw.heads is None:
                grid = grid[:, sw.positions.index(s.position)]
            flat = int(grid.nan_to_num(-1e9).flatten().argmax())
            at = tuple(int(i) for i in np.unravel_index(flat, tuple(grid.shape)))
            v = float(grid[at])
            where = (
                str(sw.layers[at[0]])
                if sw.heads is None
                else patching_pairs.cell_label(sw, at, result.tokens)
            )
            rows.append(
                (name, metric, where, v, "overshoot" if v > OVERSHOOT else "", sw.n_forwards)
            )
    return "\n".join(
        [
            f"model: {result.model}   ME layer {s.layer} (1-based {s.layer + 1}), position "
            f"{s.position}; {len(result.me_ratio_clean)} prompts; corruption {result.corruption} "
            f"({result.corruption_note or 'chosen'}); {result.ffn.text()}",
            fmt_table(
                ["site", "metric", "largest at", "normalised (1 = clean)", "", "forwards"],
                rows,
            ),
            "sink heads: "
            + (
                patching_heads.details(result.sink_heads)
                if result.sink_heads is not None
                else str(result.sink_heads_why)
            ),
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
    specs_for=specs_for,
    key_figures=("patching_projection", "sink_heads"),
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
