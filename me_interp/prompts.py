"""Built-in prompts, texts and prompt files, and the statistics of a prompt set.

The built-in prompt set (``me_interp/data/prompts.txt``; contents, measured statistics and licence in
``docs/prompts.md``) holds original prompts of 16–256 tokens across prose, dialogue, code, math,
markdown lists, tables/CSV/JSON and several languages besides English. Every prompt has a *different first token* on purpose: with causal
attention the first token's state depends only on that token, so prompts sharing a first token make
cross-input comparisons trivial (paper.md §4). A parallel file, ``prompts_genres.json``, tags each prompt
with its genre. ``wemask_texts.txt`` holds the natural texts of the perplexity / KL evaluation.

A prompt file is plain text, one prompt per line (``\\n`` inside a line is a newline), or a JSON list of
strings.

**Short prompts.** Every experiment compares a token with the other tokens of its prompt, so a prompt
needs at least :data:`MIN_PROMPT_TOKENS` tokens. Whether it has them depends on the tokenizer (a
sentence without spaces is one token of a word-level tokenizer) and the BOS choice, so the prompts of an
experiment are :class:`Prompt` strings (:func:`as_prompts`, what ``CommonConfig.load_prompts`` returns),
and :meth:`me_interp.models.LoadedModel.tokenize`, the one place prompts become tokens, drops a
``Prompt`` that tokenises shorter, with a warning, and records what it dropped and kept
(``LoadedModel.prompt_filter``). Plain strings (texts, MC contexts) are never dropped: their rows stay
aligned with their inputs. When every prompt is too short, tokenising fails with a clear error.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

PROMPTS_FILE = "prompts.txt"
GENRES_FILE = "prompts_genres.json"
TEXTS_FILE = "wemask_texts.txt"
GENRES = ("prose", "dialogue", "code", "math", "markdown", "data", "non-english")
"""Genre tags of the built-in prompts (``data``: tables, CSV, TSV, YAML and JSON)."""


def _parse_lines(text: str) -> list[str]:
    return [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]


def _data_text(name: str) -> str:
    return resources.files("me_interp.data").joinpath(name).read_text(encoding="utf-8")


Item = TypeVar("Item")

MIN_PROMPT_TOKENS = 2
"""Fewest tokens (BOS included when added) an experiment prompt may have: the probes compare a token
with the *other* tokens of its prompt."""


class Prompt(str):
    """An experiment prompt: a ``str`` that remembers its place in the prompt set, and that
    :meth:`me_interp.models.LoadedModel.tokenize` drops (with a note) when it tokenises to fewer than
    :data:`MIN_PROMPT_TOKENS` tokens (see the module docstring).

    Attributes:
        index: the prompt's 0-based position in the loaded prompt set (the file's order).
    """

    index: int

    def __new__(cls, text: str, index: int = 0) -> Prompt:
        out = super().__new__(cls, text)
        out.index = int(index)
        return out

    def __reduce__(self):  # pickles (and copies) as a Prompt, with its index
        return (Prompt, (str(self), self.index))


def as_prompts(prompts: Sequence[str]) -> list[Prompt]:
    """``prompts`` as :class:`Prompt` strings, indexed by their position (what the experiments run)."""
    return [Prompt(p, i) for i, p in enumerate(prompts)]


def builtin_prompts() -> list[str]:
    """The toolkit's default prompts (different first tokens, varied genres and lengths)."""
    return _parse_lines(_data_text(PROMPTS_FILE))


def builtin_genres() -> list[str]:
    """The genre of each built-in prompt, in the order of :func:`builtin_prompts` (one of ``GENRES``).

    Raises:
        ValueError: the genre file does not match the prompt file (one tag per prompt, known tags).
    """
    genres = json.loads(_data_text(GENRES_FILE))
    n = len(builtin_prompts())
    if not isinstance(genres, list) or len(genres) != n:
        raise ValueError(f"{GENRES_FILE} must list one genre per built-in prompt ({n})")
    unknown = sorted(set(genres) - set(GENRES))
    if unknown:
        raise ValueError(f"{GENRES_FILE}: unknown genres {unknown}; known: {GENRES}")
    return genres


