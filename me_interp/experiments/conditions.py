"""Conditions: where the massive tokens are beyond the first token of short prompts.

The paper studies the first token of short prompts and warns against generalising "the massive token
is always the first token". This experiment scans **every position** of the prompts under each
condition (``probes.positions.scan_positions``, the Site's one detection rule): as they are; with and
without BOS; in the chat template (a system and a user turn); left-padded in one mixed-length batch
(with the mask); long (``long_rows`` inputs of each of ``long_tokens``, the prompts concatenated,
at most the model's window); packed (two prompts joined by EOS, and BOS where the model adds one), built by
``loading.layouts``; a condition with the rows of ``as_is`` reuses its forward. For every massive
token: position, token, birth layer, lifetime and eraser, dims and their overlap with the first
token's, cosine to the first token's state, sink share.

    python -m me_interp.experiments.conditions --long-tokens 1024 2048
    python -m me_interp.experiments.conditions --model synthetic:decoy-secondary
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from me_interp import claims, study
from me_interp.loading import layouts
from me_interp.plotting import counts_bar, heatmap_menu
from me_interp.probes.positions import Condition, scan_positions, state_differences
from me_interp.prompts import spread
from me_interp.study import CommonConfig, Experiment, RunHeader, checked
from me_interp.study.result import Headed
from me_interp.terminal import fmt_table

NAME = "conditions"
CONDITIONS = ("as_is", "bos", "no_bos", "chat", "left_pad", "long", "packed")


@dataclass(frozen=True)
class Config(CommonConfig):
    """Condition settings.

    Attributes:
        conditions: the conditions to run (as_is always runs: the others are compared with it).
        max_prompts: prompts per condition, spread over the prompt set (``None``: all).
        long_tokens: the lengths of the long inputs, each cut to the model's window (2048 too:
            about twice the default run's cost).
        long_rows: long inputs per length, input ``i`` opening with prompt ``i`` (each one more
            forward of that length; 13 can decide ``long_first`` at 0.75).
    """

    conditions: tuple[str, ...] = checked(
        CONDITIONS, choices=CONDITIONS, nonempty=True, unique=True
    )
    max_prompts: int | None = checked(8, ge=2)
    long_tokens: tuple[int, ...] = checked((1024,), ge=2, nonempty=True, unique=True)
    long_rows: int = checked(1, ge=1)


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
        labels = [f"prompt {u[0]}" for u in c.units]
        return claims.Outcomes(yes, labels, unit="massive-token prefixes")

    def _secondaries(self, ok) -> claims.Outcomes:
        """``ok(t)`` for every secondary massive token ``t`` (after the first token, as it is)."""
        s = [t for t in self.condition("as_is").tokens if t.position > 0]
        if not s:
            raise claims.NotApplicable("no secondary massive token (only the first is massive)")
        return claims.Outcomes([ok(t) for t in s], [f"prompt {t.row} pos {t.position}" for t in s])

    def shares(self) -> claims.Outcomes:
        first = {t.row: t.birth for t in self.condition("as_is").tokens if t.position == 0}
        return self._secondaries(lambda t: t.overlap >= 0.5 and first.get(t.row) == t.birth)

    def sinks(self) -> claims.Outcomes:
        return self._secondaries(lambda t: t.sink >= claims.threshold("sink_attention"))

    def chat_first(self) -> claims.Outcomes:
        """Per chat prompt: are its massive positions at the Site's layer exactly position 0?"""
        c = next((c for c in self.conditions if c.name == "chat"), None)
        if c is None or not c.n_rows:
            raise claims.NotApplicable(c.note if c else "no chat condition")
        if c.layer is None:
            raise claims.NotApplicable("no massive activation under the chat template")
        labels = [f"chat prompt {b}" for b in range(c.n_rows)]
        return claims.Outcomes([p == [0] for p in c.positions], labels, unit="chat prompts")

    def long_first(self) -> claims.Outcomes:
        """Per long input of the longest length: is its first token massive at the Site's layer?"""
        longs = [c for c in self.conditions if c.name.startswith("long_") and c.n_rows]
        if not longs or 0 not in {p for r in self.condition("as_is").positions for p in r}:
            why = "no long condition" if not longs else "the first token is not massive as it is"
            raise claims.NotApplicable(why)
        c = max(longs, key=lambda c: int(c.name.removeprefix("long_")))
        yes = [0 in p for p in c.positions]  # all False where the Site finds nothing massive
        return claims.Outcomes(yes, [f"{c.name} input {b}" for b in range(c.n_rows)], "long inputs")

    def padding(self) -> claims.Sample:
        if not self.padding_diffs:
            raise claims.NotApplicable("no left-padded condition (or no massive activation)")
        return claims.Sample(np.array(self.padding_diffs), statistic=lambda a: float(np.max(a)))


