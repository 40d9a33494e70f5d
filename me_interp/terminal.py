"""What the command line prints: compact claim lines, colour, JSON lines, quiet loading, progress bars.

The full text of a claim (:meth:`me_interp.claims.Claim.line`: statement, rule, control, per-unit
outcomes) stays in ``result.json``, ``report.md`` and ``report.html``; the terminal shows one line
per claim of at most :data:`WIDTH` characters (verdict, id, estimate [CI], n; controls and sanity
checks marked), and one summary line per experiment. Output modes (:func:`add_output_flags`):

* default — the compact lines;
* ``--verbose`` — every claim's full line;
* ``--json`` — the claims as JSON lines on stdout (one object per claim, with ``"experiment"``),
  nothing else on stdout;
* ``--quiet`` — nothing but the results: no loading line, no progress bars.

Colour only when the stream is a terminal and ``NO_COLOR`` is unset (https://no-color.org).
Progress bars (:func:`bar`) are tqdm on stderr, off when stderr is not a terminal or in quiet mode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import IO, Any

from tqdm.auto import tqdm

from me_interp import claims

WIDTH = 120
"""Most characters of one compact claim line."""
_ID_WIDTH = 43  # the longest claim id
_VERDICT_WIDTH = 12  # "inconclusive"
_ANSI = {
    claims.HOLDS: "32",  # green
    claims.FAILS: "31",  # red
    claims.INCONCLUSIVE: "33",  # yellow
    claims.NOT_APPLICABLE: "90",  # grey
}
_quiet = False


def set_quiet(quiet: bool) -> None:
    """Silence (``True``) or restore me_interp's notes and progress bars for this process."""
    global _quiet
    _quiet = bool(quiet)


def is_quiet() -> bool:
    return _quiet


def use_color(stream: Any = None) -> bool:
    """Whether to colour output to ``stream`` (default stdout): it is a terminal, ``NO_COLOR`` is
    unset or empty, and ``TERM`` is not ``dumb``."""
    stream = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, verdict: str, color: bool) -> str:
    """``text`` in the verdict's colour when ``color``."""
    code = _ANSI.get(verdict)
    return f"\033[{code}m{text}\033[0m" if color and code else text


def note(text: str) -> None:
    """One line of me_interp's own progress on stderr (nothing in quiet mode)."""
    if not _quiet:
        print(text, file=sys.stderr, flush=True)


def bar(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """A tqdm progress bar on stderr that disappears when done: off when stderr is not a terminal
    (``disable=None``) or in quiet mode."""
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, disable=True if _quiet else None, file=sys.stderr, **kwargs)


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Hide transformers' and huggingface_hub's progress bars and info logs (weight loading, GGUF
    conversion, shard writing) for the duration; restored afterwards. The GGUF conversion's bar is
    a plain ``tqdm`` that transformers' switch does not reach: it is turned off in its module."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    gguf_bar = gguf_utils.tqdm
    gguf_utils.tqdm = partial(gguf_bar, disable=True)
    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
        from huggingface_hub.utils import enable_progress_bars as enable_hub_bars

        hub_was_disabled = are_progress_bars_disabled()
        disable_progress_bars()
    except ImportError:  # pragma: no cover - huggingface_hub always comes with transformers
        hub_was_disabled, enable_hub_bars = True, None
    try:
        yield
    finally:
        gguf_utils.tqdm = gguf_bar
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if not hub_was_disabled and enable_hub_bars is not None:
            enable_hub_bars()


# ------------------------------------------------------------------------------------------
# claim and experiment lines
# ------------------------------------------------------------------------------------------


def _n_text(e: claims.Estimate, short: bool) -> str:
    n = f"n={e.n}" if short else f"n={e.n} {e.unit}"
    if e.n_eff is not None and e.n_eff != e.n:
        n += f" ({e.n_eff} distinct)"
    return n


