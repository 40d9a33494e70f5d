"""Named model sources beyond the built-in ones: ``load_model("<prefix><name>")`` goes to the loader
registered for ``<prefix>``.

A source is a prefix (e.g. ``"synthetic:"``), a ``load(name) -> (hf_model, tokenizer)`` that builds the
model on the CPU in any dtype (:func:`me_interp.loading.load_model` moves and casts it, and the whole
name is the model's name), and optionally the rows it adds to :func:`me_interp.loading.catalogue`. The
loader knows nothing else about the models behind a prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Source:
    """A registered source.

    Attributes:
        prefix: the names it loads start with this (``"synthetic:"``).
        load: ``load(name)`` with the whole name, prefix included; returns ``(hf_model, tokenizer)``.
        catalogue: the ``{"name", "kind", "status", "about"}`` rows of the models it can load.
    """

    prefix: str
    load: Callable[[str], tuple[Any, Any]]
    catalogue: Callable[[], list[dict[str, str]]] | None = None


_SOURCES: dict[str, Source] = {}


def register_source(
    prefix: str,
    load: Callable[[str], tuple[Any, Any]],
    catalogue: Callable[[], list[dict[str, str]]] | None = None,
) -> Source:
    """Make ``load_model(prefix + name)`` call ``load(prefix + name)``; registering a prefix again
    replaces its source.

    Raises:
        ValueError: an empty prefix, or one that is a prefix of another registered one (or the other
            way round), so that a name would have two sources.
    """
    if not prefix:
        raise ValueError("a source needs a non-empty prefix")
    clash = [p for p in _SOURCES if p != prefix and (p.startswith(prefix) or prefix.startswith(p))]
    if clash:
        raise ValueError(f"the prefix {prefix!r} overlaps the registered {clash[0]!r}")
    source = Source(prefix, load, catalogue)
    _SOURCES[prefix] = source
    return source


def source_for(model: Any) -> Source | None:
    """The registered source of ``model`` (a name starting with its prefix), else ``None``."""
    if not isinstance(model, str):
        return None
    return next((s for p, s in _SOURCES.items() if model.startswith(p)), None)


def sources() -> tuple[Source, ...]:
    """The registered sources, in registration order."""
    return tuple(_SOURCES.values())


__all__ = ["Source", "register_source", "source_for", "sources"]
