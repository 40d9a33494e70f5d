"""``python -m me_interp`` / ``me-interp``: the whole battery on one model and one HTML report.

    python -m me_interp                      # bundled model, every experiment, report in runs/report.html
    python -m me_interp --only me_layer mechanism --out runs/quick
    python -m me_interp --model Qwen/Qwen3-4B --device cuda --dtype bfloat16

On a model without a massive activation the mechanism experiments answer "not applicable" (with the
reason) and the battery still exits 0; it exits 1 only when an experiment crashed. An interrupted
battery resumes: re-run the same command and finished experiments are skipped
(``--fresh`` re-runs everything).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from me_interp.claims import Claim, tally_text
from me_interp.experiments.common import (
    BAD_INPUT,
    CommonConfig,
    apply_threads,
    build_parser,
    config_from_args,
    is_bad_input,
)
from me_interp.report import (
    EXPERIMENTS,
    FINISHED,
    KIND_LABEL,
    NOT_APPLICABLE,
    REPORT_FILE,
    run_battery,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(CommonConfig, "python -m me_interp", __doc__)
    parser.add_argument("--only", nargs="+", choices=EXPERIMENTS, help="run only these experiments")
    parser.add_argument("--skip", nargs="+", choices=EXPERIMENTS, default=[], help="skip these")
    parser.add_argument("--fresh", action="store_true", help="re-run experiments already finished")
    args = parser.parse_args(argv)
    chosen = [e for e in (args.only or EXPERIMENTS) if e not in args.skip]
    try:
        cfg = config_from_args(CommonConfig, args)
        apply_threads(cfg)
        state = run_battery(
            cfg,
            chosen,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            fresh=args.fresh,
        )
    except BAD_INPUT as e:
        if not is_bad_input(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = [n for n in chosen if state["experiments"].get(n, {}).get("status") not in FINISHED]
    for n in chosen:
        e = state["experiments"].get(n, {})
        if e.get("status") == NOT_APPLICABLE:
            print(f"{n:22s} not applicable: {e['why']}")
            continue
        for d in e.get("claims", []):
            c = Claim.from_dict(d)
            label = f"({KIND_LABEL[c.kind]}) " if c.kind != "claim" else ""
            print(f"{n:22s} {label}{c.line()}")
        if e.get("status") == "failed":
            print(f"{n:22s} FAILED         {e['error']}")
    if "tally" in state:
        print(tally_text(state["tally"]))
    print(f"report: {cfg.out}/{REPORT_FILE}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