def _fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters at a word boundary, with "…" (a word is never split)."""
    if len(text) <= width:
        return text
    cut = text[: width - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > 0 else cut).rstrip(" ,;:") + "…"


def claim_line(c: claims.Claim, color: bool = False, width: int = WIDTH) -> str:
    """One line of at most ``width`` characters: verdict, id, estimate [CI], n (with the unit when it
    fits), and ``(control)`` / ``(sanity check)`` for claims that are not counted."""
    mark = f" ({claims.KIND_LABEL[c.kind]})" if c.kind != "claim" else ""
    head = f"{c.verdict:<{_VERDICT_WIDTH}} {c.id:<{_ID_WIDTH}}"
    if c.verdict == claims.NOT_APPLICABLE or c.estimate is None:
        body = _fit(f"{head} {c.why or 'no estimate'}", width - len(mark)) + mark
    else:
        e = c.estimate
        est = f"{claims.fmt_num(e.value)} [{claims.fmt_num(e.lo)}, {claims.fmt_num(e.hi)}]"
        body = f"{head} {est:<24} {_n_text(e, short=False)}{mark}"
        if len(body) > width:
            body = f"{head} {est:<24} {_n_text(e, short=True)}{mark}"
        if len(body) > width:
            body = _fit(f"{head} {est} {_n_text(e, short=True)}", width - len(mark)) + mark
    verdict = c.verdict
    return paint(body[: len(verdict)], verdict, color) + body[len(verdict) :]


def verbose_line(c: claims.Claim) -> str:
    """The full citable line (:meth:`claims.Claim.line`), controls and sanity checks marked."""
    return (f"({claims.KIND_LABEL[c.kind]}) " if c.kind != "claim" else "") + c.line()


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width text table (floats to 3 significant digits)."""
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = lambda r: "  ".join(str(v).rjust(w) for v, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])


def fmt_seconds(s: float) -> str:
    """``s`` seconds as ``4.2 s``, ``3 min 05 s`` or ``1 h 02 min``."""
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def experiment_line(
    name: str,
    entry: Mapping[str, Any],
    color: bool = False,
) -> str:
    """One summary line for an experiment's battery entry (``status``, ``claims``, ``seconds``,
    ``peak_rss_mib``, ``why``/``error``): e.g. ``mechanism  done in 12.3 s (peak 812 MiB): 6 claims:
    3 holds, 2 fails, 1 inconclusive; 2 controls: 2 holds``."""
    status = entry.get("status", "?")
    cost = ""
    if entry.get("seconds") is not None:
        cost = f" in {fmt_seconds(entry['seconds'])}"
        if entry.get("peak_rss_mib") is not None:
            cost += f" (peak {entry['peak_rss_mib']:.0f} MiB)"
    if status == "failed":
        return _fit(
            f"{name}  {paint('FAILED', claims.FAILS, color)}{cost}: {entry.get('error')}", WIDTH
        )
    if status == claims.NOT_APPLICABLE:
        return _fit(f"{name}  not applicable{cost}: {entry.get('why')}", WIDTH)
    cs = [
        claims.Claim.from_dict(d) if isinstance(d, Mapping) else d for d in entry.get("claims", [])
    ]
    parts = []
    for kind, plural in (("claim", "claims"), ("control", "controls"), ("sanity", "sanity checks")):
        of_kind = [c for c in cs if c.kind == kind]
        if not of_kind:
            continue
        n = claims.counts(of_kind, kind)
        shown = ", ".join(paint(f"{v} {k}", k, color) for k, v in n.items() if v)
        parts.append(f"{len(of_kind)} {plural if len(of_kind) != 1 else plural[:-1]}: {shown}")
    return f"{name}  {status}{cost}: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------
# output modes
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """How results are printed: ``mode`` (``compact``, ``verbose`` or ``json``), ``quiet`` (results
    only) and ``color``."""

    mode: str = "compact"
    quiet: bool = False
    color: bool = False

    def claims(self, experiment: str, cs: Sequence[claims.Claim], stream: IO[str] | None = None):
        """Print ``cs`` of ``experiment`` in this mode."""
        stream = sys.stdout if stream is None else stream
        for c in cs:
            if self.mode == "json":
                line = json.dumps(
                    {"experiment": experiment, **c.to_dict()}, allow_nan=False, default=str
                )
            elif self.mode == "verbose":
                line = verbose_line(c)
            else:
                line = claim_line(c, color=self.color)
            tqdm.write(line, file=stream)

    def text(self, line: str, stream: IO[str] | None = None) -> None:
        """Print a line of text results (summaries, the results path): never in JSON mode, whose
        stdout holds only the claims (the line goes to stderr there unless quiet)."""
        if self.mode == "json":
            if not self.quiet:
                tqdm.write(line, file=sys.stderr)
            return
        tqdm.write(line, file=sys.stdout if stream is None else stream)


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """``--verbose``, ``--json`` (mutually exclusive) and ``--quiet``."""
    g = parser.add_argument_group("output")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--verbose", action="store_true", help="print every claim's full line")
    mode.add_argument("--json", action="store_true", help="print the claims as JSON lines")
    g.add_argument(
        "--quiet", action="store_true", help="print only the results (no loading line, no bars)"
    )


def output_from_args(args: argparse.Namespace) -> Output:
    """The :class:`Output` the flags of :func:`add_output_flags` ask for (and set quiet mode)."""
    mode = "json" if args.json else "verbose" if args.verbose else "compact"
    set_quiet(args.quiet)
    return Output(mode=mode, quiet=args.quiet, color=mode == "compact" and use_color())
