"""Which constructed model makes each claim hold, and which makes it fail.

A verdict is evidence only if it could have come out the other way. For every claim the battery can
state, this module runs the battery on the constructed models of :data:`CONSTRUCTED` (the planted
model, its unplanted twin, a random model and the decoys of :mod:`me_interp.synthetic`, each built to
make the mechanism or to make it the wrong way) and records on which models the claim *holds* and on
which it *fails*. A claim of kind ``claim`` must do both (a test enforces it); one that cannot is a
control or a sanity check and is labelled so. The WeMask experiment measures perplexity and MC
accuracy: every constructed battery runs it on texts and items in the word vocabulary (:func:`synthetic.word_texts`, :func:`synthetic.word_mc_items`,
written to the battery's root; :func:`overrides`), which the ``planted-needsink`` models predict. The
table is written to :data:`TABLE_FILE`
(``docs/falsifiability.json``), from which ``docs/claims.md`` gets its "holds on / fails on" columns.

    python -m me_interp.falsifiability          # re-run the batteries, rewrite docs/falsifiability.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from me_interp import claims, synthetic
from me_interp.battery import EXPERIMENTS, NAMES, run_battery
from me_interp.report import FINISHED, md_cell
from me_interp.study import CommonConfig, Experiment

N_PROMPTS = 16
"""Prompts per constructed battery."""
PROMPT_LENGTH = 10
TABLE_FILE = Path(__file__).resolve().parents[1] / "docs" / "falsifiability.json"

SHARED_BOS, DISTINCT_FIRST = "shared BOS", "distinct first tokens"
"""The two prompt sets: :func:`synthetic.planted_prompts` (every prompt starts with ``<s>``) and
:func:`synthetic.distinct_first_prompts` (no BOS; each prompt opens with another word, so token 0 is a
distinct measurement in every prompt)."""

CONSTRUCTED: dict[str, tuple[str, str]] = {
    "synthetic:planted": ("the mechanism as the paper describes it (layer 2 of 5)", SHARED_BOS),
    "synthetic:twin": ("the planted weights without the boosted gains and neuron", SHARED_BOS),
    "synthetic:tiny-llama": ("a random tiny Llama: no massive activation", SHARED_BOS),
    "synthetic:planted-deep": ("the mechanism at layer 2 of 8 (7 swap partners)", SHARED_BOS),
    "synthetic:twin-deep": ("the unplanted twin of planted-deep", SHARED_BOS),
    "synthetic:planted-deep-late": ("the mechanism at layer 6 of 8 (6 earlier layers)", SHARED_BOS),
    "synthetic:planted-nobos": ("the mechanism, token 0 distinct in every prompt", DISTINCT_FIRST),
    "synthetic:twin-nobos": ("the unplanted twin of planted-nobos", DISTINCT_FIRST),
}
CONSTRUCTED.update(
    {f"synthetic:{name}": ("planted, with a language model that needs its sink (WeMask)", SHARED_BOS)
     for name in synthetic.NEEDSINK}
)  # fmt: skip
CONSTRUCTED.update(
    {f"synthetic:decoy-{kind}": (what, DISTINCT_FIRST) for kind, what in synthetic.DECOYS.items()}
)
"""The constructed models: name: (what it is built to show, its prompt set). Every decoy of
:data:`me_interp.synthetic.DECOYS` (a massive activation, or a sink, made the wrong way) is one."""
CONSTRUCTED.update(
    {f"synthetic:{name}": ("planted-needsink whose super weight also writes on every other token "
                           "(super_weight.restoring_recovers)", SHARED_BOS)
     for name in synthetic.SPREAD}
)  # fmt: skip
CONSTRUCTED[f"synthetic:{synthetic.SINKRESID}"] = (
    "planted, with its sink carried by a residual outside the massive dims (the <s> marker)",
    SHARED_BOS,
)
CONSTRUCTED[f"synthetic:{synthetic.WASHOUT}"] = (
    "planted, with a head that writes on every token once BOS's share of attention falls with "
    "length: at 1,024 tokens BOS is no longer massive (conditions.long_first)",
    SHARED_BOS,
)

N_TEXTS, TEXT_LENGTH, N_ITEMS = 32, 12, 128
"""The WeMask texts (at least 32: its intervals are over texts) and MC items of every battery."""

WEMASK_SETTINGS: dict[str, dict[str, Any]] = {"synthetic:planted-needsink": {"claim_rate": 0.5}}
"""WeMask settings beyond the word texts, per constructed model. On ``planted-needsink`` the 3
random dims of 32 masked at ``r = 0.1`` miss the one dim its sink needs with every seed (so
``wemask.beats_random`` could only fail); at ``r = 0.5`` (16 dims) most seeds take it."""


def prompts(model: str) -> list[str]:
    """The prompts the battery of constructed ``model`` runs on."""
    kind = CONSTRUCTED[model][1]
    if kind == SHARED_BOS:
        return synthetic.planted_prompts(N_PROMPTS, PROMPT_LENGTH)
    return synthetic.distinct_first_prompts(N_PROMPTS, PROMPT_LENGTH)


def overrides(model: str, root: Path) -> dict[str, dict[str, Any]]:
    """The per-experiment settings of constructed ``model``'s battery: WeMask on the word texts (each
    opening with a starter word on the models without BOS, so that position 0, which WeMask masks,
    is the massive token) and MC items (written to ``root``) and :data:`WEMASK_SETTINGS`; the
    conditions experiment on all :data:`N_PROMPTS` prompts and as many long inputs per length (its
    default 8 prompts and 1 long input cannot decide a k-of-n claim at the 0.75 threshold: 8 of 8
    has the lower bound 0.63)."""
    root.mkdir(parents=True, exist_ok=True)
    texts, items = root / "texts.txt", root / "mc_items.json"
    starter = CONSTRUCTED[model][1] == DISTINCT_FIRST  # position 0 is the massive starter word
    text = synthetic.word_texts(N_TEXTS, TEXT_LENGTH, starter=starter)
    texts.write_text("\n".join(text) + "\n", encoding="utf-8")
    items.write_text(json.dumps(synthetic.word_mc_items(N_ITEMS)), encoding="utf-8")
    wemask = {"texts": str(texts), "mc_items": str(items), "max_texts": N_TEXTS}
    return {
        "wemask": {**wemask, **WEMASK_SETTINGS.get(model, {})},
        "conditions": {"max_prompts": N_PROMPTS, "long_rows": N_PROMPTS},
    }


def battery_state(
    model: str, root: Path, experiments: Sequence[str] | None = None
) -> dict[str, Any]:
    """The battery state (battery.json, plus ``"out"``) of the battery on constructed ``model``, run
    in ``root`` on :func:`prompts` with :func:`overrides`; ``experiments``: names of
    :data:`me_interp.battery.NAMES` (default: all)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "prompts.txt"
    path.write_text("\n".join(prompts(model)) + "\n", encoding="utf-8")
    out = root / "out"
    state = run_battery(
        CommonConfig(model=model, prompts=str(path), out=str(out)),
        experiments=experiments,
        overrides=overrides(model, root),
        figures=False,  # only the verdicts are read
        report=False,
    )
    return {**state, "out": str(out)}


