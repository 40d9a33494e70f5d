"""Devices and dtypes: which devices this machine has, and the device and dtype a model loads with.

``resolve_device`` turns ``"cpu"`` / ``"cuda:1"`` / ``"mps"`` / ``None`` into a device that exists here
(``None``: CUDA when available) or a :class:`~me_interp.loading.errors.ModelLoadError` listing those
that do; ``resolve_dtype`` picks fp32 on CPU and bf16 on GPU unless told (fp16 overflows above 65504).
"""

from __future__ import annotations

import torch

from me_interp.loading.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_devices() -> list[str]:
    """The devices torch can use on this machine: ``cpu``, ``cuda:0`` … ``cuda:<n-1>``, ``mps``."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device`` that exists on this machine (``None``: CUDA when available).

    Raises:
        ModelLoadError: ``device`` is not a device string, or names a device this machine does not
            have (the message lists those it has).
    """
    if device is None:
        return default_device()
    have = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{device!r} is not a device; this machine has: {have}") from e
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            why = "this machine has no CUDA device" + (
                "" if torch.backends.cuda.is_built() else " (torch was built without CUDA)"
            )
            raise ModelLoadError(f"device {str(dev)!r} is not available: {why}; it has: {have}")
        if dev.index is not None and dev.index >= n:
            raise ModelLoadError(
                f"device {str(dev)!r} is not available: this machine has {n} CUDA device"
                f"{'s' if n > 1 else ''}; it has: {have}"
            )
        return dev
    if dev.type == "mps":
        if "mps" not in available_devices():
            raise ModelLoadError(f"device 'mps' is not available on this machine; it has: {have}")
        return dev
    backend = getattr(torch, dev.type, None)  # xpu, npu, ... where torch has such a backend
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and is_available():
        count = getattr(backend, "device_count", None)
        if dev.index is None or not callable(count) or dev.index < count():
            return dev
    raise ModelLoadError(f"device {str(dev)!r} is not available on this machine; it has: {have}")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU by default, bf16 on GPU (fp16 overflows above 65504: paper.md §4)."""
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (``cuda`` is the current CUDA device)."""

    def index(d: torch.device) -> int | None:
        if d.index is None and d.type == "cuda" and torch.cuda.is_available():
            return torch.cuda.current_device()
        return d.index

    return a.type == b.type and index(a) == index(b)


__all__ = [
    "DTYPES",
    "available_devices",
    "default_device",
    "resolve_device",
    "resolve_dtype",
    "same_device",
]
