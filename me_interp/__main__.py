"""``me-interp`` / ``python -m me_interp``: the battery, the report, the claims and the models.

    me-interp run                            # every experiment on the bundled model, runs/report.html
    me-interp run me_layer mechanism --out runs/quick
    me-interp run --model Qwen/Qwen3-4B --device cuda --dtype bfloat16
    me-interp report runs                    # rebuild runs/report.html and report.md from battery.json
    me-interp claims [EXPERIMENT ...]        # every claim with its rule and kind (--json: JSON lines)
    me-interp models                         # the bundled, packaged and synthetic models

``python -m me_interp [--only ...] [flags]`` is ``me-interp run`` (as before). On a model without a
massive activation the mechanism experiments answer "not applicable" (with the reason) and the
battery still exits 0; it exits 1 only when an experiment crashed, 2 on bad input. An interrupted
battery resumes: re-run the same command and finished experiments are skipped (``--fresh`` re-runs
everything). Output: one line per claim and per experiment (``--verbose``: every claim in full;
``--json``: JSON lines; ``--quiet``: results only); a progress bar over the experiments with the time
left, estimated from the previous runs' durations.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from me_interp import io, terminal
from me_interp.battery import BY_NAME, EXPERIMENTS, NAMES, Progress, run_battery
from me_interp.claims import KIND_LABEL, Claim, tally_text
from me_interp.report import FINISHED, REPORT_FILE, STATE_FILE, write_report
from me_interp.study import (
    BAD_INPUT,
    INTERRUPTED,
    ArgumentParser,
    CommonConfig,
    apply_threads,
    build_parser,
    config_from_args,
    is_bad_input,
    model_for,
)

COMMANDS = ("run", "report", "claims", "models")
HELP = (
    """usage: me-interp COMMAND [flags]   (me-interp COMMAND --help for its flags)

commands:
  run [EXPERIMENT ...]     every experiment (or these) on one model, and OUT/report.html
  report OUT               rebuild OUT/report.html and report.md from OUT/battery.json
  claims [EXPERIMENT ...]  every claim with its rule and kind (--json: JSON lines)
  models                   the bundled, packaged and synthetic models, installed or not

