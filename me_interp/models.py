"""Loading models, under the names it has always had: a facade over :mod:`me_interp.loading`.

``from me_interp.models import load_model, LoadedModel`` and ``models.X`` keep working; the code lives
in :mod:`me_interp.loading` (``load_model``, ``local_path``, ``catalogue``), one module per source
(:mod:`~me_interp.loading.bundled`, :mod:`~me_interp.loading.packaged`, :mod:`~me_interp.loading.hf`,
the registered ``synthetic:`` source :mod:`~me_interp.loading.synthetic`), the converted-model cache
and its lock (:mod:`~me_interp.loading.cache`), devices and dtypes (:mod:`~me_interp.loading.devices`)
and the loaded model with its accessors (:mod:`~me_interp.loading.loaded`).

A test that replaces a function must replace it where it is looked up, in its ``me_interp.loading``
module: replacing it here changes nothing.
"""

from __future__ import annotations

from me_interp.loading import catalogue, load_model, local_path
from me_interp.loading import synthetic as _synthetic_source
from me_interp.loading.bundled import (
    BUNDLED,
    BUNDLED_DISPLAY_NAME,
    BUNDLED_GGUF,
    BUNDLED_PACKAGE,
    BUNDLED_VERSION,
    bundled_cache_path,
    bundled_gguf_path,
    ensure_bundled_cache,
)
from me_interp.loading.cache import (
    CACHE_ENV,
    MANIFEST,
    WEIGHTS_FILE,
    cache_dir,
    convert_gguf,
    ensure_cache,
    verify_cache,
)
from me_interp.loading.devices import (
    DTYPES,
    available_devices,
    default_device,
    resolve_device,
    resolve_dtype,
)
from me_interp.loading.errors import ModelLoadError, UnsupportedArchitectureError
from me_interp.loading.hf import TOKENIZER_FILES
from me_interp.loading.loaded import BOS_CHOICES, Batch, BosChoice, FFNWeights, LoadedModel
from me_interp.loading.sources import register_source
from me_interp.loading.synthetic import SYNTHETIC_MODELS, SYNTHETIC_PREFIX

_bundled_cache_path = bundled_cache_path  # the old private names, which tests and modules use
_synthetic = _synthetic_source.build

__all__ = [
    "BOS_CHOICES",
    "BUNDLED",
    "BUNDLED_DISPLAY_NAME",
    "BUNDLED_GGUF",
    "BUNDLED_PACKAGE",
    "BUNDLED_VERSION",
    "CACHE_ENV",
    "DTYPES",
    "MANIFEST",
    "SYNTHETIC_MODELS",
    "SYNTHETIC_PREFIX",
    "TOKENIZER_FILES",
    "WEIGHTS_FILE",
    "Batch",
    "BosChoice",
    "FFNWeights",
    "LoadedModel",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "available_devices",
    "bundled_cache_path",
    "bundled_gguf_path",
    "cache_dir",
    "catalogue",
    "convert_gguf",
    "default_device",
    "ensure_bundled_cache",
    "ensure_cache",
    "load_model",
    "local_path",
    "register_source",
    "resolve_device",
    "resolve_dtype",
    "verify_cache",
]
