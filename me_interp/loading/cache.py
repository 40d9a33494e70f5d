"""The cache of converted models: where it is, how a conversion is verified, and converting once.

A model me_interp converts itself (the bundled GGUF, a packaged model) is dequantised once into an
fp32 HF directory under ``$ME_INTERP_CACHE`` (default ``~/.cache/me_interp``). The directory carries a
manifest (:data:`MANIFEST`: size and SHA-256 of :data:`WEIGHTS_FILE`, and what the source was) written
last, so a crash leaves nothing trusted; :func:`verify_cache` checks it on every load, and
:func:`ensure_cache` converts under an exclusive file lock so that concurrent processes convert once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from me_interp.loading.errors import ModelLoadError

CACHE_ENV = "ME_INTERP_CACHE"
MANIFEST = "me_interp_manifest.json"
WEIGHTS_FILE = "model.safetensors"


def cache_dir() -> Path:
    """Where converted models are cached (``$ME_INTERP_CACHE``, default ``~/.cache/me_interp``)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "me_interp"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_cache(path: Path) -> bool:
    """True when ``path`` holds a complete conversion whose weights match its manifest."""
    manifest = path / MANIFEST
    weights = path / WEIGHTS_FILE
    if not (manifest.is_file() and weights.is_file() and (path / "config.json").is_file()):
        return False
    try:
        meta = json.loads(manifest.read_text())
        return (
            weights.stat().st_size == meta["size"]
            and _sha256(weights) == meta["sha256"]
            and (path / "tokenizer_config.json").is_file()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file ``path`` (created if missing) for the block.

    ``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows; the lock is released when the block ends
    or the process dies, so a crashed converter never leaves it held.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            import msvcrt
            import time

            while True:
                try:
                    msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
                    break
                except OSError:
                    time.sleep(0.1)
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF file ``gguf`` to an fp32 HF directory ``out`` (weights, config, tokenizer).

    HF transformers reads the GGUF (``gguf_file=``, needs the ``gguf`` package) into its model class
    (e.g. ``LlamaForCausalLM``, ``Gemma3ForCausalLM``) with the weights dequantised to fp32; the
    quantiser is dropped so that ``save_pretrained`` writes plain safetensors, and the config's
    ``architectures``, which a GGUF-derived config may lack (Gemma 3's does), is set to that class.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    if not getattr(hf.config, "architectures", None):
        hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(out)
    tok.save_pretrained(out)


def ensure_cache(
    target: Path, convert: Callable[[Path], Mapping[str, Any]], rebuild: bool = False
) -> Path:
    """Make ``target`` a verified converted model (converting once); return it.

    ``convert(tmp)`` writes an HF directory (``model.safetensors``, config, tokenizer) into the empty
    directory ``tmp`` and returns what the manifest should record about its source (e.g.
    ``{"source": ..., "package": ...}``); the size and SHA-256 of the weights are added here.

    Safe against concurrent converters: whoever finds no verified cache takes an exclusive lock on
    ``<cache>/<name>.lock`` and checks again under it, so one process converts and the others wait for
    it and then use its result. The conversion is written into a temporary sibling directory with the
    manifest (size + SHA-256 of the weights) written last, so a crash leaves nothing trusted; an old
    cache is renamed aside (atomic) before the new one is renamed into place (atomic), and only then
    deleted, so the target path is never a half-deleted or half-written directory.

    Args:
        target: the cache directory (its parent is created if missing).
        convert: writes the model into a directory and returns the manifest's source fields.
        rebuild: convert again even when the cache verifies (it verified but could not be loaded).
    """
    if not rebuild and verify_cache(target):
        return target
    with _exclusive_lock(target.parent / (target.name + ".lock")):
        if not rebuild and verify_cache(target):
            return target  # another process converted it while we waited
        from me_interp import terminal

        terminal.note(f"me_interp: converting {target.name} once into {target.parent} …")
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        old = None
        try:
            meta = dict(convert(tmp))
            weights = tmp / WEIGHTS_FILE
            if not weights.is_file():
                raise ModelLoadError(
                    f"conversion of {meta.get('source', target.name)} wrote no {WEIGHTS_FILE}"
                )
            meta.update(size=weights.stat().st_size, sha256=_sha256(weights))
            (tmp / MANIFEST).write_text(json.dumps(meta, indent=2))
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=target.name + ".old-", dir=target.parent))
                os.replace(target, old / target.name)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    return target


__all__ = [
    "CACHE_ENV",
    "MANIFEST",
    "WEIGHTS_FILE",
    "cache_dir",
    "convert_gguf",
    "ensure_cache",
    "verify_cache",
]
