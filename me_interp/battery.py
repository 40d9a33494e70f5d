"""The battery: every experiment on one model, resumable, and the report written as it goes.

:data:`EXPERIMENTS` is the list of experiment descriptors (:class:`me_interp.study.Experiment`), in the
order they run: adding an experiment is one module and one line here. :func:`run_battery` loads the
model once, runs each experiment in turn (each writes its usual ``<out>/<experiment>/<run_id>/``),
records progress in ``<out>/battery.json`` after every experiment, and has :mod:`me_interp.report`
render ``<out>/report.html``. Re-running with the same settings skips experiments that already
finished (their ``result.json`` exists), so an interrupted battery resumes where it stopped. An
experiment whose claims presuppose a massive activation that the model lacks is recorded as "not
applicable" (with the reason), not as a failure; one that crashes is recorded as failed and the
battery goes on.
"""

from __future__ import annotations

import time
import traceback

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock (one battery per folder)
    fcntl = None  # type: ignore[assignment]
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from me_interp import claims as claims_mod
from me_interp import io, usage
from me_interp.experiments import (
    activation_patching,
    attention_sinks,
    component_ablation,
    conditions,
    ffn_svd_ablation,
    invariance,
    me_layer,
    mechanism,
    rmsnorm_permutation,
    sink_causality,
    super_weight,
    transplant,
    weight_input_cross,
    weight_patching,
    weight_swap,
    wemask,
)
from me_interp.report import FINISHED, NOT_APPLICABLE, STATE_FILE, finished_claims, write_report
from me_interp.study import (
    CommonConfig,
    Experiment,
    apply_threads,
    execute,
    model_for,
    seed_everything,
    write_outcome,
)

EXPERIMENTS: tuple[Experiment, ...] = (
    me_layer.EXPERIMENT,
    mechanism.EXPERIMENT,
    invariance.EXPERIMENT,
    attention_sinks.EXPERIMENT,
    conditions.EXPERIMENT,
    wemask.EXPERIMENT,
    activation_patching.EXPERIMENT,
    rmsnorm_permutation.EXPERIMENT,
    ffn_svd_ablation.EXPERIMENT,
    super_weight.EXPERIMENT,
    weight_patching.EXPERIMENT,
    weight_swap.EXPERIMENT,
    weight_input_cross.EXPERIMENT,
    transplant.EXPERIMENT,
    component_ablation.EXPERIMENT,
    sink_causality.EXPERIMENT,
)
"""The battery's experiments, in the order they run."""
NAMES: tuple[str, ...] = tuple(e.name for e in EXPERIMENTS)
"""Their names (``--only`` / ``--skip`` choices, battery.json keys)."""
BY_NAME: dict[str, Experiment] = {e.name: e for e in EXPERIMENTS}
COMMON_KEYS = ("model", "prompts", "bos", "dtype", "device", "seed", "out", "threads")


def load_run(run_dir: str | Path, experiment: str | None = None) -> Any:
    """The typed Result of a finished run folder ``<out>/<experiment>/<run_id>/``
    (``me_interp.load_run``): its experiment's Result type (``Experiment.result_type``, else the
    return type of its ``run``) read back by :func:`me_interp.io.load_run`.

    Args:
        run_dir: the run folder (``str`` or ``Path``).
        experiment: the experiment's name (default: the name of the folder above ``run_dir``).

    Raises:
        ValueError: an unknown experiment, or a run that was not applicable (no Result).
        FileNotFoundError: an unfinished run (no ``result.json``).
    """

    name = Path(run_dir).resolve().parent.name if experiment is None else experiment
    if name not in BY_NAME:
        raise ValueError(
            f"{run_dir} is not in a folder named after an experiment ({', '.join(NAMES)}): pass "
            "experiment="
        )
    exp = BY_NAME[name]
    tp = exp.result_type
    return io.load_run(run_dir, tp)


def _fingerprint(common: CommonConfig, model: Any) -> dict[str, Any]:
    """What makes two batteries comparable: the shared settings, the device, dtype and placement
    (device map, offloaded modules) the model was actually loaded with, and the code that ran
    (package version and git commit). A battery with another fingerprint starts over instead of
    reusing finished runs."""
    d = common.to_dict()
    env = io.environment()
    info = model.info()
    return {
        **{k: d[k] for k in COMMON_KEYS if k not in ("out", "device", "threads")},
        "device_resolved": info["device"],
        "dtype_resolved": info["dtype"],
        "placement": info.get("placement"),
        "hf_device_map": info.get("hf_device_map"),
        "me_interp": env["me_interp"],
        "git_commit": env["git_commit"],
    }


