"""The command line of every experiment, built once from its Config.

One ``--flag`` per config field (``_`` becomes ``-``), its help from the Config's ``Attributes:``
docstring section (doc markup removed; argparse adds the default, and the choices a list flag takes),
its choices from the field's :class:`Check`; bad input is one ``error:`` line and exit 2, a bug
keeps its traceback. :func:`main` is
``python -m me_interp.experiments.<name>``: it prints a first line at once on a terminal, loads the
model, runs the experiment (:func:`me_interp.study.experiment.execute`), writes the run folder and
prints a summary and one line per claim (:mod:`me_interp.terminal`).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from me_interp import io, terminal
from me_interp.loading.errors import ModelLoadError
from me_interp.study.config import field_checks
from me_interp.study.experiment import (
    Experiment,
    apply_threads,
    execute,
    model_for,
    seed_everything,
    write_outcome,
)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(element type, is_sequence) of a field annotation such as ``int | None`` or ``tuple[float, ...]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else (str, False)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return (args[0] if args else str), True
    if origin is typing.Literal:
        return type(typing.get_args(tp)[0]), False
    return tp, False


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if s.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def field_docs(config_cls: type) -> dict[str, str]:
    """Field descriptions from the ``Attributes:`` sections of the config class docstrings (MRO)."""
    docs: dict[str, str] = {}
    for klass in reversed(config_cls.__mro__):
        text = inspect.getdoc(klass) or ""
        if "Attributes:" not in text:
            continue
        current = None
        for line in text.split("Attributes:", 1)[1].splitlines()[1:]:
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            if indent == 0:
                break
            head, sep, rest = line.strip().partition(":")
            if sep and head.isidentifier() and indent <= 4:
                current = head
                docs[current] = rest.strip()
            elif current:
                docs[current] += " " + line.strip()
    return {k: plain(v) for k, v in docs.items()}


def plain(text: str) -> str:
    """``text`` without reST markup: ``:role:`x``` and ``` ``x`` ``` become ``x``."""
    text = re.sub(r":[\w:]+:`~?([^`]*)`", r"\1", text)
    return text.replace("``", "").replace("`", "")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)", with a tuple default written as it is typed (``resid_pre
    attn_out``; ``empty`` for ``()``, ``all`` for every choice)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if isinstance(default, tuple) and action.help and "%(default)" not in action.help:
            shown = " ".join(map(str, default)) if default else "empty"
            if default and action.choices is not None and set(default) == set(action.choices):
                shown = "all"
            return f"{action.help} (default: {shown.replace('%', '%%')})"
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (``error: argument --seed: invalid int value: 'x'``, exit 2)
    instead of the whole usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def flag_names(message: str, config_cls: type) -> str:
    """``message`` with config field names written as their ``--flag`` (for the command line): a
    name with an underscore anywhere (``max_tokens``), a plain word (``seed``) only as the message's
    first word, where it is the subject (elsewhere it is prose: "holds no prompts")."""
    for f in sorted(dataclasses.fields(config_cls), key=lambda f: -len(f.name)):
        flag = "--" + f.name.replace("_", "-")
        where = r"(?<![\w-])" if "_" in f.name else "^"
        message = re.sub(rf"{where}{f.name}(?![\w-])", flag, message)
    return message


def build_parser(config_cls: type, prog: str, description: str | None = None):
    """An argparse parser with one ``--flag`` per config field (``_`` → ``-``), documented from the
    config's ``Attributes:`` docstring section, with the choices its :class:`Check` declares."""
    p = ArgumentParser(
        prog=prog,
        description=plain((description or "").strip().split("\n\n")[0]),
        formatter_class=HelpFormatter,
    )
    hints = typing.get_type_hints(config_cls)
    docs = field_docs(config_cls)
    checks = field_checks(config_cls)
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        tp, seq = _base_type(hints[f.name])
        text = docs.get(f.name) or f.name.replace("_", " ")
        kwargs: dict[str, Any] = {"default": f.default}
        choices = checks[f.name].choices if f.name in checks else None
        if choices is not None:
            kwargs["choices"] = list(choices)
            if seq:  # said once, in the help, not twice in "{a,b} [{a,b} ...]"
                kwargs["metavar"] = f.name.upper()
                if not all(re.search(rf"\b{re.escape(str(c))}\b", text) for c in choices):
                    text = f"{text} Choices: {', '.join(map(str, choices))}."  # unless all named
        kwargs["help"] = text.replace("%", "%%")
        if tp is bool:
            kwargs["type"] = _parse_bool
            kwargs["nargs"] = "?"  # --flag alone is --flag yes
            kwargs["const"] = True
        elif tp in (int, float, str):
            kwargs["type"] = tp
        if seq:
            kwargs["nargs"] = "+"
        p.add_argument(flag, dest=f.name, **kwargs)
    return p


