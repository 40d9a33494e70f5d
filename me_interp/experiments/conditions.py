"""Conditions: where the massive tokens are beyond the first token of short prompts.

The paper studies the first token of short prompts and warns against generalising "the massive token
is always the first token". This experiment scans **every position** of the prompts under each
condition (``probes.positions.scan_positions``, the Site's one detection rule): as they are; with and
without BOS; in the tokenizer's chat template (a system and a user turn); left-padded in one
mixed-length batch (with the attention mask); long (the prompts concatenated to each of
``long_tokens``, at most the model's window); packed (two prompts joined by EOS, and BOS where the
model adds one). For every massive token: position, token, birth layer, lifetime and eraser, dims
and their overlap with the first token's, cosine to the first token's state, sink share.

    python -m me_interp.experiments.conditions
    python -m me_interp.experiments.conditions --model synthetic:decoy-secondary
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from me_interp import claims
from me_interp.loading import layouts
from me_interp.probes.positions import MassiveToken, scan_positions
from me_interp.prompts import spread
from me_interp.study import (
    CommonConfig,
    Experiment,
    RunHeader,
    checked,
    command,
    model_for,
    run_header,
)
from me_interp.study.result import Headed
from me_interp.terminal import fmt_table

NAME = "conditions"
CONDITIONS = ("as_is", "bos", "no_bos", "chat", "left_pad", "long", "packed")


@dataclass(frozen=True)
class Config(CommonConfig):
    """Condition settings.

    Attributes:
        conditions: the conditions to run (as_is always runs: the others are compared with it).
        max_prompts: prompts per condition, spread over the prompt set (0: all).
        long_tokens: the lengths of the long inputs (each cut to the model's window).
    """

    conditions: tuple[str, ...] = checked(
        CONDITIONS, choices=CONDITIONS, nonempty=True, unique=True
    )
    max_prompts: int = checked(8, ge=2, also=(0,))
    long_tokens: tuple[int, ...] = checked((1024, 2048), ge=2, nonempty=True, unique=True)


@dataclass(frozen=True)
class Condition:
    """One condition's massive tokens (positions from each row's first real token).

    Attributes:
        name: the condition (``long`` is ``long_<n>``); note: why it was skipped, or a remark.
        n_rows: its rows; layer: the Site's layer on them (``None``: no massive activation).
        positions: per row, the massive positions at that layer; units: the distinct prefixes.
        tokens: every massive token at any layer (:class:`MassiveToken`).
        ratios: row 0's norm over the median norm, per layer and position (for the figure);
        pads: row 0's pads (left padding).
    """

    name: str
    note: str
    n_rows: int
    layer: int | None
    positions: list[list[int]]
    units: list[list[int]]
    tokens: list[MassiveToken]
    ratios: list[list[float]]
    pads: int = 0


@dataclass(frozen=True)
class Result(Headed):
    """What :func:`run` found; ``padding_diffs``: per row, ``‖h_pad − h‖ / ‖h‖`` of its massive
    token's state at the Site's layer, left-padded against as it is."""

    header: RunHeader
    conditions: list[Condition]
    padding_diffs: list[float]

    def condition(self, name: str) -> Condition:
        return next(c for c in self.conditions if c.name == name)

    def first_only(self) -> claims.Outcomes:
        """Per distinct massive-token prefix (as it is): are its massive tokens, at every layer,
        only the first token?"""
        c = self.condition("as_is")
        at = {(t.row, t.position) for t in c.tokens}
        yes = [all({p for r, p in at if r == b} <= {0} for b in u) for u in c.units]
        return claims.Outcomes(
            yes, [f"prompt {u[0]}" for u in c.units], unit="massive-token prefixes"
        )

    def secondaries(self) -> list[MassiveToken]:
        found = [t for t in self.condition("as_is").tokens if t.position > 0]
        if not found:
            raise claims.NotApplicable(
                "no secondary massive token (only the first token is massive)"
            )
        return found

    def shares(self) -> claims.Outcomes:
        first = {t.row: t.birth for t in self.condition("as_is").tokens if t.position == 0}
        s = self.secondaries()
        yes = [t.overlap >= 0.5 and first.get(t.row) == t.birth for t in s]
        return claims.Outcomes(yes, [f"prompt {t.row} pos {t.position}" for t in s])

    def sinks(self) -> claims.Outcomes:
        s = self.secondaries()
        yes = [t.sink >= claims.threshold("sink_attention") for t in s]
        return claims.Outcomes(yes, [f"prompt {t.row} pos {t.position}" for t in s])

    def padding(self) -> claims.Sample:
        if not self.padding_diffs:
            raise claims.NotApplicable("no left-padded condition (or no massive activation)")
        return claims.Sample(np.array(self.padding_diffs), statistic=lambda a: float(np.max(a)))


def _rows(model, name: str, prompts, n_long: int) -> tuple[list[list[int]], str]:
    """The token rows of one condition and a note (rows ``[]``: skipped, the note says why)."""
    batch = model.tokenize(prompts)
    base = [batch.tokens[i, :n].tolist() for i, n in enumerate(batch.lengths)]
    try:
        if name in ("as_is", "left_pad"):
            return base, ""
        if name in ("bos", "no_bos"):
            return layouts.bos_rows(model, base, name == "bos"), ""
        if name == "chat":
            return layouts.chat_rows(model, prompts), ""
        if name == "packed":
            return layouts.packed_rows(model, prompts), ""
        window = getattr(model.hf.config, "sliding_window", None)
        note = (
            f"beyond the sliding window ({window}) of the local layers"
            if window and n_long > window
            else ""
        )
        return [layouts.long_row(model, prompts, n_long)], note
    except ValueError as e:
        return [], f"skipped: {e}"


def run(cfg: Config, model=None) -> Result:
    """Scan every position under each condition (see the module docstring)."""
    model = model_for(cfg, model)
    prompts = spread(cfg.load_prompts(), cfg.max_prompts)
    limit = model.context_length or max(cfg.long_tokens)
    longs = sorted({min(n, limit) for n in cfg.long_tokens})
    names = [n for n in dict.fromkeys(("as_is", *cfg.conditions)) if n != "long"]
    jobs = [(n, 0) for n in names] + [(f"long_{k}", k) for k in longs if "long" in cfg.conditions]
    out, scans = [], {}
    for name, k in jobs:
        rows, note = _rows(model, name.split("_")[0] if k else name, prompts, k)
        if not rows:
            out.append(Condition(name, note, 0, None, [], [], [], []))
            continue
        batch = model.batch_from_ids(rows, side="left" if name == "left_pad" else "right")
        scans[name] = s = scan_positions(model, batch)
        out.append(
            Condition(
                name,
                note,
                len(rows),
                s.site.layer,
                [list(p) for p in s.site.positions],
                [list(g) for g in s.site.units.groups],
                s.tokens,
                s.ratios(0).tolist(),
                batch.starts[0],
            )
        )
    site = scans["as_is"].site
    diffs = []
    if "left_pad" in scans and site.layer is not None:
        pad = scans["left_pad"]
        for b, r in enumerate(site.reference):
            h, hp = (
                scans["as_is"].states.state(site.layer, b, r),
                pad.states.state(site.layer, b, r),
            )
            if h is not None and hp is not None:
                diffs.append(float((hp - h).norm() / h.norm()))
    return Result(run_header(cfg, model, len(prompts), site), out, diffs)


SPECS = (
    claims.Spec(
        f"{NAME}.first_only",
        "paper's limitations (the first token)",
        "Massive activations occur only at the first token of the prompts as they are",
        "fraction of distinct massive-token prefixes whose massive tokens, at every layer and "
        "position, are only the first token",
        ">=",
        "first_token",
        "the same count on a model with a second massive token at a delimiter (decoy-secondary)",
        stat=lambda r: r.first_only(),
        unit="massive-token prefixes",
    ),
    claims.Spec(
        f"{NAME}.padding_invariant",
        "batched inference (left padding)",
        "Left padding leaves the massive token's state unchanged",
        "largest relative difference of the massive token's state at the Site's layer, "
        "left-padded in a mixed-length batch against the prompts as they are",
        "<=",
        "padding_equivalence",
        "none: with the mask, true by construction of causal attention; it checks that the probes "
        "follow the real tokens",
        kind="sanity",
        stat=lambda r: r.padding(),
    ),
    claims.Spec(
        f"{NAME}.secondary_shares",
        "Sun et al. 2024 (massive '.' and '\\n'); secondary attention sinks",
        "Secondary massive tokens share the first token's massive dims and birth layer",
        "fraction of secondary massive tokens with at least half their dims among the first "
        "token's and the same birth layer",
        ">=",
        "secondary_share",
        "a secondary massive token born at the embedding on another dim (decoy-secondary-apart)",
        stat=lambda r: r.shares(),
        unit="secondary massive tokens",
    ),
    claims.Spec(
        f"{NAME}.secondary_sink",
        "secondary attention sinks (2025)",
        "Secondary massive tokens draw an attention sink",
        "fraction of secondary massive tokens whose largest head's mean attention from the "
        "queries after them, after their birth, reaches the sink_attention threshold",
        ">=",
        "secondary_share",
        "a secondary massive token off the dim the sink heads read (decoy-secondary-apart)",
        stat=lambda r: r.sinks(),
        unit="secondary massive tokens",
    ),
)
claims.check_specs(SPECS)


def figures(result: Result) -> dict[str, go.Figure]:
    shown = [c for c in result.conditions if c.ratios]
    figs = {}
    heat = go.Figure()
    for i, c in enumerate(shown):
        z = np.log10(np.array(c.ratios))
        if c.pads:  # the pads, greyed: NaN columns before the real tokens
            z = np.concatenate([np.full((z.shape[0], c.pads), np.nan), z], axis=1)
        heat.add_trace(go.Heatmap(z=z, visible=i == 0, colorbar={"title": "log10 ratio"}))
    heat.update_layout(
        title=f"Norm over median norm, positions × layers, first row — {result.model}",
        xaxis_title="index (pads greyed)",
        yaxis_title="layer",
        template="plotly_white",
        plot_bgcolor="lightgrey",
        updatemenus=[
            {
                "buttons": [
                    {
                        "label": c.name,
                        "method": "update",
                        "args": [{"visible": [j == i for j in range(len(shown))]}],
                    }
                    for i, c in enumerate(shown)
                ]
            }
        ],
    )
    figs["ratios"] = heat
    counts = Counter(repr(t.text) for c in result.conditions for t in c.tokens if t.position > 0)
    top = counts.most_common(20)
    bar = go.Figure(go.Bar(x=[t for t, _ in top], y=[n for _, n in top]))
    bar.update_layout(
        title=f"Secondary massive tokens by token, all conditions — {result.model}",
        xaxis_title="token",
        yaxis_title="massive occurrences",
        template="plotly_white",
    )
    figs["secondary_tokens"] = bar
    return figs


def summary(result: Result) -> str:
    rows = []
    for c in result.conditions:
        sec = [t for t in c.tokens if t.position > 0]
        toks = Counter(repr(t.text) for t in sec).most_common(3)
        rows.append(
            [
                c.name,
                c.n_rows,
                "-" if c.layer is None else c.layer,
                sum(t.position == 0 for t in c.tokens),
                len(sec),
                ", ".join(f"{k}×{n}" for k, n in toks) or "-",
                c.note or "",
            ]
        )
    head = ["condition", "rows", "layer", "massive at 0", "secondary", "commonest", "note"]
    return fmt_table(head, rows)


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("ratios",), result_type=Result
)
main = command(EXPERIMENT)

if __name__ == "__main__":
    raise SystemExit(main())
