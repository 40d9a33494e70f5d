"""Writing results (atomically) and reading them back.

A run lives in ``<out>/<experiment>/<run_id>/`` and holds ``config.json``, ``env.json``,
``result.json`` and, per figure, ``<name>.html`` plus ``<name>.json`` (the plotly figure). The HTML files
load plotly.js from ``<out>/plotly.min.js``, written once, instead of embedding 3.5 MB each (a figure
copied out loads a ``plotly.min.js`` beside it, or says it needs one). Every file
is written to a temporary name in the same directory and renamed, so a crash never leaves a
half-written result; ``result.json`` is written last, so a run directory without it is incomplete.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, no_type_check

CONFIG_FILE = "config.json"
ENV_FILE = "env.json"
RESULT_FILE = "result.json"
PLOTLY_JS = "plotly.min.js"


TRANSIENT = "transient"
"""Field metadata key: a dataclass field with ``metadata={TRANSIENT: True}`` (what a run keeps in
memory for its claims, e.g. tensors) is not written by :func:`to_jsonable` and is left at its default
by :func:`from_jsonable`."""

_SCALARS = frozenset({str, int, bool, type(None)})
"""Types that are JSON values as they are (with finite floats: :func:`to_jsonable` checks these
inline, so a list of a million floats is one call, not a million)."""


@no_type_check  # ``Any -> Any``: nothing to check, and the tests' type-check hook would wrap
def to_jsonable(obj: Any) -> Any:  # every recursive call (15,000 a battery on a constructed model)
    """Convert dataclasses, tensors, numpy values, paths and non-finite floats to JSON values.

    Non-finite floats become the strings ``"inf"``, ``"-inf"``, ``"nan"`` (JSON has no such numbers).
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "to_dict"):
            return to_jsonable(obj.to_dict())
        return {
            f.name: to_jsonable(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not f.metadata.get(TRANSIENT)
        }
    if isinstance(obj, Mapping):
        return dict(zip(map(str, obj), to_jsonable(list(obj.values())), strict=True))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [
            v if type(v) in _SCALARS or (type(v) is float and math.isfinite(v)) else to_jsonable(v)
            for v in obj
        ]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return to_jsonable(obj.tolist())
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):
        return to_jsonable(obj.item())
    return str(obj)


