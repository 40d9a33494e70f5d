"""Helpers shared by the benchmark scripts: markdown tables and marked sections of a document.

A *marked section* is the text between two identical HTML comments, e.g. ``<!-- gpu-table -->`` …
``<!-- gpu-table -->``: :func:`replace_section` rewrites only that part of a file, so a generated
table can live in a document whose other paragraphs are written by hand.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A markdown table; ``align`` is one character per column (``l`` or ``r``; default: the
    first column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = [header, rule, *[[str(c) for c in r] for r in rows]]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def marker(name: str) -> str:
    return f"<!-- {name} -->"


def replace_section(path: str | Path, name: str, text: str) -> None:
    """Replace what lies between the two ``<!-- name -->`` markers of ``path`` by ``text``
    (written to a temporary file and renamed).

    Raises:
        ValueError: the file does not have exactly two such markers.
    """
    path = Path(path)
    doc = path.read_text(encoding="utf-8")
    m = marker(name)
    parts = doc.split(m)
    if len(parts) != 3:
        raise ValueError(
            f"{path} must contain the marker {m} exactly twice, found {len(parts) - 1}"
        )
    new = parts[0] + m + "\n" + text.strip("\n") + "\n" + m + parts[2]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)


def section(path: str | Path, name: str) -> str:
    """The text between the two ``<!-- name -->`` markers of ``path`` (stripped)."""
    parts = Path(path).read_text(encoding="utf-8").split(marker(name))
    if len(parts) != 3:
        raise ValueError(f"{path} must contain the marker {marker(name)} exactly twice")
    return parts[1].strip("\n")
