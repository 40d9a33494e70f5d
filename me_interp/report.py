"""The battery: every experiment on one model, resumable, and one HTML report of claims and verdicts.

``run_battery`` loads the model once, runs each experiment module of :data:`EXPERIMENTS` in turn (each
writes its usual ``<out>/<experiment>/<run_id>/``), records progress in ``<out>/battery.json`` after
every experiment, and writes ``<out>/report.html``: each claim of the paper with the measured verdict
and links to the figures. Re-running with the same settings skips experiments that already finished
(their ``result.json`` exists), so an interrupted battery resumes where it stopped.

Every experiment module provides ``NAME``, ``Config`` (a :class:`CommonConfig`), ``run(cfg, model)``,
``figures(result)``, ``SPECS`` and ``verdicts(result) -> list[claims.Claim]``. An experiment whose
claims presuppose a massive activation that the model lacks is recorded as "not applicable" (with the
reason), not as a failure.
"""

from __future__ import annotations

import html
import importlib
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from me_interp import claims as claims_mod
from me_interp import io
from me_interp.experiments.common import (
    CommonConfig,
    execute,
    model_for,
    seed_everything,
    write_outcome,
)

EXPERIMENTS: tuple[str, ...] = (
    "me_layer",
    "mechanism",
    "invariance",
    "attention_sinks",
    "wemask",
    "activation_patching",
    "rmsnorm_permutation",
    "ffn_svd_ablation",
    "weight_patching",
    "weight_swap",
    "weight_input_cross",
    "transplant",
    "component_ablation",
    "sink_causality",
)
NOT_APPLICABLE = claims_mod.NOT_APPLICABLE
FINISHED = ("done", NOT_APPLICABLE)
"""Battery statuses of an experiment that ran to the end (and is skipped on resume)."""
STATE_FILE = "battery.json"
REPORT_FILE = "report.html"
SUMMARY_FILE = "report.md"
COMMON_KEYS = ("model", "prompts", "bos", "dtype", "device", "seed", "out", "threads")


def _fingerprint(common: CommonConfig, model: Any) -> dict[str, Any]:
    """What makes two batteries comparable: the shared settings, the device and dtype the model was
    actually loaded with, and the code that ran (package version and git commit). A battery with
    another fingerprint starts over instead of reusing finished runs."""
    d = common.to_dict()
    env = io.environment()
    info = model.info()
    return {
        **{k: d[k] for k in COMMON_KEYS if k not in ("out", "device", "threads")},
        "device_resolved": info["device"],
        "dtype_resolved": info["dtype"],
        "me_interp": env["me_interp"],
        "git_commit": env["git_commit"],
    }


def _load_state(out: Path) -> dict[str, Any]:
    path = out / STATE_FILE
    return io.read_json(path) if path.is_file() else {"experiments": {}}


