"""An experiment's settings: one frozen dataclass whose fields declare their own checks.

A field's checks are data, not code (:func:`checked`): a range (``ge``/``gt``/``le``/``lt``, with
``also`` for a value outside it that means "off"), a finite number, a list of ``choices``, a file
that must exist, a tuple that must be non-empty, of a given length or free of repeats. A ``Literal``
annotation is a list of choices too (said once, in the type). One function (:func:`validate`, called
by :meth:`CommonConfig.__post_init__`) applies them to every field of every config, with one wording
for each kind of error; the command line (:mod:`me_interp.study.cli`) reads the same checks
(:func:`field_checks`) for its ``choices``. A subclass's ``__post_init__`` is left with what relates
two fields or needs a library call.

    @dataclass(frozen=True)
    class Config(CommonConfig):
        max_tokens: int = checked(16, ge=2, also=(0,))  # 0 = no cut
        parts: tuple[str, ...] = checked(PART_ORDER, choices=PARTS, nonempty=True, unique=True)
        mode: Literal["difference", "direction"] = "difference"  # checked: one of the two
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from me_interp.backends import check_backend
from me_interp.loading.devices import DTYPES
from me_interp.loading.loaded import BOS_CHOICES
from me_interp.probes.massive import Criterion, CriterionKind
from me_interp.prompts import Prompt, as_prompts, builtin_prompts, read_prompts

INDEX_CONVENTION = "0-based layers (blocks.L); *_1based = L + 1"


@dataclass(frozen=True)
class Check:
    """The checks of one config field (``None``: not checked). A tuple-valued field is checked
    element by element; ``None`` as a value is never checked (it means "detected" or "default").

    ``also``: values accepted besides the range and choices (``max_tokens`` ``>= 2``, or 0 = no cut);
    ``finite``: no ``inf`` or ``nan``; ``length``: how many values a *given* tuple holds (whether it
    may be empty is ``nonempty``).
    """

    ge: int | float | None = None
    gt: int | float | None = None
    le: int | float | None = None
    lt: int | float | None = None
    choices: tuple[Any, ...] | None = None
    nonempty: bool = False
    unique: bool = False
    exists: bool = False
    finite: bool = False
    length: int | None = None
    also: tuple[Any, ...] = ()

    def errors(self, name: str, value: Any) -> str | None:
        """The first thing wrong with ``value`` of field ``name``, as one line (``None``: fine)."""
        if value is None:
            return None
        seq = isinstance(value, (tuple, list))
        items = list(value) if seq else [value]
        if seq and self.nonempty and not items:
            return f"{name} must hold at least one value"
        if seq and self.length is not None and items and len(items) != self.length:
            return f"{name} must hold {self.length} values, got {tuple(items)}"
        if seq and self.unique and len(set(items)) != len(items):
            return f"{name} repeats a value: {tuple(items)}"
        must = f"{name} must all be" if seq else f"{name} must be"
        for v in items:
            if v in self.also:
                continue
            if self.choices is not None and v not in self.choices:
                return f"unknown {name} {v!r}; choose from {', '.join(map(str, self.choices))}"
            if self.finite and not math.isfinite(v):
                return f"{must} finite, got {v!r}"
            for bound, ok, word in (
                (self.ge, lambda v, b: v >= b, ">="),
                (self.gt, lambda v, b: v > b, ">"),
                (self.le, lambda v, b: v <= b, "<="),
                (self.lt, lambda v, b: v < b, "<"),
            ):
                if bound is not None and not ok(v, bound):
                    unless = f" (or {', '.join(map(str, self.also))})" if self.also else ""
                    return f"{must} {word} {_number(bound)}{unless}, got {v!r}"
            if self.exists and not Path(v).expanduser().is_file():
                return f"{name}: no such file {v}"
        return None


def _number(x: int | float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def checked(default: Any, **checks: Any) -> Any:
    """A dataclass field with ``default`` and the :class:`Check` ``checks`` in its metadata."""
    for key in ("choices", "also"):
        if key in checks:
            checks[key] = tuple(checks[key])
    return dataclasses.field(default=default, metadata={"check": Check(**checks)})


def check_of(f: dataclasses.Field) -> Check | None:
    """The :class:`Check` a field declares, if any."""
    return f.metadata.get("check")


@functools.cache
def field_checks(config_cls: type) -> dict[str, Check]:
    """Every checked field of ``config_cls``: its declared :class:`Check`, with the choices of a
    ``Literal`` annotation (``Literal["all", "each"]``) when it declares none."""
    try:
        hints = typing.get_type_hints(config_cls)
    except NameError:  # an annotation that cannot be resolved (a class local to a function)
        hints = {}
    out = {}
    for f in dataclasses.fields(config_cls):
        check = check_of(f)
        hint = hints.get(f.name)
        if typing.get_origin(hint) is typing.Literal and (check is None or check.choices is None):
            check = dataclasses.replace(check or Check(), choices=typing.get_args(hint))
        if check is not None:
            out[f.name] = check
    return out


def validate(cfg: Any) -> None:
    """Apply every field's :class:`Check` (:func:`field_checks`) to ``cfg``; raise ``ValueError``
    on the first failure, naming the field (the command line writes it as its ``--flag``)."""
    for name, check in field_checks(type(cfg)).items():
        if err := check.errors(name, getattr(cfg, name)):
            raise ValueError(err)


@dataclass(frozen=True)
class CommonConfig:
    """Fields shared by every experiment.

    Attributes:
        model: omit (or bundled) for SmolLM2-135M-Instruct; else an HF name or local directory.
        prompts: a prompt file (one per line, or a JSON list); omit for the built-in set.
        bos: prepend BOS: auto is the tokenizer's own behaviour.
        dtype: auto is float32 on CPU, bfloat16 on GPU.
        device: cpu, cuda, cuda:1, ... (omit: CUDA when available).
        seed: seeds Python, NumPy and torch.
        out: results root; a run goes to <out>/<experiment>/<run_id>/.
        threads: torch CPU threads (None: 1 on CPU machines with at most 4 cores for a small model,
            else torch's default).
        device_map: place the model over several devices with accelerate: auto, balanced,
            balanced_low_0, sequential or a JSON file of module -> device (instead of device).
        max_memory: memory budget per device, e.g. 0=70GiB cpu=200GiB; alone: device_map auto.
        offload_folder: directory for the weights that fit no budget (created if missing); alone:
            device_map auto. Experiments that read or edit weights refuse offloaded weights.
    """

    model: str | None = None
    prompts: str | None = None
    bos: str = checked("auto", choices=BOS_CHOICES)
    dtype: str = checked("auto", choices=("auto", *sorted(DTYPES)))
    device: str | None = None
    seed: int = checked(0, ge=0, lt=2**32)
    out: str = "runs"
    threads: int | None = checked(None, ge=1)
    device_map: str | None = None
    max_memory: tuple[str, ...] | None = None
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        validate(self)
        check_placement(self)
        if self.prompts is not None:
            read_prompts(self.prompts)  # missing, unreadable, not UTF-8, malformed: said now
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"out {self.out} is a file, not a directory")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys for {cls.__name__}: {sorted(unknown)}")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**kwargs)

    def load_prompts(self) -> list[Prompt]:
        """The experiment's prompts (``prompts``, or the built-in set) as :class:`Prompt` strings:
        when tokenised, a prompt of fewer than :data:`me_interp.prompts.MIN_PROMPT_TOKENS` tokens is
        dropped with a note and the kept number recorded (``LoadedModel.prompt_filter``), so one short
        prompt under a word-level tokenizer cannot fail the experiment."""
        return as_prompts(builtin_prompts() if self.prompts is None else read_prompts(self.prompts))


@dataclass(frozen=True)
class SiteConfig(CommonConfig):
    """Fields of the experiments that intervene on the massive token at the ME layer.

    Attributes:
        layer: the ME layer (0-based) to intervene on; None: detected.
        position: the massive token p; None: the detected massive position (commonest over prompts).
    """

    layer: int | None = checked(None, ge=0)
    position: int | None = None


@dataclass(frozen=True)
class CriterionConfig(CommonConfig):
    """Fields of the experiments that detect massive activations by a criterion of their own.

    Attributes:
        criterion: massive-activation criterion (``sun``: value thresholds; ``norm``: token-norm
            ratio).
    """

    criterion: str = checked("sun", choices=get_args(CriterionKind))

    def detection(self) -> Criterion:
        return Criterion(kind=self.criterion)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DetectConfig(CriterionConfig):
    """Fields of the experiments that detect the ME layer and the massive token themselves.

    Attributes:
        criterion: massive-activation criterion of the ME-layer detection (``sun``: value
            thresholds; ``norm``: token-norm ratio).
        position: ``detected`` = the detected massive token of each prompt; ``zero`` = position 0.
        layer: the ME layer to test (0-based); ``None`` = detected. On a model without a massive
            activation the claims are not applicable unless a layer is given.
    """

    position: Literal["detected", "zero"] = "detected"
    layer: int | None = checked(None, ge=0)


@dataclass(frozen=True)
class WeightConfig(CriterionConfig):
    """Fields shared by the weight experiments.

    Attributes:
        layer: the layer to edit (0-based); ``None`` = the ME layer detected on the unedited model
            (a model without one is then "not applicable").
        n_prompts: how many prompts to use, spread evenly over the prompt set (every edit costs a
            forward pass, so the default subsamples; ``0`` = all). The result reports the number.
        max_tokens: cut every prompt to its first ``max_tokens`` tokens (the massive token is among
            the first; ``0`` = no cut).
        sink: also measure the attention sink (in the same forward pass).
    """

    layer: int | None = None
    n_prompts: int = checked(8, ge=0)
    max_tokens: int = checked(16, ge=2, also=(0,))
    sink: bool = True


@dataclass(frozen=True)
class BackendConfig(CommonConfig):
    """Fields of the experiments that also run under nnsight (:mod:`me_interp.backends`); a
    subclass describes these fields again where its nnsight path differs.

    Attributes:
        backend: ``tl`` (TransformerLens) or ``nnsight`` (a plain HF model under nnsight; the
            statistics are reduced inside the trace, ``docs/remote.md``).
        remote: with ``nnsight``: run on NDIF (key in ``NDIF_API_KEY``; the model is an HF name).
    """

    backend: Literal["tl", "nnsight"] = "tl"
    remote: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_backend(self.backend, self.remote)


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
