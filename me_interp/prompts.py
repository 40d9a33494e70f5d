"""Built-in prompts and prompt files.

The built-in set has *different first tokens* on purpose: with causal attention the first token's state
depends only on that token, so prompts sharing a first token make cross-input comparisons trivial
(paper.md §4). A prompt file is plain text, one prompt per line (``\\n`` inside a line is a newline),
or a JSON list of strings.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def _parse_lines(text: str) -> list[str]:
    return [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]


def builtin_prompts() -> list[str]:
    """The toolkit's default prompts (varied first tokens and genres)."""
    return _parse_lines(resources.files("me_interp.data").joinpath("prompts.txt").read_text())


def read_prompts(path: str | Path) -> list[str]:
    """Read prompts from a text file (one per line) or a JSON list.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no prompts or is malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise ValueError(f"{path}: a JSON prompt file must hold a list of strings")
        prompts = [p for p in data if p.strip()]
    else:
        prompts = _parse_lines(text)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts
