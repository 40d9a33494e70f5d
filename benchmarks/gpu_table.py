"""The measured table of ``docs/gpu.md``, from what ``benchmarks/gpu.sh`` wrote into its output folder.

Reads ``steps.tsv`` (each step's name, wall seconds and exit status), ``me_layer.json``
(``bench_me_layer.py --json``), ``patching.json`` (``bench_patching.py --json``), the battery states
``battery_<name>/battery.json`` and ``scan_8b.json`` (``bench_scaling.py --point scan --json``), and
writes ``<out>/gpu_table.md``; with ``--doc`` it also replaces the ``<!-- gpu-table -->`` section of
that file. A step that failed or wrote nothing is a row that says so.

    python benchmarks/gpu_table.py runs/gpu --doc docs/gpu.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sections import replace_section, table  # noqa: E402

SECTION = "gpu-table"
TABLE_FILE = "gpu_table.md"
STEPS = ("me_layer", "patching", "battery_bundled", "battery_gemma", "scan_8b")
"""The steps of gpu.sh, in order."""
BATTERIES = ("bundled", "gemma")
"""The battery steps (``battery_<key>``): the bundled model and Gemma-3-270m (``--cpu``: two
constructed models)."""


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def steps(out: Path) -> dict[str, tuple[float, int]]:
    """``{step: (seconds, exit status)}`` from ``steps.tsv``."""
    got: dict[str, tuple[float, int]] = {}
    try:
        lines = (out / "steps.tsv").read_text(encoding="utf-8").splitlines()
    except OSError:
        return got
    for line in lines:
        name, secs, rc = line.split("\t")
        got[name] = (float(secs), int(rc))
    return got


def _gib(mib: float | None) -> str:
    return "—" if mib is None else f"{mib / 1024:.2f} GiB"


def rows(out: Path) -> list[list[str]]:
    st = steps(out)
    res: list[list[str]] = []

    def row(step: str, what: str, measured: str | None) -> None:
        secs, rc = st.get(step, (None, None))
        wall = "not run" if secs is None else f"{secs:.0f} s"
        if rc not in (None, 0):
            measured = f"**failed** (exit {rc}; see {step}.log)"
        res.append([what, wall, measured or "no output"])

    me = _read(out / "me_layer.json")
    row(
        "me_layer",
        "ME-layer scan vs a plain forward"
        + (
            f" ({me['model']}, {me['dtype']}, batch {'×'.join(map(str, me['batch']))})"
            if me
            else ""
        ),
        me
        and (
            f"scan {me['median_seconds']['scan'] * 1e3:.1f} ms, HF forward "
            f"{me['median_seconds']['hf'] * 1e3:.1f} ms, without unembedding "
            f"{me['median_seconds']['blocks'] * 1e3:.1f} ms; scan / HF {me['ratio_scan_hf']:.2f}×, "
            f"scan / HF without unembedding {me['ratio_scan_blocks']:.2f}× (median of "
            f"{me['repeats']} paired runs)"
        ),
    )
    pa = _read(out / "patching.json")
    row(
        "patching",
        "batched activation patching vs transformer_lens.patching"
        + (f" ({pa['model']}, {pa['prompts']}×{pa['tokens']} tokens)" if pa else ""),
        pa
        and "; ".join(
            f"{s}: {r['seconds_skip']:.2f} s vs TL {r['tl_seconds']:.2f} s "
            f"({r['tl_seconds'] / r['seconds_skip']:.1f}×), {r['seconds_skip'] / r['floor_seconds']:.2f}× "
            f"the FLOP floor, largest difference to TL {r['max_diff_tl']:.2g}"
            for s, r in pa["sites"].items()
        ),
    )
    for key in BATTERIES:
        state = _read(out / f"battery_{key}" / "battery.json")
        measured, what = None, f"the battery ({key})"
        if state:
            what = f"the battery on {state['settings']['model'] or 'the bundled SmolLM2-135M'}"
            exps = state["experiments"].values()
            done = sum(e.get("status") in ("done", "not applicable") for e in exps)
            secs = sum(e.get("seconds", 0.0) for e in exps)
            cuda = [e["peak_cuda_mib"] for e in exps if e.get("peak_cuda_mib") is not None]
            rss = [e["peak_rss_mib"] for e in exps if e.get("peak_rss_mib") is not None]
            t = state.get("tally", {}).get("raw", {})
            measured = (
                f"{done} of {len(exps)} experiments finished, summing to {secs:.0f} s; largest "
                f"peak CUDA {_gib(max(cuda) if cuda else None)}, RSS {_gib(max(rss) if rss else None)}; "
                "claims " + ", ".join(f"{n} {v}" for v, n in t.items() if n)
            )
        row(f"battery_{key}", what, measured)
    sc = _read(out / "scan_8b.json")
    row(
        "scan_8b",
        "ME-layer scan of a config-built model"
        + (
            f" ({sc['params'] / 1e9:.2f} B parameters: d_model {sc['shape']['d_model']}, "
            f"{sc['shape']['n_layers']} layers, {sc['dtype']}, {sc['prompts']}×{sc['tokens']} tokens)"
            if sc
            else ""
        ),
        sc
        and (
            f"{sc['seconds']:.2f} s (min of {len(sc['runs'])}); weights {_gib(sc['weight_mib'])}, "
            + (
                f"CUDA peak {_gib(sc['peak_cuda_mib'])} "
                f"({_gib(sc['peak_cuda_mib'] - sc['weight_mib'])} above the weights; a cache of the "
                f"7 sites would be {_gib(sc['full_cache_mib'])})"
                if sc.get("peak_cuda_mib") is not None
                else f"peak RSS {_gib(sc['peak_rss_mib'])} (+{_gib(sc['added_mib'])} during the scan)"
            )
        ),
    )
    return res


def render(out: Path) -> str:
    env = _read(out / "env.json") or {}
    st = steps(out)
    total = sum(s for s, _ in st.values())
    head = (
        f"Measured by `benchmarks/gpu.sh{' --cpu' if env.get('mode') == 'cpu' else ''}` on "
        f"{env.get('device', 'an unrecorded device')} (torch {env.get('torch', '?')}, commit "
        f"{env.get('commit', '?')}, {env.get('date', '?')}); the steps took {total:.0f} s in all."
    )
    return head + "\n\n" + table(["step", "wall", "measured"], rows(out), "lrl") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the folder gpu.sh wrote")
    ap.add_argument(
        "--doc", default=None, help=f"replace the <!-- {SECTION} --> section of this file"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not out.is_dir():
        ap.error(f"{out} is not a folder written by benchmarks/gpu.sh")
    text = render(out)
    (out / TABLE_FILE).write_text(text, encoding="utf-8")
    print(text)
    if args.doc:
        replace_section(args.doc, SECTION, text)
    st = steps(out)
    bad = [n for n in STEPS if n not in st or st[n][1] != 0]
    if bad:
        print(f"gpu_table: steps failed or not run: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
