"""What every experiment shares: the common config fields, the command line, and the run writer.

Every experiment module defines::

    @dataclass(frozen=True)
    class Config(CommonConfig): ...                  # extra fields become --flags
    def run(cfg: Config, model=None) -> Result        # pure: no printing, no files
    def figures(result: Result) -> dict[str, go.Figure]
    def summary(result: Result) -> str                # the short table main() prints
    SPECS: tuple[claims.Spec, ...]                    # every claim, declared; claims.judge decides
    def main(argv=None) -> int:
        return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)

``run`` raises :class:`claims.NotApplicable` when the model lacks what the experiment's claims
presuppose (no massive activation): :func:`execute` then answers "not applicable" for every spec;
else it judges ``SPECS`` on the result with :func:`claims.judge`, the one place a verdict is computed.

and so shares one command-line shape: ``--model`` (default: bundled), ``--prompts`` (file), ``--bos``,
``--dtype``, ``--device``, ``--seed``, ``--out``, ``--help``, plus its own fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import random
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from me_interp import claims, io, terminal
from me_interp.loading import load_model
from me_interp.loading.attention import kernel as attention_kernel
from me_interp.loading.devices import DTYPES
from me_interp.loading.errors import ModelLoadError, PlacementError
from me_interp.loading.loaded import BOS_CHOICES, LoadedModel
from me_interp.prompts import Prompt, as_prompts, builtin_prompts, read_prompts

INDEX_CONVENTION = "0-based layers (blocks.L); *_1based = L + 1"


@dataclass(frozen=True)
class CommonConfig:
    """Fields shared by every experiment.

    Attributes:
        model: ``None``/``"bundled"`` for SmolLM2-135M-Instruct, else an HF name or local directory.
        prompts: a prompt file (one per line, or a JSON list); ``None`` for the built-in set.
        bos: ``auto`` (the tokenizer's own behaviour), ``yes`` or ``no``.
        dtype: ``auto`` (fp32 on CPU, bf16 on GPU), ``float32``, ``bfloat16`` or ``float16``.
        device: ``cpu``, ``cuda``, ... (``None``: CUDA when available).
        seed: seeds Python, NumPy and torch.
        out: results root; a run goes to ``<out>/<experiment>/<run_id>/``.
        threads: torch CPU threads (``None``: 1 on CPU machines with at most 4 cores, else torch's
            default).
        device_map: place the model over several devices with accelerate: ``auto``, ``balanced``,
            ``balanced_low_0``, ``sequential`` or a JSON file of module -> device (instead of
            ``device``; :mod:`me_interp.loading.placement`).
        max_memory: memory budget per device, e.g. ``0=70GiB cpu=200GiB``; alone: ``device_map
            auto``.
        offload_folder: directory for the weights that fit no budget (created if missing); alone:
            ``device_map auto``. Experiments that read or edit weights refuse offloaded weights.
    """

    model: str | None = None
    prompts: str | None = None
    bos: str = "auto"
    dtype: str = "auto"
    device: str | None = None
    seed: int = 0
    out: str = "runs"
    threads: int | None = None
    device_map: str | None = None
    max_memory: tuple[str, ...] | None = None
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        check_placement(self)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in 0..{2**32 - 1} (numpy's range), got {self.seed}")
        if self.prompts is not None:
            read_prompts(self.prompts)  # missing, unreadable, not UTF-8, malformed: said now
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"out {self.out} is a file, not a directory")
        if self.bos not in BOS_CHOICES:
            raise ValueError(f"bos must be one of {BOS_CHOICES}, got {self.bos!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys for {cls.__name__}: {sorted(unknown)}")
        kwargs = dict(d)
        for f in dataclasses.fields(cls):
            if f.name in kwargs and isinstance(kwargs[f.name], list):
                kwargs[f.name] = tuple(kwargs[f.name])
        return cls(**kwargs)

    def load_prompts(self) -> list[Prompt]:
        """The experiment's prompts (``prompts``, or the built-in set) as :class:`Prompt` strings:
        when tokenised, a prompt of fewer than :data:`me_interp.prompts.MIN_PROMPT_TOKENS` tokens is
        dropped with a note and the kept number recorded (``LoadedModel.prompt_filter``), so one short
        prompt under a word-level tokenizer cannot fail the experiment."""
        return as_prompts(builtin_prompts() if self.prompts is None else read_prompts(self.prompts))


@dataclass(frozen=True)
class SiteConfig(CommonConfig):
    """Fields of the experiments that intervene on the massive token at the ME layer
    (``interventions.causal.locate_massive``).

    Attributes:
        layer: the ME layer (0-based) to intervene on; ``None`` = detected.
        position: the massive token ``p``; ``None`` = the detected massive position (commonest over
            prompts).
    """

    layer: int | None = None
    position: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer is not None and self.layer < 0:
            raise ValueError(f"layer must be >= 0, got {self.layer}")


def check_choices(values: Sequence[str], allowed: Sequence[str], what: str) -> None:
    """Raise ``ValueError`` unless ``values`` is non-empty and every value is one of ``allowed``."""
    if not values:
        raise ValueError(f"give at least one {what}")
    for v in values:
        if v not in allowed:
            raise ValueError(f"unknown {what} {v!r}; choose from {', '.join(allowed)}")


SMALL_MODEL_PARAMS = 10_000_000
"""Below this many parameters a model's CPU forward is dominated by per-op overhead, not arithmetic."""


def apply_threads(cfg: CommonConfig, model: LoadedModel | None = None) -> None:
    """Set torch's CPU threads: ``cfg.threads`` if given; else, on small CPU machines (≤ 4 cores, no
    ``OMP_NUM_THREADS``), 1 thread for a small model (fewer than :data:`SMALL_MODEL_PARAMS`
    parameters, or before the model is known), where one thread measured several times faster than
    two, and every core for a larger one (measured on SmolLM2-135M with 2 cores: the WeMask sweep
    1.8× and the mechanism scan 1.5× faster than on one thread; docs/performance.md)."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
        return
    if not (
        (cfg.device or "cpu").startswith("cpu")
        and "OMP_NUM_THREADS" not in os.environ
        and (os.cpu_count() or 1) <= 4
    ):
        return
    params = 0 if model is None else sum(p.numel() for p in model.hf.parameters())
    torch.set_num_threads(1 if params < SMALL_MODEL_PARAMS else os.cpu_count() or 1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_placement(cfg: CommonConfig) -> None:
    """Raise ``ValueError`` for a bad ``device_map`` / ``max_memory`` / ``offload_folder`` (not a
    strategy or JSON map, not ``DEVICE=SIZE``, a file as folder) or one given with ``device``."""
    from me_interp.loading.placement import parse_device_map, parse_max_memory

    if cfg.device_map is not None:
        parse_device_map(cfg.device_map)
    if cfg.max_memory is not None:
        parse_max_memory(cfg.max_memory)
    if cfg.offload_folder is not None and Path(cfg.offload_folder).expanduser().is_file():
        raise ValueError(f"offload_folder {cfg.offload_folder!r} is a file, not a directory")
    if cfg.device is not None and placement_kwargs(cfg):
        raise ValueError(
            "device: give either device or a placement (device_map / max_memory / "
            "offload_folder), not both"
        )


def placement_kwargs(cfg: CommonConfig) -> dict[str, Any]:
    """The ``load_model`` placement arguments that ``cfg`` sets (``{}`` for one device)."""
    keys = ("device_map", "max_memory", "offload_folder")
    return {k: getattr(cfg, k) for k in keys if getattr(cfg, k) is not None}


def model_for(cfg: CommonConfig, model: Any = None) -> LoadedModel:
    """``model`` if given (a LoadedModel, or an HF object is not accepted here), else load ``cfg.model``;
    with ``cfg.backend == "nnsight"`` the nnsight backend's model (:mod:`me_interp.backends.nnsight`)."""
    if getattr(cfg, "backend", "tl") == "nnsight":
        from me_interp.backends.nnsight import model_for as nnsight_model_for

        return nnsight_model_for(cfg, model)  # type: ignore[return-value]
    if isinstance(model, LoadedModel):
        return model
    if model is not None:
        raise TypeError("pass a LoadedModel (me_interp.load_model(...)) or None")
    return load_model(
        cfg.model, bos=cfg.bos, dtype=cfg.dtype, device=cfg.device, **placement_kwargs(cfg)
    )


# ------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------


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
    return {k: v.replace("``", "") for k, v in docs.items()}


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
    config's ``Attributes:`` docstring section."""
    p = ArgumentParser(
        prog=prog,
        description=(description or "").strip().split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(config_cls)
    docs = field_docs(config_cls)
    helps = {
        "model": "model: omit for the bundled SmolLM2-135M-Instruct; else an HF name or local dir",
        "prompts": "prompt file (one per line, or a JSON list); omit for the built-in prompts",
        "bos": "prepend BOS: auto = the tokenizer's own behaviour",
        "dtype": "auto = float32 on CPU, bfloat16 on GPU",
        "device": "cpu, cuda, cuda:1, ... (default: cuda when available)",
        "seed": "seed for every RNG",
        "out": "results root directory",
        "threads": "torch CPU threads (default: 1 on CPUs with <= 4 cores, else torch's default)",
    }
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        tp, seq = _base_type(hints[f.name])
        text = helps.get(f.name) or docs.get(f.name) or f.name.replace("_", " ")
        kwargs: dict[str, Any] = {"default": f.default, "help": text.replace("%", "%%")}
        if f.name == "bos":
            kwargs["choices"] = list(BOS_CHOICES)
        elif f.name == "dtype":
            kwargs["choices"] = ["auto", *sorted(DTYPES)]
        if tp is bool:
            kwargs["type"] = _parse_bool
            kwargs["nargs"] = "?"  # --flag alone is --flag yes
            kwargs["const"] = True
        elif tp in (int, float, str):
            kwargs["type"] = tp
        literal = typing.get_origin(hints[f.name]) is typing.Literal
        if literal:
            kwargs["choices"] = list(typing.get_args(hints[f.name]))
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


@dataclass
class Outcome:
    """What one experiment produced: its result (``None`` when not applicable), its claims and its
    figures; ``not_applicable`` holds the reason when the experiment did not apply."""

    result: Any
    claims: list[claims.Claim]
    figures: dict[str, Any]
    not_applicable: str | None = None
    attention: str = "eager"

    def result_json(self) -> Any:
        """What ``result.json`` holds: the result's fields plus ``claims`` (every claim as a dict)."""
        body = (
            {"not_applicable": self.not_applicable}
            if self.result is None
            else io.to_jsonable(self.result)
        )
        if not isinstance(body, dict):
            body = {"result": body}
        return {**body, "claims": io.to_jsonable(self.claims)}


def execute(
    module: types.ModuleType, cfg: CommonConfig, model: LoadedModel, figures: bool = True
) -> Outcome:
    """Run experiment ``module`` (see the module docstring) with ``cfg`` on ``model``; without
    ``figures`` none are drawn (for callers that read only the claims).

    A :class:`claims.NotApplicable` raised by ``run`` becomes "not applicable" for every claim of
    ``module.SPECS``, with its message as the reason. A module whose result decides which claims
    apply (activation_patching on the user's own pairs has none) says so in ``specs_for(result)``.
    A module that reads no attention pattern declares ``ATTENTION = "sdpa"`` and runs under
    :func:`me_interp.loading.attention.kernel` (the fused kernel; recorded in ``env.json``). On a
    model with offloaded weights, an experiment that reads or edits weights is refused with a
    :class:`PlacementError` naming it.
    """
    try:
        with attention_kernel(model, getattr(module, "ATTENTION", "eager")) as attention:
            result = module.run(cfg, model)
    except claims.NotApplicable as e:
        return Outcome(None, claims.not_applicable(module.SPECS, str(e)), {}, str(e))
    except PlacementError as e:
        name = module.__name__.rsplit(".", 1)[-1]
        raise PlacementError(f"{name} is refused on {model.name} as placed: {e}") from None
    drawn = dict(module.figures(result)) if figures else {}
    specs = module.specs_for(result) if hasattr(module, "specs_for") else module.SPECS
    return Outcome(result, claims.judge(specs, result), drawn, attention=attention)


def write_outcome(name: str, cfg: CommonConfig, model: LoadedModel, outcome: Outcome) -> Path:
    """Write ``<cfg.out>/<name>/<run_id>/`` for ``outcome``; returns the run directory."""
    info = {**model.info(), "attn_implementation": outcome.attention}  # what ran (execute)
    return io.write_run(
        cfg.out, name, cfg, outcome.result_json(), io.environment(info), outcome.figures
    )


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


def cli_main(
    name: str,
    config_cls: type,
    run: Callable[..., Any],
    figures: Callable[[Any], Mapping[str, Any]] | None,
    summary: Callable[[Any], str] | None,
    argv: Sequence[str] | None = None,
    description: str | None = None,
) -> int:
    """Parse ``argv``, run the experiment, write ``<out>/<name>/<run_id>/``, print a summary and one
    line per claim (:mod:`me_interp.terminal`: ``--verbose``, ``--json``, ``--quiet``).

    The experiment module is the one that defines ``run`` (its ``SPECS`` are judged).
    Returns 0 on success, also when the experiment is not applicable to the model (it says why), and 2
    on bad input (with a one-line ``error:`` message on stderr); any other exception propagates with
    its traceback (exit 1 from the shell).
    """
    module = sys.modules[run.__module__]
    parser = build_parser(config_cls, f"python -m me_interp.experiments.{name}", description)
    terminal.add_output_flags(parser)
    args = parser.parse_args(argv)
    output = terminal.output_from_args(args)
    try:
        cfg = config_from_args(config_cls, args)
        seed_everything(cfg.seed)
        model = model_for(cfg)
        apply_threads(cfg, model)
        outcome = execute(module, cfg, model)
        run_dir = write_outcome(name, cfg, model, outcome)
    except BAD_INPUT as e:
        if not is_bad_input(e):
            raise  # a bug, not bad input: the traceback, exit 1
        print(f"error: {e}", file=sys.stderr)
        return 2
    if outcome.not_applicable is not None:
        output.text(f"not applicable to {model.name}: {outcome.not_applicable}")
    elif summary and not output.quiet:
        output.text(summary(outcome.result))
    output.claims(name, outcome.claims)
    output.text(f"results: {run_dir}")
    return 0


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width text table."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3g}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = lambda r: "  ".join(str(v).rjust(w) for v, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])
