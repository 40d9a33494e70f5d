"""What one piece of work cost: wall time and peak memory (process RSS, and CUDA when used).

``with track() as u: ...`` measures the block: ``u.seconds``, ``u.peak_rss_mib`` (the process's
resident-set peak *during the block*: on Linux the kernel's high-water mark is reset at the start by
writing ``5`` to ``/proc/self/clear_refs``; where that is not possible the process's lifetime peak
is recorded and ``rss_scope`` says so) and ``u.peak_cuda_mib`` (``torch.cuda.max_memory_allocated``
over the block, ``None`` without CUDA).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_PROC_STAT = Path("/proc/stat")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class Usage:
    """The cost of one block (see the module docstring)."""

    seconds: float = 0.0
    peak_rss_mib: float | None = None
    rss_scope: str = "block"
    peak_cuda_mib: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def status_mib(field: str) -> float | None:
    """A memory field of ``/proc/self/status`` (``VmRSS``: resident now, ``VmHWM``: its
    high-water mark) in MiB, or ``None`` where the file or the field is missing."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _hwm_mib() -> float | None:
    """The kernel's resident-set high-water mark (``VmHWM``) in MiB, or ``None``."""
    return status_mib("VmHWM")


def _reset_hwm() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _lifetime_peak_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB else


@contextlib.contextmanager
def track() -> Iterator[Usage]:
    """Measure the wall time and peak memory of the ``with`` block into the yielded :class:`Usage`."""
    import torch

    u = Usage()
    scoped = _reset_hwm() and _hwm_mib() is not None
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        yield u
    finally:
        u.seconds = time.perf_counter() - t0
        if scoped:
            u.peak_rss_mib = _hwm_mib()
        else:
            u.peak_rss_mib, u.rss_scope = _lifetime_peak_mib(), "process"
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            u.peak_cuda_mib = torch.cuda.max_memory_allocated() / 2**20


def _cpu_times() -> tuple[int, int] | None:
    """The machine's summed (idle, total) CPU jiffies from ``/proc/stat`` (``None`` elsewhere)."""
    try:
        fields = [int(x) for x in _PROC_STAT.read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])  # guest time is already counted in user


def free_cores(sample_s: float = 0.25, cores: int | None = None) -> float:
    """How many CPU cores are idle now: the idle share of ``/proc/stat``'s jiffies over
    ``sample_s`` seconds times the core count (where ``/proc/stat`` is missing: the core count minus
    the one-minute load average). Call it while this process is idle, e.g. between experiments, so
    it counts only the others' work."""
    cores = cores or os.cpu_count() or 1
    before = _cpu_times()
    if before is None:
        try:
            return max(0.0, cores - os.getloadavg()[0])
        except OSError:
            return float(cores)
    time.sleep(sample_s)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return float(cores)
    return cores * (after[0] - before[0]) / (after[1] - before[1])
