"""Where a model's weights live when it does not fit one device: accelerate's dispatch.

``--device-map`` / ``--max-memory`` / ``--offload-folder`` (and ``load_model(device_map=...,
max_memory=..., offload_folder=...)``) become one :class:`Placement`, passed to HF's
``from_pretrained`` (a directory, a hub name, the bundled and packaged conversions) or, for a model
built in memory (``synthetic:``, an HF object), to ``accelerate.dispatch_model``. TransformerLens's
bridge leaves a dispatched model where accelerate put it and materialises offloaded weights around
each component's call (``GeneralizedComponent.__call__`` → ``align_module_device``), so forwards and
hooks work. What does not work is reading or editing a weight *outside* a forward: an offloaded
module's parameters are ``meta`` placeholders (the real values sit in accelerate's offload map, on
the CPU or on disk), so an in-place edit would not reach the forward. :func:`offloaded_modules`
names such modules; :class:`~me_interp.loading.errors.PlacementError` is what the weight accessors
(``LoadedModel.ffn_weights``, the norm weights) and every weight edit
(``me_interp.edits.core.edited_parameters``) raise for them. A map that mixes GPUs with CPU/disk
offload is refused (:func:`refuse_mixed`): TransformerLens 4.3 does not boot one.

    device_map:  "auto" | "balanced" | "balanced_low_0" | "sequential" | FILE.json ({module: device})
    max_memory:  "0=70GiB cpu=200GiB" (keys: a GPU index, "cpu", "mps"; sizes as accelerate reads
                 them: 10GiB, 500MB, 1.5GB, or bytes)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from me_interp.loading.errors import ModelLoadError, PlacementError

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The device-map strategies accelerate computes itself (a JSON file gives an explicit map)."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*$", re.IGNORECASE)
_UNIT = {
    None: 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str, flag: str = "max_memory") -> int:
    """``"70GiB"`` / ``"500MB"`` / ``"1.5GB"`` / ``"123456"`` as bytes (> 0)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(
            f"{flag}: {text!r} is not a size; write e.g. 70GiB, 500MB, 1.5GB or a number of bytes"
        )
    n = int(float(m.group(1)) * _UNIT[m.group(2).lower() if m.group(2) else None])
    if n <= 0:
        raise ValueError(f"{flag}: {text!r} must be a size above 0")
    return n


def _memory_key(key: Any, flag: str) -> int | str:
    k = str(key).strip().lower()
    if k.isdigit():
        return int(k)
    if k in ("cpu", "mps"):
        return k
    raise ValueError(
        f"{flag}: {key!r} is not a device; use a GPU index (0, 1, ...), 'cpu' or 'mps' "
        "(what does not fit goes to --offload-folder on disk)"
    )


def parse_max_memory(value: str | Sequence[str] | Mapping[Any, Any]) -> dict[int | str, int]:
    """``"0=70GiB cpu=200GiB"`` (or its words as a sequence, or a mapping) as accelerate's
    ``max_memory`` dict ``{0: bytes, "cpu": bytes}``.

    Raises:
        ValueError: a malformed entry, an unknown device, a size that is not a size, a device twice.
    """
    flag = "max_memory"
    if isinstance(value, Mapping):
        items = [(k, v) for k, v in value.items()]
    else:
        words = value.replace(",", " ").split() if isinstance(value, str) else list(value)
        words = [w for part in words for w in str(part).replace(",", " ").split()]
        if not words:
            raise ValueError(f"{flag} is empty; write e.g. '0=70GiB cpu=200GiB'")
        items = []
        for w in words:
            if w.count("=") != 1:
                raise ValueError(f"{flag}: {w!r} is not DEVICE=SIZE (e.g. 0=70GiB or cpu=200GiB)")
            items.append(tuple(w.split("=")))
    out: dict[int | str, int] = {}
    for k, v in items:
        key = _memory_key(k, flag)
        if key in out:
            raise ValueError(f"{flag}: device {key!r} is given twice")
        out[key] = v if isinstance(v, int) and v > 0 else parse_size(str(v), flag)
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
    else:
        n = 0
    gpus = [k for k in out if isinstance(k, int)]
    if gpus and max(gpus) >= n:
        raise ValueError(
            f"{flag}: GPU {max(gpus)} is not on this machine ({n} CUDA device{'s' * (n != 1)})"
        )
    return out