def run(cfg: Config, model=None, site: None = None) -> Result:
    """Scan every position under each condition (see the module docstring). No Site is given
    (``site`` is None): each layout locates its own (``probes.positions.scan_positions``)."""
    model = study.model_for(cfg, model)
    prompts = spread(cfg.load_prompts(), cfg.max_prompts or 0)
    out, scans = [], {}
    explicit = set(cfg.conditions) != set(CONDITIONS)
    args = (cfg.conditions, prompts, cfg.long_tokens, cfg.long_rows, explicit)
    for name, rows, note in layouts.condition_rows(model, *args):
        left = name == "left_pad"
        if not rows:
            out.append(Condition(name, note, 0, None, [], [], [], []))
            continue
        if note != layouts.SAME:  # else as_is's forward, not run twice
            batch = model.batch_from_ids(rows, side="left" if left else "right")
            scans[name] = scan_positions(model, batch)
            if name == "as_is":  # no massive activation: nothing to follow (one reason)
                scans[name].site.require(hint="")
        out.append(Condition.of(name, note, scans.get(name, scans["as_is"]), rows, left))
    diffs = state_differences(scans["as_is"], scans["left_pad"]) if "left_pad" in scans else []
    return Result(study.run_header(cfg, model, len(prompts), scans["as_is"].site), out, diffs)


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
    claims.Spec(
        f"{NAME}.chat_first",
        "paper's limitations (chat-template system tokens)",
        "Under the chat template the massive token is the template's first token",
        "fraction of the chat prompts (system + user turn) whose massive positions at the Site's "
        "layer are exactly the first token (its state is one, shared; the prompts differ after it)",
        ">=",
        "first_token",
        "the template's first token ordinary, the delimiter of the user turn massive (decoy-later)",
        stat=lambda r: r.chat_first(),
        unit="chat prompts",
    ),
    claims.Spec(
        f"{NAME}.long_first",
        "paper's limitations (long context)",
        "At the longest length run (2,048 tokens, cut to the model's window) the first token is "
        "still massive",
        "fraction of the long inputs of the longest length whose first token is massive at the "
        "Site's layer on them (--long-rows inputs, each opening with another prompt)",
        ">=",
        "first_token",
        "other tokens that grow with length until the first is not 1,000× the median "
        "(planted-washout)",
        stat=lambda r: r.long_first(),
        unit="long inputs",
    ),
)
claims.check_specs(SPECS)


def figures(result: Result) -> dict[str, go.Figure]:
    panels = {}  # log10 ratio [layer pos]; the pads greyed: NaN columns before the real tokens
    for c in (c for c in result.conditions if c.ratios):
        panels[c.name] = np.hstack([np.full((len(c.ratios), c.pads), np.nan), np.log10(c.ratios)])
    counts = Counter(repr(t.text) for c in result.conditions for t in c.tokens if t.position > 0)
    title = f"Norm over median norm, positions × layers, first row — {result.model}"
    ratios = heatmap_menu(panels, title, "index (pads greyed)", "layer", "log10 ratio")
    title = f"Secondary massive tokens by token, all conditions — {result.model}"
    tokens = counts_bar(dict(counts.most_common(20)), title, "token", "massive occurrences")
    return {"ratios": ratios, "secondary_tokens": tokens}


def summary(result: Result) -> str:
    rows = []
    for c in result.conditions:
        sec = [t for t in c.tokens if t.position > 0]
        top = ", ".join(f"{k}×{n}" for k, n in Counter(repr(t.text) for t in sec).most_common(3))
        at0 = sum(t.position == 0 for t in c.tokens)
        rows.append([c.name, c.n_rows, c.layer, at0, len(sec), top or "-", c.note])
    head = ["condition", "rows", "layer", "massive at 0", "secondary", "commonest", "note"]
    return fmt_table(head, [["-" if v is None else v for v in r] for r in rows])


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("ratios",)
)
main = study.command(EXPERIMENT)

if __name__ == "__main__":
    raise SystemExit(main())