one experiment alone: python -m me_interp.experiments.NAME --help
"""
    + "experiments: "
    + ", ".join(NAMES)
)


class BatteryBar(Progress):
    """The battery's progress on stderr: a bar over the experiments with the elapsed time and an
    estimate of the time left (from the previous runs' durations), or one line per experiment when
    stderr is not a terminal; and each experiment's summary and claim lines as soon as it ends."""

    TICK = 1.0
    """Seconds between redraws of the bar's elapsed time while an experiment runs."""

    def __init__(self, output: terminal.Output) -> None:
        self.output = output
        self.bar = None
        self.done: dict[str, float] = {}
        self.current: str | None = None
        self.names: list[str] = []
        self.left: list[str] = []
        self.previous: dict[str, float] = {}
        self.predicted: dict[str, float] = {}
        self.t0 = self.t_current = time.perf_counter()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def begin(
        self,
        experiments: Sequence[str],
        previous: Mapping[str, float],
        predicted: Mapping[str, float] | None = None,
    ) -> None:
        self.names, self.previous = list(experiments), dict(previous)
        self.predicted = dict(predicted or {})
        self.t0 = self.t_current = time.perf_counter()
        self.left = list(experiments)
        self.bar = terminal.bar(
            total=len(experiments),
            unit="exp",
            leave=True,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
        )
        if not self.bar.disable:  # the elapsed time and the estimate keep ticking
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.TICK):
            if self.bar is not None:
                self.bar.set_postfix_str(self._eta(), refresh=True)

    def _guess(self, name: str) -> float | None:
        """Seconds ``name`` should take: its duration in an earlier run on this model, device and
        dtype, else the cost model's prediction (``None``: neither)."""
        return self.previous.get(name, self.predicted.get(name))

    def _eta(self) -> str:
        """The time left: each experiment's guess (:meth:`_guess`; an experiment with none counts
        as the mean of those finished in this run), scaled by the speed observed so far (the
        finished experiments' real over guessed seconds: a busy machine is noticed after one
        experiment), less the time the current one has already run."""
        if not self.left:
            return "nothing left"
        mean_now = sum(self.done.values()) / len(self.done) if self.done else None
        guessed = {n: self._guess(n) for n in self.done}
        base = sum(g for g in guessed.values() if g is not None)
        speed = (
            sum(self.done[n] for n, g in guessed.items() if g is not None) / base if base else 1.0
        )
        guesses = [self._guess(n) or mean_now for n in self.left]
        if any(g is None for g in guesses):
            return ""
        left = speed * sum(guesses)  # type: ignore[arg-type]
        if self.current in self.left:
            left -= min(
                time.perf_counter() - self.t_current, speed * guesses[self.left.index(self.current)]
            )  # type: ignore[operator]
        return f"about {terminal.fmt_seconds(max(left, 0.0))} left"

    def start(self, name: str) -> None:
        self.current, self.t_current = name, time.perf_counter()
        eta = self._eta()
        k = self.names.index(name) + 1
        if self.bar is not None and not self.bar.disable:
            self.bar.set_description(name)
            self.bar.set_postfix_str(eta, refresh=True)
        else:
            elapsed = terminal.fmt_seconds(time.perf_counter() - self.t0)
            terminal.note(
                f"[{k}/{len(self.names)}] {name} … ({elapsed} elapsed{'; ' + eta if eta else ''})"
            )

    def end(self, name: str, entry: Mapping[str, Any], skipped: bool = False) -> None:
        if name in self.left:
            self.left.remove(name)
        if not skipped and entry.get("seconds") is not None:
            self.done[name] = float(entry["seconds"])
        if self.bar is not None:
            self.bar.set_postfix_str(self._eta(), refresh=False)
            self.bar.update(1)
        out = self.output
        if out.mode != "json" and (not out.quiet or entry.get("status") == "failed"):
            line = terminal.experiment_line(name, entry, color=out.color)
            out.text(line + (" (finished earlier: skipped)" if skipped else ""))
        if entry.get("status") == "done":
            out.claims(name, [Claim.from_dict(d) for d in entry.get("claims", [])])

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.bar is not None:
            self.bar.close()


def _battery_parser(prog: str, positional: bool) -> argparse.ArgumentParser:
    parser = build_parser(CommonConfig, prog, __doc__)
    if positional:
        parser.add_argument(
            "experiments", nargs="*", metavar="EXPERIMENT", help=f"from: {', '.join(NAMES)}"
        )
    else:
        parser.add_argument("--only", nargs="+", choices=NAMES, help="run only these experiments")
    parser.add_argument("--skip", nargs="+", choices=NAMES, default=[], help="skip these")
    parser.add_argument("--fresh", action="store_true", help="re-run experiments already finished")
    terminal.add_output_flags(parser)
    return parser