def parse_device_map(value: str | Path | Mapping[str, Any]) -> str | dict[str, Any]:
    """A strategy name (:data:`DEVICE_MAP_STRATEGIES`) or an explicit ``{module: device}`` map, read
    from a JSON file when ``value`` is a path (devices: a GPU index, ``"cuda:N"``, ``"cpu"``,
    ``"disk"``; ``""`` maps the whole model).

    Raises:
        ValueError: not a strategy and not a readable JSON object of module -> device.
    """
    flag = "device_map"
    if isinstance(value, Mapping):
        mapping = dict(value)
        where = "the device map"
    else:
        text = str(value)
        if text in DEVICE_MAP_STRATEGIES:
            return text
        path = Path(text).expanduser()
        if not path.suffix.lower() == ".json" and not path.is_file():
            raise ValueError(
                f"{flag}: {text!r} is neither one of {', '.join(DEVICE_MAP_STRATEGIES)} nor a JSON "
                "file of module -> device"
            )
        if not path.is_file():
            raise FileNotFoundError(f"{flag}: no such file {text!r} (a JSON map module -> device)")
        try:
            mapping = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{flag}: {text!r} is not valid JSON: {e}") from None
        where = repr(text)
        if not isinstance(mapping, dict):
            raise ValueError(f"{flag}: {where} must hold a JSON object {{module: device}}")
    if not mapping:
        raise ValueError(f'{flag}: {where} is empty; map modules to devices, e.g. {{"": 0}}')
    for module, device in mapping.items():
        if not isinstance(module, str):
            raise ValueError(f"{flag}: {where}: module names must be strings, got {module!r}")
        if isinstance(device, bool) or not isinstance(device, (int, str)):
            raise ValueError(f"{flag}: {where}: {module!r} maps to {device!r}, not a device")
        if isinstance(device, str) and device not in ("cpu", "disk"):
            try:
                torch.device(device)
            except (RuntimeError, ValueError):
                raise ValueError(
                    f"{flag}: {where}: {module!r} maps to {device!r}; use a GPU index, 'cuda:N', "
                    "'cpu' or 'disk'"
                ) from None
        if device == "meta":
            raise ValueError(f"{flag}: {where}: {module!r} maps to 'meta', which holds no weights")
    return mapping


@dataclass(frozen=True)
class Placement:
    """A parsed ``device_map`` / ``max_memory`` / ``offload_folder``. ``max_memory`` or
    ``offload_folder`` alone mean ``device_map="auto"``."""

    device_map: str | dict[str, Any] | None = None
    max_memory: dict[int | str, int] | None = None
    offload_folder: str | None = None

    @classmethod
    def parse(
        cls,
        device_map: str | Path | Mapping[str, Any] | None = None,
        max_memory: str | Sequence[str] | Mapping[Any, Any] | None = None,
        offload_folder: str | Path | None = None,
    ) -> Placement | None:
        """The placement, or ``None`` when all three are ``None`` (one device, as before)."""
        if device_map is None and max_memory is None and offload_folder is None:
            return None
        dm = "auto" if device_map is None else parse_device_map(device_map)
        mm = None if max_memory is None else parse_max_memory(max_memory)
        folder = None
        if offload_folder is not None:
            p = Path(offload_folder).expanduser()
            if p.exists() and not p.is_dir():
                raise ValueError(
                    f"offload_folder: {str(offload_folder)!r} is a file, not a directory"
                )
            try:
                p.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(
                    f"offload_folder: cannot create {str(offload_folder)!r}: {e}"
                ) from None
            folder = str(p)
        return cls(dm, mm, folder)

    def hf_kwargs(self) -> dict[str, Any]:
        """The ``from_pretrained`` keyword arguments."""
        out: dict[str, Any] = {"device_map": self.device_map}
        if self.max_memory is not None:
            out["max_memory"] = self.max_memory
        if self.offload_folder is not None:
            out["offload_folder"] = self.offload_folder
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_map": self.device_map,
            "max_memory": None
            if self.max_memory is None
            else {str(k): v for k, v in self.max_memory.items()},
            "offload_folder": self.offload_folder,
        }