def config_from_args(config_cls: type, args: argparse.Namespace):
    """The config the parsed flags ask for; a ``ValueError`` of its checks names the flags
    (``--max-tokens must be >= 2``)."""
    values = {}
    for f in dataclasses.fields(config_cls):
        v = getattr(args, f.name)
        if isinstance(v, list):
            v = tuple(v)
        values[f.name] = v
    try:
        return config_cls(**values)
    except ValueError as e:
        if type(e) is not ValueError:
            raise
        raise ValueError(flag_names(str(e), config_cls)).with_traceback(e.__traceback__) from None


BAD_INPUT = (ValueError, TypeError, FileNotFoundError, ModelLoadError)
"""What bad input raises (see :func:`is_bad_input`)."""


def is_bad_input(e: BaseException) -> bool:
    """Whether ``e`` reports bad input (a one-line ``error:``, exit 2) rather than a bug (traceback).

    Bad input: a :class:`ModelLoadError` or missing file, or a plain ``ValueError``/``TypeError``
    raised by me_interp's own checks (the innermost frame is in the package). A ``ValueError`` from
    inside torch, a type-check failure (a ``TypeError`` subclass from jaxtyping/beartype) or any
    other exception is a bug and keeps its traceback.
    """
    if isinstance(e, (ModelLoadError, FileNotFoundError)):
        return True
    if type(e) not in (ValueError, TypeError):
        return False
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(
        _PACKAGE
    )


_PACKAGE = Path(__file__).resolve().parents[1]


INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT), as shells expect."""


def main(exp: Experiment, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run ``exp``, write ``<out>/<name>/<run_id>/``, print a summary and one line
    per claim (:mod:`me_interp.terminal`: ``--verbose``, ``--json``, ``--quiet``).

    Returns 0 on success, also when the experiment is not applicable to the model (it says why), 2
    on bad input (with a one-line ``error:`` message on stderr: also an ``out`` that cannot be
    written, checked before the model loads), 130 on Ctrl-C (one line); any other exception
    propagates with its traceback (exit 1 from the shell).
    """
    parser = build_parser(exp.config, f"python -m me_interp.experiments.{exp.name}", exp.doc)
    terminal.add_output_flags(parser)
    args = parser.parse_args(argv)
    output = terminal.output_from_args(args)
    try:
        cfg = config_from_args(exp.config, args)
        io.check_writable(cfg.out)  # before any work
        if sys.stderr.isatty():  # the first line at once, not after the model's silent load
            terminal.note(f"{exp.name}: loading {cfg.model or 'the bundled model'} …")
        seed_everything(cfg.seed)
        model = model_for(cfg)
        apply_threads(cfg, model)
        outcome = execute(exp, cfg, model)
        run_dir = write_outcome(exp.name, cfg, model, outcome)
    except BAD_INPUT as e:
        if not is_bad_input(e):
            raise  # a bug, not bad input: the traceback, exit 1
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {exp.name} wrote no results (run it again)", file=sys.stderr)
        return INTERRUPTED
    if outcome.not_applicable is not None:
        output.text(f"not applicable to {model.name}: {outcome.not_applicable}")
    elif not output.quiet:
        output.text(exp.summary(outcome.result))
    output.claims(exp.name, outcome.claims)
    output.text(f"results: {run_dir}")
    return 0


def command(exp: Experiment) -> Callable[..., int]:
    """``main(argv=None) -> int`` of ``python -m me_interp.experiments.<name>``: :func:`main` for
    ``exp`` (an experiment module's ``main = command(EXPERIMENT)``)."""

    def run_command(argv: Sequence[str] | None = None) -> int:
        return main(exp, argv)

    run_command.__doc__ = f"The command line of {exp.name} (me_interp.study.cli.main)."
    return run_command