def battery(argv: Sequence[str] | None, prog: str, positional: bool) -> int:
    parser = _battery_parser(prog, positional)
    args = parser.parse_args(argv)
    picked = args.experiments if positional else args.only
    unknown = [e for e in picked or () if e not in BY_NAME]
    if unknown:
        parser.error(f"unknown experiments {unknown}; choose from {', '.join(NAMES)}")
    chosen = [e for e in (picked or NAMES) if e not in args.skip]
    output = terminal.output_from_args(args)
    bar = BatteryBar(output)
    try:
        cfg = config_from_args(CommonConfig, args)
        io.check_writable(cfg.out)  # before the model loads
        if sys.stderr.isatty():
            terminal.note(f"battery: loading {cfg.model or 'the bundled model'} …")
        model = model_for(cfg)
        apply_threads(cfg, model)
        state = run_battery(cfg, chosen, model=model, progress=bar, fresh=args.fresh)
    except BAD_INPUT as e:
        if not is_bad_input(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        bar.close()
        where = f"during {bar.current}" if bar.current else "before the first experiment"
        print(
            f"interrupted ({where}): every finished experiment is saved in {args.out}/{STATE_FILE}; "
            "run the same command again to resume",
            file=sys.stderr,
        )
        return INTERRUPTED
    finally:
        bar.close()
    failed = [n for n in chosen if state["experiments"].get(n, {}).get("status") not in FINISHED]
    if "tally" in state:
        output.text(tally_text(state["tally"]))
    output.text(f"report: {cfg.out}/{REPORT_FILE}")
    return 1 if failed else 0


def report_command(argv: Sequence[str]) -> int:
    parser = ArgumentParser(
        prog="me-interp report",
        description="Rebuild report.html and report.md of a battery from its battery.json",
    )
    parser.add_argument("dir", help=f"a battery's results root (the folder holding {STATE_FILE})")
    args = parser.parse_args(argv)
    path = Path(args.dir) / STATE_FILE
    if not path.is_file():
        print(f"error: {path} not found: give a battery's --out directory", file=sys.stderr)
        return 2
    try:
        state = io.read_json(path)
    except (ValueError, UnicodeDecodeError) as e:
        print(f"error: {path} is not valid JSON: {e}", file=sys.stderr)
        return 2
    if not isinstance(state, dict) or not isinstance(state.get("experiments"), dict):
        print(f"error: {path} is not a battery state (no 'experiments')", file=sys.stderr)
        return 2
    ran = [e for e in EXPERIMENTS if e.name in state["experiments"]]
    html_path = write_report(Path(args.dir), state, ran or EXPERIMENTS)
    print(f"report: {html_path}")
    return 0


def claims_command(argv: Sequence[str]) -> int:
    parser = ArgumentParser(
        prog="me-interp claims", description="Every claim the battery states, with its rule"
    )
    parser.add_argument(
        "experiments", nargs="*", metavar="EXPERIMENT", help=f"from: {', '.join(NAMES)}"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per claim")
    args = parser.parse_args(argv)
    unknown = [e for e in args.experiments if e not in BY_NAME]
    if unknown:
        parser.error(f"unknown experiments {unknown}; choose from {', '.join(NAMES)}")
    for exp in EXPERIMENTS:
        if args.experiments and exp.name not in args.experiments:
            continue
        for s in exp.specs:
            if args.json:
                row = {
                    "id": s.id,
                    "kind": s.kind,
                    "section": s.section,
                    "statement": s.statement,
                    "statistic": s.statistic,
                    "op": s.op,
                    "threshold": s.threshold,
                    "value": s.value,
                    "control": s.control,
                }
                print(json.dumps(row))
            else:
                kind = f" ({KIND_LABEL[s.kind]})" if s.kind != "claim" else ""
                print(f"{s.id}{kind}: {s.op} {s.value:g} ({s.threshold}) — {s.statistic}")
    return 0


def models_command(argv: Sequence[str]) -> int:
    from me_interp.loading import catalogue

    parser = ArgumentParser(
        prog="me-interp models",
        description="The models me_interp loads by name (any HF name or local directory of a "
        "supported architecture loads too)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per model")
    args = parser.parse_args(argv)
    rows = catalogue()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            about = f"  {r['about']}" if r["about"] else ""
            print(f"{r['name']:<{width}}  {r['kind']:<9}  {r['status']}{about}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``me-interp COMMAND ...`` (see the module docstring); without a command, the battery as
    ``python -m me_interp`` has always run it (``--only``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print(HELP)
        return 0
    if argv and argv[0] in COMMANDS:
        command, rest = argv[0], argv[1:]
        if command == "run":
            return battery(rest, "me-interp run", positional=True)
        return {"report": report_command, "claims": claims_command, "models": models_command}[
            command
        ](rest)
    return battery(argv, "python -m me_interp", positional=False)


if __name__ == "__main__":
    raise SystemExit(main())
