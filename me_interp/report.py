"""The battery: every experiment on one model, resumable, and one HTML report of claims and verdicts.

``run_battery`` loads the model once, runs each experiment module of :data:`EXPERIMENTS` in turn (each
writes its usual ``<out>/<experiment>/<run_id>/``), records progress in ``<out>/battery.json`` after
every experiment, and writes ``<out>/report.html``: each claim of the paper with the measured verdict
and links to the figures. Re-running with the same settings skips experiments that already finished
(their ``result.json`` exists), so an interrupted battery resumes where it stopped.

Every experiment module provides ``NAME``, ``Config`` (a :class:`CommonConfig`), ``run(cfg, model)``,
``figures(result)`` and ``verdicts(result) -> [{"claim", "measured", "holds"}]``.
"""

from __future__ import annotations

import html
import importlib
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from me_interp import io
from me_interp.experiments.common import CommonConfig, model_for, seed_everything

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
    "transplant",
    "component_ablation",
    "sink_causality",
)
STATE_FILE = "battery.json"
REPORT_FILE = "report.html"
COMMON_KEYS = ("model", "prompts", "bos", "dtype", "device", "seed", "out", "threads")


def _fingerprint(common: CommonConfig) -> dict[str, Any]:
    d = common.to_dict()
    return {k: d[k] for k in COMMON_KEYS if k not in ("out", "device", "threads")}


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
    fp = _fingerprint(common)
    if state.get("settings") not in (None, fp):
        state = {"experiments": {}}  # other settings: start over, keep the old runs on disk
    state["settings"] = fp
    for i, name in enumerate(experiments):
        entry = state["experiments"].get(name, {})
        done = (
            entry.get("status") == "done"
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
            model = model_for(cfg, model)
            result = module.run(cfg, model)
            figs = module.figures(result)
            run_dir = io.write_run(
                common.out, name, cfg, result, io.environment(model.info()), figs
            )
            entry = {
                "status": "done",
                "run_dir": str(run_dir),
                "figures": sorted(figs),
                "verdicts": io.to_jsonable(module.verdicts(result)),
            }
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


_MARK = {
    True: ("holds", "#1a7f37"),
    False: ("does not hold", "#cf222e"),
    None: ("inconclusive", "#9a6700"),
}


def write_report(
    out: Path, state: dict[str, Any], experiments: Sequence[str] = EXPERIMENTS
) -> Path:
    """Write ``<out>/report.html`` from the battery state."""
    out = Path(out)
    settings = state.get("settings", {})
    rows = []
    for name in experiments:
        entry = state["experiments"].get(name)
        if entry is None:
            rows.append(f"<tr><td>{name}</td><td colspan=4><i>not run yet</i></td></tr>")
            continue
        if entry["status"] != "done":
            err = html.escape(entry.get("error", ""))
            rows.append(
                f"<tr><td>{name}</td><td colspan=4 style='color:#cf222e'>failed: {err}</td></tr>"
            )
            continue
        run_dir = Path(entry["run_dir"])
        rel = Path(_relpath(run_dir, out))
        links = " ".join(
            f"<a href='{html.escape(str(rel / (f + '.html')))}'>{html.escape(f)}</a>"
            for f in entry["figures"]
        )
        result_link = f"<a href='{html.escape(str(rel / io.RESULT_FILE))}'>result.json</a>"
        verdicts = entry.get("verdicts") or [{"claim": "(no claim)", "measured": "", "holds": None}]
        for j, v in enumerate(verdicts):
            text, color = _MARK[v.get("holds")]
            first = j == 0
            rows.append(
                "<tr>"
                + (
                    f"<td rowspan={len(verdicts)}><b>{name}</b><br><small>{result_link}</small></td>"
                    if first
                    else ""
                )
                + f"<td>{html.escape(str(v.get('claim', '')))}</td>"
                + f"<td>{html.escape(str(v.get('measured', '')))}</td>"
                + f"<td style='color:{color};font-weight:600'>{text}</td>"
                + (f"<td rowspan={len(verdicts)}>{links}</td>" if first else "")
                + "</tr>"
            )
    done = sum(1 for e in state["experiments"].values() if e.get("status") == "done")
    body = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>me_interp report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border: 1px solid #d0d7de; padding: 6px 8px; vertical-align: top; font-size: 14px; }}
th {{ background: #f6f8fa; text-align: left; }}
code {{ background: #f6f8fa; padding: 1px 4px; }}
</style></head><body>
<h1>me_interp report</h1>
<p>Model: <code>{html.escape(str(settings.get("model") or "bundled SmolLM2-135M-Instruct"))}</code>;
prompts: <code>{html.escape(str(settings.get("prompts") or "built-in"))}</code>;
BOS: <code>{html.escape(str(settings.get("bos")))}</code>; dtype: <code>{html.escape(str(settings.get("dtype")))}</code>;
seed: {settings.get("seed")}. Layers are 0-based (1-based in parentheses where given).
{done} of {len(experiments)} experiments finished.</p>
<p>Each row states a claim of the paper (Massive Emergence layer, ICML 2026) or of its critics, the number
measured here, and whether the claim holds <i>on this model with these prompts</i>. Follow the links for
the interactive figures and the full <code>result.json</code>.</p>
<table><tr><th>experiment</th><th>claim</th><th>measured</th><th>verdict</th><th>figures</th></tr>
{"".join(rows)}
</table></body></html>
"""
    return io.atomic_write_text(out / REPORT_FILE, body)


def _relpath(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path, start)