@no_type_check  # ``(type, Any) -> Any``, recursive
def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` from what :func:`to_jsonable` wrote: the inverse for
    dataclasses (by their type hints, recursively), ``list[T]``, ``tuple[T, ...]`` / fixed tuples,
    ``dict[K, V]``, ``X | None`` and unions, and floats written as ``"nan"``/``"inf"``/``"-inf"``.

    A dataclass with a hand-written ``to_dict`` has no generic inverse: it raises ``TypeError``
    (a Result is read back only when it is written by the generic path).
    """
    if data is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return from_jsonable(options[0], data)
        for a in options:  # the first option the value fits
            try:
                return from_jsonable(a, data)
            except (TypeError, ValueError, KeyError):
                continue
        raise TypeError(f"{data!r} fits none of {tp}")
    if tp is Any or tp is object:
        return data
    if tp is float:
        if isinstance(data, str):
            return float(data)  # "nan", "inf", "-inf"
        return float(data)
    if tp in (int, str, bool):
        if not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
            raise TypeError(f"expected {tp.__name__}, got {data!r}")
        return data
    if origin in (list, Sequence, collections.abc.Sequence):
        return [from_jsonable(args[0] if args else Any, v) for v in data]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], v) for v in data)
        return tuple(from_jsonable(a, v) for a, v in zip(args, data, strict=True))
    if origin in (dict, Mapping, collections.abc.Mapping):
        k, v = args if args else (Any, Any)
        key = (lambda x: x) if k in (str, Any) else (lambda x: from_jsonable(k, json.loads(x)))
        return {key(kk): from_jsonable(v, vv) for kk, vv in data.items()}
    if typing.get_origin(tp) is typing.Literal:
        return data
    if dataclasses.is_dataclass(tp):
        if "to_dict" in vars(tp):
            raise TypeError(f"{tp.__name__} writes itself with to_dict: no generic inverse")
        hints = typing.get_type_hints(tp)
        kwargs = {f.name: from_jsonable(hints[f.name], data[f.name])
                  for f in dataclasses.fields(tp)
                  if f.init and f.name in data and not f.metadata.get(TRANSIENT)}  # fmt: skip
        return tp(**kwargs)
    return tp(data) if isinstance(tp, type) else data


def read_result(tp: type, run_dir: str | Path) -> Any:
    """The typed result of a run folder: :func:`from_jsonable` of its ``result.json``."""
    return from_jsonable(tp, read_json(Path(run_dir) / RESULT_FILE))


def check_writable(directory: str | Path) -> Path:
    """Create ``directory`` if needed and check that a file can be written in it (before any work
    is done); raises ``ValueError`` in one line otherwise."""
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-check.", dir=path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ValueError(f"out {directory} is not writable: {e.strerror or e}") from None
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def new_run_dir(out: str | Path, experiment: str) -> Path:
    """A fresh ``<out>/<experiment>/<timestamp>-<pid>`` directory."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path(out) / experiment
    base.mkdir(parents=True, exist_ok=True)
    for i in range(1000):
        run = base / (f"{stamp}-{os.getpid()}" + (f"-{i}" if i else ""))
        try:
            run.mkdir()
            return run
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run directory under {base}")  # pragma: no cover


@functools.cache
def _git_commit() -> str | None:
    """The commit of the checkout me_interp runs from, read once per process: the code loaded is
    that commit's, even when a commit lands while a long run is going (a later ``rev-parse`` would
    label its results with code that did not run)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


_git_commit()  # at import: before any run starts


def environment(model_info: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """Versions, platform, time and the model's loading choices, for ``env.json``."""
    import numpy
    import torch
    import transformers

    def version(dist: str) -> str | None:  # the installed distribution's, not an import of it
        from importlib.metadata import version as installed

        try:
            return installed(dist)
        except Exception:  # pragma: no cover
            return None

    tl_version = version("transformer-lens")
    return {
        "time_utc": datetime.now(timezone.utc).isoformat(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "me_interp": version("me_interp"),
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformer_lens": tl_version,
        "numpy": numpy.__version__,
        "cuda_available": torch.cuda.is_available(),
        "torch_threads": torch.get_num_threads(),
        **(dict(model_info) if model_info else {}),
        **extra,
    }


def write_figures(run_dir: Path, figures: Mapping[str, Any], out_root: Path | None = None) -> dict:
    """Write each plotly figure as ``<name>.html`` (plotly.js shared) and ``<name>.json``."""
    import plotly.io as pio
    import plotly.offline

    root = Path(out_root) if out_root is not None else run_dir
    js = root / PLOTLY_JS
    if not js.is_file():
        atomic_write_text(js, plotly.offline.get_plotlyjs())
    rel = os.path.relpath(js, run_dir)
    written = {}
    for name, fig in figures.items():
        html = _with_plotly_loader(pio.to_html(fig, include_plotlyjs=False, full_html=True), rel)
        atomic_write_text(run_dir / f"{name}.html", html)
        atomic_write_text(run_dir / f"{name}.json", pio.to_json(fig))
        written[name] = f"{name}.html"
    return written


def _with_plotly_loader(html: str, rel: str) -> str:
    """A figure page that loads plotly.js from ``rel`` (the run folder's shared copy) or, when the
    page was copied out, from a ``plotly.min.js`` beside it; with neither it says so in one line
    (a copied figure never renders blank and silent)."""
    load = (
        f'<script src="{rel}"></script>\n<script>window.Plotly || document.write('
        f"'<script src=\"{PLOTLY_JS}\"><\\/script>')</script>\n"
    )
    missing = (
        '<script>window.Plotly || document.write(\'<p class="no-plotly" style="font-family:'
        f'sans-serif">This figure needs plotly.js: put {PLOTLY_JS} (from the results folder) '
        "beside this file. Its data is the .json file of the same name.</p>')</script>"
    )
    return html.replace("</head>", load + "</head>", 1).replace("<body>", "<body>" + missing, 1)


def write_run(
    out: str | Path,
    experiment: str,
    config: Any,
    result: Any,
    env: Mapping[str, Any],
    figures: Mapping[str, Any] | None = None,
) -> Path:
    """Write a complete run; ``result.json`` last. Returns the run directory."""
    run_dir = new_run_dir(out, experiment)
    write_json(run_dir / CONFIG_FILE, config)
    write_json(run_dir / ENV_FILE, env)
    if figures:
        write_figures(run_dir, figures, out_root=Path(out))
    write_json(run_dir / RESULT_FILE, result)
    return run_dir


def load_run(run_dir: str | Path, result_type: type) -> Any:
    """The typed Result of a finished run: :func:`from_jsonable` of its ``result.json``
    (``me_interp.load_run(run_dir)`` finds ``result_type`` from the experiment's name).

    Raises:
        FileNotFoundError: the run is incomplete (no ``result.json``).
        ValueError: the run was not applicable (it holds no Result; the message says why).
    """
    data = read_run(run_dir)["result"]
    if isinstance(data, dict) and "not_applicable" in data:
        raise ValueError(f"{run_dir} holds no result: not applicable: {data['not_applicable']}")
    return from_jsonable(result_type, data)


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """Read a run directory back as JSON values: ``{"config", "env", "result"}`` (the result with
    its ``claims``, each a dict).

    Raises:
        FileNotFoundError: if the run is incomplete (no ``result.json``).
    """
    run_dir = Path(run_dir)
    if not (run_dir / RESULT_FILE).is_file():
        raise FileNotFoundError(f"{run_dir} holds no {RESULT_FILE}: the run did not finish")
    return {
        "config": read_json(run_dir / CONFIG_FILE),
        "env": read_json(run_dir / ENV_FILE),
        "result": read_json(run_dir / RESULT_FILE),
    }