def run_battery(
    common: CommonConfig,
    experiments: Sequence[str] = EXPERIMENTS,
    model: Any = None,
    progress: Callable[[str], None] | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Run ``experiments`` with the shared settings ``common``; returns the battery state.

    Args:
        common: the shared settings (model, prompts, bos, dtype, device, seed, out).
        experiments: names from :data:`EXPERIMENTS`, in order.
        model: an already loaded model (else loaded from ``common``), loaded at most once.
        progress: called with a line of text before each experiment (the CLI prints it to stderr).
        fresh: ignore finished experiments of an earlier battery in the same ``out``.
    """
    unknown = [e for e in experiments if e not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiments {unknown}; choose from {', '.join(EXPERIMENTS)}")
    if not experiments:
        raise ValueError("no experiments selected")
    out = Path(common.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {"experiments": {}} if fresh else _load_state(out)
    model = model_for(common, model)
    fp = _fingerprint(common, model)
    if state.get("settings") not in (None, fp):
        state = {"experiments": {}}  # other settings: start over, keep the old runs on disk
    state["settings"] = fp
    for i, name in enumerate(experiments):
        entry = state["experiments"].get(name, {})
        done = (
            entry.get("status") in FINISHED
            and (Path(entry.get("run_dir", "")) / io.RESULT_FILE).is_file()
        )
        if done:
            if progress:
                progress(f"[{i + 1}/{len(experiments)}] {name}: already done, skipped")
            continue
        if progress:
            progress(f"[{i + 1}/{len(experiments)}] {name} ...")
        try:
            module = importlib.import_module(f"me_interp.experiments.{name}")
            cfg = module.Config(**common.to_dict())
            seed_everything(cfg.seed)
            outcome = execute(module, cfg, model)
            run_dir = write_outcome(name, cfg, model, outcome)
            entry = {
                "status": "done" if outcome.not_applicable is None else NOT_APPLICABLE,
                "run_dir": str(run_dir),
                "figures": sorted(outcome.figures),
                "claims": io.to_jsonable(outcome.claims),
            }
            if outcome.not_applicable is not None:
                entry["why"] = outcome.not_applicable
        except Exception as e:  # one failing experiment must not stop the battery
            entry = {
                "status": "failed",
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=8),
            }
        state["experiments"][name] = entry
        io.write_json(out / STATE_FILE, state)
        write_report(out, state, experiments)
    write_report(out, state, experiments)
    return state


_COLOR = {
    claims_mod.HOLDS: "#1a7f37",
    claims_mod.FAILS: "#cf222e",
    claims_mod.INCONCLUSIVE: "#9a6700",
    claims_mod.NOT_APPLICABLE: "#57606a",
}


def _claim_rows(cs: Sequence[dict[str, Any]]) -> list[str]:
    rows = []
    for d in cs:
        c = claims_mod.Claim.from_dict(d)
        measured = html.escape(c.estimate.text()) if c.estimate else "&mdash;"
        sanity = c.kind == "sanity"
        label = f"{c.verdict} <small>(sanity check)</small>" if sanity else c.verdict
        why = f"<br><i>{html.escape(c.why)}</i>" if c.why else ""
        details = f"<br><small>{html.escape(c.details)}</small>" if c.details else ""
        rows.append(
            f"<tr{' class=sanity' if sanity else ''}>"
            f"<td style='color:{_COLOR[c.verdict]};font-weight:600'>{label}</td>"
            f"<td><code>{html.escape(c.id)}</code><br><small>{html.escape(c.section)}</small></td>"
            f"<td>{html.escape(c.statement)}{why}</td>"
            f"<td>{html.escape(c.statistic)}: <b>{measured}</b>{details}</td>"
            f"<td><small>{html.escape(c.rule)}</small></td>"
            f"<td><small>{html.escape(c.control)}</small></td></tr>"
        )
    return rows


def write_report(
    out: Path, state: dict[str, Any], experiments: Sequence[str] = EXPERIMENTS
) -> Path:
    """Write ``<out>/report.html`` from the battery state: a summary of the verdicts, then per
    experiment every claim with its estimate, interval, n, rule and control."""
    out = Path(out)
    settings = state.get("settings", {})
    sections = []
    all_claims: list[dict[str, Any]] = []
    for name in experiments:
        entry = state["experiments"].get(name)
        head = f"<h2 id='{name}'>{name}</h2>"
        if entry is None:
            sections.append(f"{head}<p><i>not run yet</i></p>")
            continue
        if entry["status"] not in FINISHED:
            err = html.escape(entry.get("error", ""))
            sections.append(f"{head}<p style='color:#cf222e'>failed: {err}</p>")
            continue
        cs = entry.get("claims") or []
        all_claims.extend(cs)
        rel = Path(_relpath(Path(entry["run_dir"]), out))
        links = " &middot; ".join(
            f"<a href='{html.escape(str(rel / (f + '.html')))}'>{html.escape(f)}</a>"
            for f in entry["figures"]
        )
        result_link = f"<a href='{html.escape(str(rel / io.RESULT_FILE))}'>result.json</a>"
        na = (
            f"<p><b>not applicable</b>: {html.escape(entry['why'])}</p>"
            if entry["status"] == NOT_APPLICABLE
            else ""
        )
        table = (
            "<table><tr><th>verdict</th><th>claim</th><th>statement</th><th>statistic: estimate "
            "[95% CI] (n)</th><th>rule</th><th>control</th></tr>"
            + "".join(_claim_rows(cs))
            + "</table>"
            if cs
            else ""
        )
        sections.append(
            f"{head}<p>{result_link} {('&middot; ' + links) if links else ''}</p>{na}{table}"
        )
    n = claims_mod.counts(all_claims)
    n_sanity = sum(1 for c in all_claims if c.get("kind") == "sanity")
    summary = "".join(
        f"<td style='color:{_COLOR[v]};font-weight:600'>{v}: {n[v]}</td>"
        for v in claims_mod.VERDICTS
    )
    finished = sum(1 for e in state["experiments"].values() if e.get("status") in FINISHED)
    body = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>me_interp report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1300px; }}
table {{ border-collapse: collapse; width: 100%; margin-bottom: 1em; }}
td, th {{ border: 1px solid #d0d7de; padding: 6px 8px; vertical-align: top; font-size: 14px; }}
th {{ background: #f6f8fa; text-align: left; }}
tr.sanity td {{ background: #f6f8fa; color: #57606a; }}
code {{ background: #f6f8fa; padding: 1px 4px; }}
</style></head><body>
<h1>me_interp report</h1>
<p>Model: <code>{html.escape(str(settings.get("model") or "bundled SmolLM2-135M-Instruct"))}</code>;
prompts: <code>{html.escape(str(settings.get("prompts") or "built-in"))}</code>;
BOS: <code>{html.escape(str(settings.get("bos")))}</code>; dtype: <code>{html.escape(str(settings.get("dtype")))}</code>;
seed: {settings.get("seed")}; ran on <code>{html.escape(str(settings.get("device_resolved")))}</code> in
<code>{html.escape(str(settings.get("dtype_resolved")))}</code>; me_interp
{html.escape(str(settings.get("me_interp")))}, commit <code>{html.escape(str(settings.get("git_commit")))}</code>. Layers are 0-based (1-based in parentheses where given).
{finished} of {len(experiments)} experiments finished.</p>
<table><tr><th colspan=4>claims of the paper and its critics on this model
({sum(n.values())} claims; {n_sanity} sanity checks not counted)</th></tr><tr>{summary}</tr></table>
<p>Each claim is decided by one rule: it <b>holds</b> when the whole 95% interval of its statistic
(a seeded percentile bootstrap over prompts, partner layers or seeds) lies on the claimed side of the
threshold, <b>fails</b> when none of it does, and is <b>inconclusive</b> when the interval straddles the
threshold. <b>Not applicable</b>: the claim presupposes something this model lacks (the reason is
given). Sanity checks (grey) are true by construction and are not evidence. Thresholds:
<code>me_interp.claims.THRESHOLDS</code> (docs/claims.md).</p>
{"".join(sections)}
</body></html>
"""
    io.atomic_write_text(out / SUMMARY_FILE, verdicts_markdown(state, experiments))
    return io.atomic_write_text(out / REPORT_FILE, body)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def verdicts_markdown(state: dict[str, Any], experiments: Sequence[str] = EXPERIMENTS) -> str:
    """``<out>/report.md``: one table row per claim (verdict, estimate with interval, n), ready to
    paste; sanity checks are marked and not-applicable rows give the reason."""

    rows = [
        "| experiment | claim | verdict | estimate [95% CI] | n |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in experiments:
        entry = state["experiments"].get(name)
        if entry is None or entry.get("status") not in FINISHED:
            status = "not run" if entry is None else f"failed: {entry.get('error', '')}"
            rows.append(f"| {name} | | {_md_cell(status)} | | |")
            continue
        for d in entry.get("claims") or []:
            c = claims_mod.Claim.from_dict(d)
            verdict = f"**{c.verdict}**" + (" (sanity check)" if c.kind == "sanity" else "")
            if c.estimate is None:
                est, n = _md_cell(c.why), ""
            else:
                e = c.estimate
                est = claims_mod.fmt_num(e.value)
                if e.method != "exact":
                    est += f" [{claims_mod.fmt_num(e.lo)}, {claims_mod.fmt_num(e.hi)}]"
                n = f"{e.n} {e.unit}"
            rows.append(f"| {name} | `{c.id}` | {verdict} | {est} | {n} |")
    n = claims_mod.counts(d for e in state["experiments"].values() for d in e.get("claims") or [])
    head = ", ".join(f"{v}: {k}" for v, k in n.items())
    lines = [
        f"- {name}: "
        + ("(sanity check) " if d.get("kind") == "sanity" else "")
        + claims_mod.Claim.from_dict(d).line()
        for name in experiments
        for d in (state["experiments"].get(name) or {}).get("claims") or []
    ]
    return (
        f"Claims ({head}; sanity checks not counted)\n\n"
        + "\n".join(rows)
        + "\n\nEach claim in full (statistic, interval, n, rule, control, context):\n\n"
        + "\n".join(lines)
        + "\n"
    )


def _relpath(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path, start)


def claims_markdown(experiments: Sequence[str] = EXPERIMENTS) -> str:
    """``docs/claims.md``: the threshold table and every claim each experiment can state.

    Regenerate with ``python -c "from me_interp.report import claims_markdown as m; print(m(), end='')"
    > docs/claims.md`` (a test checks the file is current).
    """

    lines = [
        "# Claims, rules and thresholds",
        "",
        "Generated from `me_interp.claims.THRESHOLDS` and each experiment's `SPECS` by",
        "`me_interp.report.claims_markdown()`; do not edit by hand.",
        "",
        "Every claim is decided by one rule: it **holds** when the whole "
        f"{claims_mod.LEVEL:.0%} interval of its statistic",
        "lies on the claimed side of its threshold, **fails** when none of it does, and is "
        "**inconclusive** when the",
        "interval straddles the threshold. Intervals are seeded percentile bootstraps "
        f"({claims_mod.N_BOOTSTRAP} resamples) over",
        "per-unit statistics (prompts, texts, partner layers), or over at least "
        f"{claims_mod.MIN_SEEDS} seeds for random controls.",
        "**Not applicable**: the claim presupposes something the model lacks (e.g. a massive "
        "activation). Claims of kind",
        "*sanity* hold by construction; they are reported, never counted as evidence.",
        "",
        "## Thresholds",
        "",
        "| name | value | meaning |",
        "| --- | --- | --- |",
    ]
    for name, t in claims_mod.THRESHOLDS.items():
        lines.append(f"| `{name}` | {t.value:g} | {_md_cell(t.doc)} |")
    lines += ["", "## Claims by experiment", ""]
    for name in experiments:
        module = importlib.import_module(f"me_interp.experiments.{name}")
        lines += [
            f"### {name}",
            "",
            "| id | section | kind | statement | statistic | rule | control |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for s in module.SPECS:
            lines.append(
                f"| `{s.id}` | {_md_cell(s.section)} | {s.kind} | {_md_cell(s.statement)} | "
                f"{_md_cell(s.statistic)} | {s.op} `{s.threshold}` ({s.value:g}) | {_md_cell(s.control)} |"
            )
        lines.append("")
    return "\n".join(lines)
