"""Real models that PyPI packages bring, loadable by a short name (``load_model("gemma-3-270m")``):
a facade over :mod:`me_interp.loading.packaged`, where they are described and converted.

A test that replaces a function must replace it in :mod:`me_interp.loading.packaged`, where it is
looked up: replacing it here changes nothing.
"""

from __future__ import annotations

from me_interp.loading.packaged import (
    GEMMA_3_270M,
    PACKAGED,
    PackagedGGUF,
    ensure_packaged_cache,
    is_packaged,
    packaged,
)

__all__ = [
    "GEMMA_3_270M",
    "PACKAGED",
    "PackagedGGUF",
    "ensure_packaged_cache",
    "is_packaged",
    "packaged",
]