def _load_state(out: Path) -> dict[str, Any]:
    path = out / STATE_FILE
    return io.read_json(path) if path.is_file() else {"experiments": {}}


def run_battery(
    common: CommonConfig,
    experiments: Sequence[str] | None = None,
    model: Any = None,
    progress: Progress | None = None,
    fresh: bool = False,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    figures: bool = True,
    report: bool = True,
) -> dict[str, Any]:
    """Run ``experiments`` with the shared settings ``common``; returns the battery state.

    Args:
        common: the shared settings (model, prompts, bos, dtype, device, seed, out).
        experiments: names from :data:`NAMES`, in order (default: all of them).
        model: an already loaded model (else loaded from ``common``), loaded at most once.
        progress: told when each experiment starts and ends (:class:`Progress`; the CLI draws a
            bar with an estimate of the time left from the previous runs' durations).
        fresh: ignore finished experiments of an earlier battery in the same ``out``.
        overrides: per experiment, config fields beyond the shared ones (e.g. ``{"wemask":
            {"texts": FILE}}``); part of the battery's fingerprint.
        figures: draw each experiment's figures (``False``: claims and results only, for callers
            that read only the verdicts, e.g. :mod:`me_interp.falsifiability`).
        report: rewrite ``report.html`` / ``report.md`` after each experiment and at the end
            (``False``: ``battery.json`` and the runs only; ``me-interp report OUT`` writes it later).
    """
    experiments = NAMES if experiments is None else tuple(experiments)
    unknown = [e for e in experiments if e not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown experiments {unknown}; choose from {', '.join(NAMES)}")
    if not experiments:
        raise ValueError("no experiments selected")
    out = io.check_writable(common.out)
    state = {"experiments": {}} if fresh else _load_state(out)
    model = model_for(common, model)
    overrides = {k: dict(v) for k, v in (overrides or {}).items()}
    unknown = [e for e in overrides if e not in BY_NAME]
    if unknown:
        raise ValueError(f"overrides for unknown experiments {unknown}")
    fp = {**_fingerprint(common, model), "overrides": overrides}
    if state.get("settings") not in (None, fp):
        state = {"experiments": {}}  # other settings: start over, keep the old runs on disk
    state["settings"] = fp
    key = _durations_key(model)
    previous = {**_durations().get(key, {}), **_seconds_of(state)}
    if progress:
        unknown = [n for n in experiments if n not in previous]
        progress.begin(experiments, previous, predicted_seconds(model, common, unknown))
    ran: list[str] = []
    for name in experiments:
        entry = state["experiments"].get(name, {})
        done = (
            entry.get("status") in FINISHED
            and (Path(entry.get("run_dir", "")) / io.RESULT_FILE).is_file()
        )
        if done:
            if progress:
                progress.end(name, entry, skipped=True)
            continue
        if progress:
            progress.start(name)
        with usage.track() as cost:
            try:
                exp = BY_NAME[name]
                cfg = exp.config(**common.to_dict(), **overrides.get(name, {}))
                apply_threads(cfg, model)  # again before each: the machine's load may have changed
                seed_everything(cfg.seed)
                outcome = execute(exp, cfg, model, figures=figures)
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
        entry.update(cost.to_dict())
        state["experiments"][name] = entry
        if entry["status"] in FINISHED:
            _record_duration(key, name, cost.seconds)
        if progress:
            progress.end(name, entry)
        state = _save(out, state, ran={*ran, name}, experiments=experiments)
        ran.append(name)
        if report:
            write_report(out, state, _shown(state, experiments))
    if report:
        write_report(out, state, _shown(state, experiments))
    return state


def _save(out: Path, state: dict[str, Any], ran: set[str], experiments: Sequence[str]) -> dict:
    """Write ``battery.json``, merged with what another battery wrote into the same ``out`` since
    this one read it: under an exclusive lock on ``battery.json.lock``, the entries on disk of the
    experiments this process did not run are kept (when their settings are this battery's), so two
    batteries started together into one folder both keep every experiment. Returns the merged
    state."""
    lock_path = out / (STATE_FILE + ".lock")
    with open(lock_path, "a", encoding="utf-8") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        disk = _load_state(out)
        if disk.get("settings") == state["settings"]:
            theirs = {n: e for n, e in disk["experiments"].items() if n not in ran}
            state = {**state, "experiments": {**state["experiments"], **theirs}}
        state["tally"] = claims_mod.tally(finished_claims(state, experiments))
        io.write_json(out / STATE_FILE, state)
    return state


def _shown(state: Mapping[str, Any], experiments: Sequence[str]) -> list[Experiment]:
    """The experiments a report of ``state`` shows: those asked for and those another battery
    recorded in the same folder, in battery order."""
    return [e for e in EXPERIMENTS if e.name in experiments or e.name in state["experiments"]]


class Progress:
    """What :func:`run_battery` tells about its progress (subclass and override; all no-ops here)."""

    def begin(
        self,
        experiments: Sequence[str],
        previous: Mapping[str, float],
        predicted: Mapping[str, float] | None = None,
    ) -> None:
        """The battery starts ``experiments``; ``previous``: seconds each took in earlier runs on
        this model, device and dtype (where known); ``predicted``: for the others, the cost model's
        seconds (:func:`predicted_seconds`)."""

    def start(self, name: str) -> None:
        """Experiment ``name`` starts."""

    def end(self, name: str, entry: Mapping[str, Any], skipped: bool = False) -> None:
        """Experiment ``name`` ended with battery entry ``entry`` (``skipped``: finished earlier)."""


CALIBRATION_PROMPTS = 8
"""The cost model's unit: one plain forward of the first this many prompts (a second or less on the
bundled model; the whole prompt set in one batch would take most of a minute)."""
FORWARDS: dict[str, float] = {
    "me_layer": 12,
    "mechanism": 17,
    "invariance": 13,
    "attention_sinks": 15,
    "conditions": 12,
    "wemask": 109,
    "activation_patching": 34,
    "rmsnorm_permutation": 11,
    "ffn_svd_ablation": 14,
    "super_weight": 38,
    "weight_patching": 31,
    "weight_swap": 37,
    "weight_input_cross": 13,
    "transplant": 13,
    "component_ablation": 24,
    "sink_causality": 19,
}
"""The cost model of a first battery: each experiment's wall time at its default settings in units
of :func:`forward_seconds`, measured on the bundled model at 7d63bb8 (a whole battery of 4 min 10 s,
the calibration forward 0.581 s, two threads, the machine otherwise idle; docs/performance.md). An
experiment missing here counts as the median of the others. Earlier runs on the same model, device
and dtype replace it (``battery_seconds.json``)."""


def forward_seconds(model: Any, common: CommonConfig, repeats: int = 3) -> float:
    """Seconds of one plain forward (no gradients) of the first :data:`CALIBRATION_PROMPTS` of
    ``common``'s prompts on ``model``: the fastest of ``repeats`` (the first pays one-off set-up)."""
    batch = model.tokenize(common.load_prompts()[:CALIBRATION_PROMPTS])
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.run_with_hooks(batch)
            best = min(best, time.perf_counter() - t0)
    return best


def predicted_seconds(model: Any, common: CommonConfig, names: Sequence[str]) -> dict[str, float]:
    """The cost model's seconds for ``names`` (experiments never timed on this model, device and
    dtype): :data:`FORWARDS` times one forward measured now (:func:`forward_seconds`); ``{}`` when
    ``names`` is empty or no cost is known."""
    if not names or not FORWARDS:
        return {}
    median = sorted(FORWARDS.values())[len(FORWARDS) // 2]
    t = forward_seconds(model, common)
    return {n: FORWARDS.get(n, median) * t for n in names}


DURATIONS_FILE = "battery_seconds.json"
"""In the model cache directory: per model, device and dtype, the seconds each experiment last took
(the battery's time estimate)."""


def _durations_key(model: Any) -> str:
    info = model.info()
    return f"{info['model']}|{info['device']}|{info['dtype']}"


def _durations() -> dict[str, dict[str, float]]:
    from me_interp.loading.cache import cache_dir

    path = cache_dir() / DURATIONS_FILE
    try:
        data = io.read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _record_duration(key: str, name: str, seconds: float) -> None:
    from me_interp.loading.cache import cache_dir

    data = _durations()
    data.setdefault(key, {})[name] = round(seconds, 2)
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        io.write_json(cache_dir() / DURATIONS_FILE, data)
    except OSError:
        pass  # an estimate only: a read-only cache must not fail the battery


def _seconds_of(state: Mapping[str, Any]) -> dict[str, float]:
    return {
        n: e["seconds"]
        for n, e in state.get("experiments", {}).items()
        if e.get("seconds") is not None and e.get("status") in FINISHED
    }