def dispatch(hf: Any, placement: Placement, dtype: torch.dtype) -> Any:
    """Dispatch an HF model built in memory (``synthetic:``, an HF object) as ``from_pretrained``
    would: compute the map from ``placement`` (or take the explicit one) and let accelerate place it,
    offloading to ``placement.offload_folder`` what goes to disk."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    hf = hf.to(dtype=dtype)
    no_split = list(getattr(hf, "_no_split_modules", None) or [])
    dm = placement.device_map
    if isinstance(dm, str):
        max_memory = placement.max_memory
        if dm != "sequential":
            max_memory = get_balanced_memory(
                hf,
                max_memory=max_memory,
                no_split_module_classes=no_split,
                dtype=dtype,
                low_zero=dm == "balanced_low_0",
            )
        dm = infer_auto_device_map(
            hf, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype
        )
    if "disk" in {str(v) for v in dm.values()} and placement.offload_folder is None:
        raise ValueError(
            "offload_folder: the device map sends modules to disk; give --offload-folder DIR"
        )
    main = next((v for v in dm.values() if v not in ("cpu", "disk")), "cpu")
    try:
        return dispatch_model(
            hf, device_map=dm, main_device=main, offload_dir=placement.offload_folder
        )
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"could not dispatch the model with device map {dm}: {e}") from e


def offloaded_modules(hf: Any) -> list[str]:
    """The modules of a dispatched model whose weights are not resident (``meta`` placeholders, the
    values in accelerate's offload map on the CPU or on disk), in model order; ``[]`` when every
    weight is on a real device."""
    out = []
    for name, module in hf.named_modules():
        if any(p.device.type == "meta" for p in module.parameters(recurse=False)):
            out.append(name)
    return out


def execution_device(hf: Any) -> torch.device:
    """The device the model's input goes to: that of its input embedding (accelerate moves the
    activations between blocks; the first block's input starts there)."""
    emb = hf.get_input_embeddings()
    hook = getattr(emb, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    return next(emb.parameters()).device


def _is_gpu(device: Any) -> bool:
    return (isinstance(device, int) and not isinstance(device, bool)) or str(device).startswith(
        ("cuda", "xpu", "npu", "mps")
    )


def refuse_mixed(device_map: Mapping[str, Any]) -> None:
    """Raise :class:`PlacementError` for a map that mixes GPUs with CPU/disk offload, which
    TransformerLens 4.3 refuses to boot (``MIXED_OFFLOAD_GPU_ERROR``: verified by its authors only on
    CPU-only hardware); said here, before loading where the map is explicit, with what to do."""
    values = list(device_map.values())
    gpus = sorted({str(v) for v in values if _is_gpu(v)})
    off = sorted({str(v) for v in values if str(v) in ("cpu", "disk")})
    if gpus and off:
        raise PlacementError(
            f"the device map puts modules on GPU {', '.join(gpus)} and on {' and '.join(off)}; "
            "TransformerLens 4.3 does not boot a model that mixes GPUs with CPU/disk offload. Give "
            "the GPUs enough --max-memory for the whole model (an all-GPU map, e.g. two 80 GB GPUs "
            "for a 70B model in bf16), or run on the CPU alone (--max-memory cpu=SIZE "
            "--offload-folder DIR, no GPU index)"
        )


__all__ = [
    "DEVICE_MAP_STRATEGIES",
    "Placement",
    "dispatch",
    "execution_device",
    "offloaded_modules",
    "parse_device_map",
    "parse_max_memory",
    "parse_size",
    "refuse_mixed",
]