def claims_of(model: str, state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every claim of a battery state, in battery order; raises ``RuntimeError`` if an experiment
    failed (a constructed model must run every experiment to the end)."""
    exps = state["experiments"]
    failed = {n: e.get("error") for n, e in exps.items() if e["status"] not in FINISHED}
    if failed:
        raise RuntimeError(f"{model}: experiments failed: {failed}")
    return [c for n in NAMES if n in exps for c in exps[n]["claims"]]  # those that were run


def table(by_model: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """``{claim id: {"kind", "holds": [models], "fails": [models]}}`` from each model's claims."""
    out: dict[str, dict[str, Any]] = {}
    for model, cs in by_model.items():
        for c in cs:
            row = out.setdefault(
                c["id"], {"kind": c.get("kind", "claim"), "holds": [], "fails": []}
            )
            if c["verdict"] == claims.HOLDS:
                row["holds"].append(model)
            elif c["verdict"] == claims.FAILS:
                row["fails"].append(model)
    return dict(sorted(out.items()))


def unfalsifiable(t: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The claims of kind ``claim`` with no constructed model on which they hold, or none on which
    they fail (id: what is missing)."""
    bad = {}
    for cid, row in t.items():
        if row["kind"] != "claim":
            continue
        missing = [side for side in ("holds", "fails") if not row[side]]
        if missing:
            bad[cid] = "no constructed model on which it " + " or ".join(missing)
    return bad


def read_table(path: Path = TABLE_FILE) -> dict[str, dict[str, Any]]:
    """The checked-in table (empty when the file does not exist)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def claims_markdown(experiments: Sequence[Experiment] = EXPERIMENTS) -> str:
    """``docs/claims.md``: the threshold table and every claim each experiment can state.

    Regenerate with ``python -c "from me_interp.falsifiability import claims_markdown as m; print(m(), end='')"
    > docs/claims.md`` (a test checks the file is current).
    """

    lines = [
        "# Claims, rules and thresholds",
        "",
        "Generated from `me_interp.claims.THRESHOLDS` and each experiment's `SPECS` by",
        "`me_interp.falsifiability.claims_markdown()`; do not edit by hand.",
        "",
        "Every claim is decided by one engine (`me_interp.claims.judge`) and one rule: it **holds** "
        "when the whole",
        f"{claims.LEVEL:.0%} interval of its statistic lies on the claimed side of its "
        "threshold, **fails** when none of it",
        "does, and is **inconclusive** when the interval straddles the threshold. Intervals are "
        f"seeded percentile bootstraps ({claims.N_BOOTSTRAP}",
        "resamples) over per-unit statistics (prompts, texts), two-way bootstraps over prompts "
        "× seeds for random",
        "controls, and exact Clopper–Pearson intervals for k-of-n outcomes (partner layers, held-out "
        "prompts), each outcome",
        "listed. A verdict that rests on fewer than two *distinct* measurements (the effective n: "
        "e.g. every prompt's",
        "first token is the same BOS) or on a zero-width bootstrap interval is not decided. The "
        "battery's summary gives",
        "the raw counts and the Holm-adjusted ones (each decided verdict's one-sided p-value through "
        "Holm's step-down at",
        f"{claims.ALPHA / 2:g}). **Not applicable**: the claim presupposes something the model "
        "lacks (e.g. a massive activation).",
        "Kinds: *claim* (evidence, counted), *control* (a comparison that must come out as designed "
        "for the claims beside",
        "it to mean anything) and *sanity* (true by construction); controls and sanity checks are "
        "reported, never counted.",
        "",
        "## Thresholds",
        "",
        "| name | value | meaning |",
        "| --- | --- | --- |",
    ]
    for name, t in claims.THRESHOLDS.items():
        lines.append(f"| `{name}` | {t.value:g} | {md_cell(t.doc)} |")
    shown = read_table()
    lines += [
        "",
        "## Claims by experiment",
        "",
        "*Holds on* / *fails on*: the constructed models (`synthetic:<name>`, see",
        "`me_interp.falsifiability`) on whose battery the claim holds / fails, from",
        "`docs/falsifiability.json` (`python -m me_interp.falsifiability` re-runs them). Every claim of",
        "kind *claim* holds on one and fails on another; a check that cannot do both is a control or",
        "a sanity check.",
        "",
    ]
    for exp in experiments:
        lines += [
            f"### {exp.name}",
            "",
            "| id | section | kind | statement | statistic | rule | control | holds on | fails on |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for s in exp.specs:
            row = shown.get(s.id, {})
            on = {
                k: ", ".join(m.removeprefix("synthetic:") for m in row.get(k, [])) or "—"
                for k in ("holds", "fails")
            }
            lines.append(
                f"| `{s.id}` | {md_cell(s.section)} | {s.kind} | {md_cell(s.statement)} | "
                f"{md_cell(s.statistic)} | {s.op} `{s.threshold}` ({s.value:g}) | "
                f"{md_cell(s.control)} | {on['holds']} | {on['fails']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from me_interp import io

    p = argparse.ArgumentParser(prog="python -m me_interp.falsifiability", description=__doc__)
    p.add_argument("--out", type=Path, default=TABLE_FILE, help="where to write the table")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        by_model = {}
        for i, model in enumerate(CONSTRUCTED):
            print(f"[{i + 1}/{len(CONSTRUCTED)}] {model}", file=sys.stderr, flush=True)
            by_model[model] = claims_of(model, battery_state(model, Path(tmp) / str(i)))
    t = table(by_model)
    io.atomic_write_text(args.out, json.dumps(t, indent=1) + "\n")
    bad = unfalsifiable(t)
    for cid, why in bad.items():
        print(f"{cid}: {why}", file=sys.stderr)
    print(f"{len(t)} claims; {len(bad)} of kind 'claim' not shown both ways; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