def builtin_texts() -> list[str]:
    """The shipped natural texts for perplexity / KL evaluation (one per line, ``\\n`` convention)."""
    return _parse_lines(_data_text(TEXTS_FILE))


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of the file ``path`` (``what`` names it in errors).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``path`` is a directory, unreadable, or not UTF-8 text.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{what} {path} is not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8"
        ) from None
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be read: {e.strerror}") from None


def read_prompts(path: str | Path) -> list[str]:
    """Read prompts from a text file (one per line) or a JSON list.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no prompts or is malformed.
    """
    path = Path(path)
    text = read_text_file(path, "prompt file")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompt file {path} is not valid JSON: {e}") from None
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise ValueError(f"{path}: a JSON prompt file must hold a list of strings")
        prompts = [p for p in data if p.strip()]
    else:
        prompts = _parse_lines(text)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


@dataclass(frozen=True)
class PromptStats:
    """Token statistics of a prompt set under one model's tokenizer and BOS choice.

    Attributes:
        n: number of prompts.
        n_first_tokens: number of distinct first tokens (``n`` when every prompt starts differently).
        min_tokens, median_tokens, mean_tokens, max_tokens: token lengths (BOS included if added).
        total_tokens: the sum of the lengths (the real tokens one forward over the set processes).
        padded_tokens: ``n × max_tokens``, the positions of one right-padded batch of the whole set.
        lengths: the length of each prompt, in order.
        genres: prompts per genre (only for the built-in set; empty otherwise).
    """

    n: int
    n_first_tokens: int
    min_tokens: int
    median_tokens: float
    mean_tokens: float
    max_tokens: int
    total_tokens: int
    padded_tokens: int
    lengths: list[int]
    genres: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


@runtime_checkable
class Tokenizes(Protocol):
    """What :func:`prompt_stats` needs of a model: ``tokenize`` (``LoadedModel.tokenize``; this
    module sits below ``me_interp.loading``, which imports :class:`Prompt` from it)."""

    def tokenize(self, prompts: Sequence[str]) -> Any: ...


def prompt_stats(model: Tokenizes, prompts: Sequence[str] | None = None) -> PromptStats:
    """Token statistics of ``prompts`` (default: the built-in set) under ``model.tokenize``.

    The first token is the one the experiments see at position 0: BOS when the model's BOS choice adds
    one (then every prompt shares it), else the prompt's own first token.

    Args:
        model: the loaded model whose tokenizer and BOS choice define the tokens.
        prompts: the prompt set; ``None``: the built-in set (then ``genres`` is filled in).

    Raises:
        ValueError: for an empty prompt list (from ``model.tokenize``).
    """
    builtin = prompts is None
    prompts = builtin_prompts() if builtin else list(prompts)
    batch = model.tokenize(prompts)
    lengths = [int(n) for n in batch.lengths]
    firsts = {int(t) for t in batch.tokens[:, 0].tolist()}
    return PromptStats(
        n=len(prompts),
        n_first_tokens=len(firsts),
        min_tokens=min(lengths),
        median_tokens=float(statistics.median(lengths)),
        mean_tokens=float(statistics.fmean(lengths)),
        max_tokens=max(lengths),
        total_tokens=sum(lengths),
        padded_tokens=len(lengths) * max(lengths),
        lengths=lengths,
        genres=dict(Counter(builtin_genres())) if builtin else {},
    )


def spread(items: Sequence[Item], n: int) -> list[Item]:
    """``n`` items spread evenly over ``items`` (first and last included; ``0`` or ``n ≥ len`` = all),
    in their order. A deterministic subsample that covers the whole set (every genre of a prompt
    file, every depth of a layer list)."""
    items = list(items)
    if n < 0:
        raise ValueError(f"n must be >= 0 (0 = all), got {n}")
    if n == 0 or n >= len(items):
        return items
    if n == 1:
        return items[:1]
    step = (len(items) - 1) / (n - 1)
    return [items[round(i * step)] for i in range(n)]
