"""Activation patching of the massive activation: what writes it, what carries it, what it causes.

Clean run: the prompts (cut to ``--max-tokens``); corrupt run (``--corruption``,
:mod:`me_interp.patching.corrupt`): one in which the massive activation never forms. Each site of
``--sites`` is patched from the clean run at the massive position ``p``, every layer
(:func:`me_interp.patching.patch_sweep`; every position too with ``--all-positions``). Metrics per
prompt: ``projection``, the *signed* ``⟨h_p, u⟩`` at ``--metric-layer`` onto the clean massive
direction ``u`` (a late FFN that erases the activation inflates ``‖h_p‖`` but lowers the projection),
and ``sink``, the mean attention to ``p`` after the ME layer. A patch's value is normalised on prompt
means (clean = 1, corrupt = 0); above 1 is an overshoot, not a restore. No claim is decided by a cell
the corruption overwrote. The sink-heads question: :mod:`me_interp.experiments.patching_heads`; your
own pairs (``--pairs``, no claims): :mod:`me_interp.experiments.patching_pairs`.

    python -m me_interp.experiments.activation_patching
    python -m me_interp.experiments.activation_patching --model synthetic:planted --prompts p.txt
    python -m me_interp.experiments.activation_patching --pairs ioi.jsonl --metric logit_diff
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, names, plotting
from me_interp.experiments import patching_heads, patching_pairs
from me_interp.loading.loaded import LoadedModel
from me_interp.patching import (
    HEAD_SITES,
    PATCH_SITES,
    PatchMetric,
    Projection,
    SinkMass,
    patch_sweep,
)
from me_interp.patching.cells import (
    OVERSHOOT,
    Cells,
    cells_sample,
    cells_text,
    columns,
    restore_stat,
)
from me_interp.patching.corrupt import corrupt, undo_cell
from me_interp.patching.pairs import Pair, PairsLike, as_pairs
from me_interp.patching.sinkheads import SinkHeads
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record
from me_interp.probes.ffn import HasFfnShare, ffn_share
from me_interp.probes.site import Site
from me_interp.study import (
    CommonConfig,
    Experiment,
    Headed,
    RunHeader,
    checked,
    command,
    prepare,
    run_header,
)
from me_interp.terminal import fmt_table

NAME = "activation_patching"
FFN_SITES = ("mlp_out", "ffn_out")
PROJECTION = "projection"
RESTORE = "normalised {metric} (clean = 1, corrupt = 0; ratio of prompt means; above 1: overshoot)"
_PROJ = "signed projection ⟨h_p, u⟩ at the metric layer onto the clean massive direction u"
SUBLAYERS = ("attn_out", "mlp_out")
HEADLINE = (("ffn_writes", PROJECTION), ("state_causes_sink", "sink"))
Cell = tuple[str, int, int]
"""A patched cell: (site, layer, position)."""


@dataclass(frozen=True)
class Result(Headed, HasFfnShare):
    """The clean/corrupt pair, the sweeps, and what the claims need to know about the FFN output
    (``header.layer``: the ME layer; ``header.position``: the massive position ``p``).

    Attributes:
        massive_why: why there is no massive activation at the layer (``None``: there is).
        prompt_indices: the prompts used (indices in the prompt list); ``max_tokens``: their cut.
        undo_cell: the (site, layer, position) the corruption overwrote.
        me_ratio_clean, me_ratio_corrupt: per prompt ``R = ‖h_p‖ / median_{t≠p} ‖h_t‖`` (ME layer).
        sweeps: one per patched site.
        ffn_cos, ffn_norm_ratio: per prompt, the ME layer's FFN output at ``p`` against the state
            there (clean run; :attr:`ffn`).
        direction_cos: mean cosine of the clean state of ``p`` at the metric layer with ``u``.
        sink_heads: the sink-heads measurement (``sink_heads_why``: why it is absent).
    """

    header: RunHeader
    massive_why: str | None
    prompt_indices: list[int]
    max_tokens: int
    corruption: str
    corruption_note: str
    undo_cell: Cell
    n_layers: int
    metric_layer: int
    me_ratio_clean: list[float]
    me_ratio_corrupt: list[float]
    sweeps: list[Cells]
    tokens: list[str]
    ffn_cos: list[float]
    ffn_norm_ratio: list[float]
    direction_cos: float
    sink_heads: SinkHeads | None = None
    sink_heads_why: str | None = None

    def cell_rows(self, cells: Sequence[Cell], metric: str) -> np.ndarray | None:
        """Per prompt ``[clean, corrupt, patched at each (site, layer, position) cell]``; ``None``
        when a cell was not swept or the metric was not read."""
        return columns(self.sweeps, cells, metric, aliases=(FFN_SITES,))

    def restore(self, cell: Cell, metric: str = PROJECTION) -> float:
        """Point estimate of the normalised value of one cell (NaN when not swept)."""
        rows = self.cell_rows([cell], metric)
        return float("nan") if rows is None else restore_stat(rows)

    def cells(self, key: str) -> list[Cell]:
        """The cells claim ``key`` is decided by (``undo``: the overwritten one)."""
        L, p = self.layer, self.header.position
        if key == "not_rewritten":  # attn_out and mlp_out at p, after L and before the metric layer
            return [(s, la, p) for la in range(L + 1, self.metric_layer) for s in SUBLAYERS]
        return [
            {
                "undo": self.undo_cell,
                "ffn_writes": ("mlp_out", L, p),
                "state_causes_sink": ("resid_pre", L + 1, p),
            }[key]
        ]

    def removal_fraction(self) -> float:
        return claims.excess_fraction(np.mean(self.me_ratio_corrupt), np.mean(self.me_ratio_clean))

    def __repr__(self) -> str:
        got = ", ".join(f"{k} {self.restore(self.cells(k)[0], m):.3g}" for k, m in HEADLINE)
        sh = self.sink_heads
        heads = "" if sh is None else f", sink heads restore {sh.restore(sh.kl_top):.3g}"
        return (
            f"activation_patching.Result({self.model}, ME layer {self.layer}, p = "
            f"{self.header.position}, {self.n_prompts} prompts, corruption {self.corruption}, "
            f"removal {self.removal_fraction():.3g}; {got}{heads})"
        )


def _why_removed(r: Result) -> str | None:
    """Why the patching claims do not apply: no massive activation, or the corruption did not remove
    it (the ``removed`` rule on the point estimate: there is nothing for a patch to restore)."""
    why = r.massive_why
    if why is None and not r.removal_fraction() <= claims.threshold("removed"):
        why = (
            f"the corruption ({r.corruption}) did not remove the massive activation (ME-layer "
            f"(R − 1) corrupt / clean = {r.removal_fraction():.3g} > "
            f"{claims.threshold('removed'):g}, threshold 'removed'): there is nothing for a patch "
            "to restore"
        )
    return why


def _why_ffn(r: Result, *, state: bool) -> str | None:
    """``ffn_writes`` applies where the FFN output is not the state, ``ffn_is_state`` (``state``)
    where it is; neither where the corruption overwrote it or the metric is read before it."""
    if why := _why_removed(r):
        return why
    if r.corruption == "remove_ffn":
        return (
            "the remove_ffn corruption overwrote this very cell: its restore is the 'undo' sanity "
            "check (use --corruption remove_input or first_token)"
        )
    if r.metric_layer < r.layer:
        return (
            f"the metric layer {r.metric_layer} is before the ME layer {r.layer}: nothing to change"
        )
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
    if why is None and r.layer + 1 >= r.n_layers:
        why = f"the ME layer {r.layer} is the last layer: no later layer, no downstream sink"
    return why


def _why_later(r: Result) -> str | None:
    why = _why_sink(r)
    if why is None and r.metric_layer <= r.layer + 1:
        why = (
            f"no layer lies between the ME layer {r.layer} and the metric layer "
            f"{r.metric_layer}: no later sub-layer can be patched without writing into the measured "
            "cell itself"
        )
    return why


def _cells_stat(key: str, metric: str):
    """The statistic of a claim decided by the cells ``Result.cells(key)`` (:func:`cells_sample`)."""
    return lambda r: cells_sample(r.cell_rows(r.cells(key), metric), r.cells(key), metric)


def _details(key: str, metric: str):
    def details(r: Result) -> str:
        out = (
            f"corruption {r.corruption}; ME layer {r.layer} (1-based {r.layer + 1}), position "
            f"{r.header.position}; metric layer {r.metric_layer}; n = {len(r.me_ratio_clean)} "
            f"prompts of <= {r.max_tokens} tokens"
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
        return out + cells_text(m, r.cells(key))

    return details


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
        applies=lambda r: r.massive_why,
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
        massive_state=True,  # the projection at p: a function of p's prefix
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
        massive_state=True,  # the projection at p: a function of p's prefix
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
        massive_state=True,  # the projection at p: a function of p's prefix
        applies=_why_later,
        details=_details("not_rewritten", PROJECTION),
    ),
    *patching_heads.specs(NAME, restore_stat, _why_removed),
)


@dataclass(frozen=True)
class Config(CommonConfig):
    """Activation-patching settings.

    Attributes:
        sites: sites to patch, each over every layer (``mlp_out``: the FFN output); a claim whose
            site (``resid_pre``, ``attn_out``, ``mlp_out``) is not swept is not applicable.
        corruption: ``first_token``, ``remove_input``, ``remove_ffn`` or ``auto`` (``first_token``
            when it removes the massive activation, else ``remove_input``).
        max_tokens: prompts are cut to their first ``max_tokens`` tokens (>= 2).
        max_prompts: how many prompts to use, spread evenly over the prompt list (``None``: all);
            each patched cell costs a forward of them from its layer on.
        all_positions: sweep every position and layer of every site (heat maps; ``max_tokens``
            times the cost) instead of the massive position.
        metric_layer: layer (0-based) whose output gives the projection; ``None`` = the last.
        layer: the ME layer (0-based); ``None`` = detected on the prompts.
        batch_size: rows (patched prompts) per forward of the sweep.
        pairs: a JSONL file of your own pairs (``{"clean", "corrupt", "answer", "wrong"}`` a line;
            from Python also a list of such dicts or of ``(clean, corrupt[, answer, wrong])``
            tuples): patch them instead of asking the built-in question (no claims; see
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
        n_random: draws of as many random non-sink heads of the same layers (the control; at least
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
    pairs: str | tuple[Pair, ...] | None = None
    metric: str | None = checked(None, choices=patching_pairs.METRICS)
    heads: tuple[int, ...] | None = checked(None, ge=0)
    head_positions: Literal["all", "each"] = "all"
    method: Literal["exact", "attribution", "both"] = "exact"
    n_sink_heads: int | None = checked(None, ge=1)
    n_random: int = checked(10, ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pairs is not None:  # missing, not UTF-8, malformed: said before the model loads
            pairs = as_pairs(self.pairs)
            if not isinstance(self.pairs, str):
                object.__setattr__(self, "pairs", tuple(pairs))
        elif self.metric is not None:
            raise ValueError("metric applies only with pairs (the built-in question has its own)")
        if self.method != "exact" and self.pairs is None:
            raise ValueError(
                "method applies only with pairs (the built-in claims use exact patching)"
            )


def specs_for(result: Result | patching_pairs.PairsResult) -> tuple[claims.Spec, ...]:
    """The claims judged on ``result``: none for a run on the user's own pairs."""
    return () if isinstance(result, patching_pairs.PairsResult) else SPECS


def patch_pairs(model: LoadedModel, pairs: PairsLike, **config: Any) -> patching_pairs.PairsResult:
    """Patch your own ``pairs`` on ``model``: a JSONL path, or a list of ``(clean, corrupt[, answer,
    wrong])`` tuples or of dicts ``{"clean", "corrupt", "answer", "wrong"}``; ``config``: fields of
    :class:`Config` (``metric="logit_diff"``, ``sites``, ``method``, ``seed``, ...)."""
    cfg = Config(model=model.name, pairs=tuple(as_pairs(pairs)), **config)
    return run(cfg, model)  # type: ignore[return-value]  # a run on pairs


def run(
    cfg: Config, model: LoadedModel | None = None, site: Site | None = None
) -> Result | patching_pairs.PairsResult:
    """Build the clean/corrupt pair and sweep every site (with ``cfg.pairs``: the user's pairs,
    :func:`me_interp.experiments.patching_pairs.run`). No printing, no files.

    Raises:
        claims.NotApplicable: no massive activation on this model and no ``layer`` given.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    if cfg.pairs is not None:
        return patching_pairs.run(cfg, model, site)
    site.require("pass --layer to intervene anyway")
    p, L = site.position, site.layer
    pb = site.inputs.at_least(p + 2)  # a query after the massive token
    clean = pb.batch
    last = model.n_layers - 1
    metric_layer = last if cfg.metric_layer is None else model.check_layer(cfg.metric_layer)
    acts = Activations(
        model, clean, [names.ffn_out(L), names.resid_post(L), names.resid_post(metric_layer)]
    )
    record(model, clean, [acts], last_layer=acts.last_layer, max_tokens=None)
    u = acts[names.resid_post(L)][:, p].float().cpu().mean(0)  # [d]
    u = u / u.norm()  # the clean massive direction
    h_metric = acts[names.resid_post(metric_layer)][:, p].float().cpu()  # [B d]
    direction_cos = float(torch.nn.functional.cosine_similarity(h_metric, u[None], dim=-1).mean())
    metrics: dict[str, PatchMetric] = {PROJECTION: Projection(metric_layer, u, p)}
    if L < last:
        metrics["sink"] = SinkMass(tuple(range(L + 1, model.n_layers)), p)

    cx = corrupt(model, clean, cfg.corruption, L, p)
    corruption, hooks = cx.corruption, cx.hooks
    undo = undo_cell(corruption, L, p)
    positions = list(range(clean.tokens.shape[1])) if cfg.all_positions else sorted({p, undo[2]})
    # after the ME layer, patching the massive token's whole residual state restores it trivially
    # (for p = 0 by causal attention): resid_pre is swept up to the layer after the ME layer
    short = list(range(min(L + 2, model.n_layers)))
    sweeps = []
    for s in cfg.sites:
        each = s not in HEAD_SITES or cfg.head_positions == "each"
        sw = patch_sweep(
            model,
            clean,
            cx.batch,
            s,
            metrics,
            layers=short if s == "resid_pre" and not cfg.all_positions else None,
            positions=positions if each else None,
            batch_size=cfg.batch_size,
            corrupt_hooks=hooks,
            heads=cfg.heads if s in HEAD_SITES else None,
            per_position=each,
        )
        sweeps.append(Cells.of(sw))
    heads, heads_why = patching_heads.measured(cfg, model, clean, cx, L, p)
    ffn = ffn_share(model, clean, L, p, acts=acts)
    return Result(
        header=run_header(cfg, model, len(clean), site),
        massive_why=None if site.massive else site.why_not,
        prompt_indices=list(pb.indices),
        max_tokens=pb.max_tokens,
        corruption=corruption,
        corruption_note=cx.note,
        undo_cell=undo,
        n_layers=model.n_layers,
        metric_layer=metric_layer,
        me_ratio_clean=cx.ratio_clean.tolist(),
        me_ratio_corrupt=cx.ratio_corrupt.tolist(),
        sweeps=sweeps,
        tokens=model.token_texts(clean),
        ffn_cos=list(ffn.cos),
        ffn_norm_ratio=list(ffn.norm_ratio),
        direction_cos=direction_cos,
        sink_heads=heads,
        sink_heads_why=heads_why,
    )


def figures(result: Result | patching_pairs.PairsResult) -> dict[str, go.Figure]:
    if isinstance(result, patching_pairs.PairsResult):
        return patching_pairs.figures(result)
    figs: dict[str, go.Figure] = {}
    p, L = result.header.position, result.layer
    sub = f"{result.model}<br><sup>corruption: {result.corruption}; ME layer {L}</sup>"
    for metric in result.sweeps[0].metric_names:
        lines = {
            c.site: c.normalized(metric)[:, c.positions.index(p)].tolist()
            for c in result.sweeps
            if c.heads is None
        }
        figs[f"patching_{metric}"] = plotting.layer_lines(
            lines,
            f"Activation patching at position {p}, metric {metric} (clean = 1, corrupt = 0) — {sub}",
            "normalised (clean = 1, corrupt = 0)",
            L,
        )
        for c in result.sweeps:  # the per-head sweeps, and every position with --all-positions
            if c.heads is not None or len(c.positions) > 2:
                figs[f"patching_{metric}_{c.site}"] = plotting.cells_heatmap(
                    c,
                    c.normalized(metric),
                    result.tokens,
                    f"Activation patching of {c.site}, metric {metric} (clean = 1, corrupt = 0) "
                    f"— {sub}",
                )
    if result.sink_heads is not None:
        figs["sink_heads"] = plotting.sink_heads(result.sink_heads, sub)
    return figs


def summary(result: Result | patching_pairs.PairsResult) -> str:
    if isinstance(result, patching_pairs.PairsResult):
        return patching_pairs.summary(result)
    rows = []
    for c, metric in ((sw, m) for sw in result.sweeps for m in sw.metric_names):
        v, top = c.largest(metric, result.tokens, result.header.position)  # at the massive p
        rows.append((c.site, metric, top, v, "overshoot" if v > OVERSHOOT else "", c.n_forwards))
    heads = result.sink_heads.details() if result.sink_heads else str(result.sink_heads_why)
    return "\n".join(
        [
            f"model: {result.model}   ME layer {result.layer} (1-based {result.layer + 1}), "
            f"position {result.header.position}; {result.n_prompts} prompts; corruption "
            f"{result.corruption} ({result.corruption_note or 'chosen'}); {result.ffn.text()}",
            fmt_table(
                ["site", "metric", "largest at", "normalised (1 = clean)", "", "forwards"], rows
            ),
            f"sink heads: {heads}",
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
    result_type=Result,  # a --pairs run: io.read_result(patching_pairs.PairsResult, run_dir)
    inputs=patching_pairs.inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
