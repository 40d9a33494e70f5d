"""Your own clean/corrupt pairs: read from a JSONL file, tokenised, scored by a logit metric.

One pair a line, IOI style::

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupt": "When Mary and John went to the store, Mary gave a drink to",
     "answer": " Mary", "wrong": " John"}

``answer`` (and ``wrong``) must each be one token; ``logit_diff`` needs both, ``prob`` needs
``answer``, ``kl`` neither. Clean and corrupt text of a pair must tokenise to the same length (pairs
may differ in length from each other: they are right-padded, and every logit metric reads each
pair's last real token).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from me_interp.models import Batch, LoadedModel
from me_interp.patching.metrics import AnswerProb, KLToClean, LogitDiff, PatchMetric
from me_interp.prompts import read_text_file

LOGIT_METRICS: tuple[str, ...] = ("logit_diff", "prob", "kl")
"""The logit metrics a pairs file can be scored by."""

_NEEDS = {"logit_diff": ("answer", "wrong"), "prob": ("answer",), "kl": ()}


@dataclass(frozen=True)
class Pair:
    """One line of a pairs file (``line`` is 1-based)."""

    clean: str
    corrupt: str
    answer: str | None = None
    wrong: str | None = None
    line: int = 0


def _pair(obj: object, where: str, line: int) -> Pair:
    """A :class:`Pair` from a mapping with string ``clean`` and ``corrupt`` (and optional string
    ``answer``/``wrong``); ``ValueError`` naming ``where`` otherwise."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a JSON object with 'clean' and 'corrupt'")
    for key in ("clean", "corrupt"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise ValueError(f"{where}: {key!r} must be a non-empty string")
    for key in ("answer", "wrong"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise ValueError(f"{where}: {key!r} must be a string")
    extra = set(obj) - {"clean", "corrupt", "answer", "wrong"}
    if extra:
        raise ValueError(
            f"{where}: unknown keys {sorted(extra)} (known: clean, corrupt, answer, wrong)"
        )
    return Pair(obj["clean"], obj["corrupt"], obj.get("answer"), obj.get("wrong"), line)


PairsLike = str | Path | Sequence[Pair | Mapping[str, str] | Sequence[str]]
"""Pairs as a JSONL path, or a list of :class:`Pair`, of dicts ``{"clean", "corrupt", "answer",
"wrong"}`` or of tuples ``(clean, corrupt[, answer[, wrong]])``."""


def as_pairs(pairs: PairsLike) -> list[Pair]:
    """The pairs of a JSONL file (:func:`read_pairs`) or of Python objects (:data:`PairsLike`);
    ``line`` counts the objects from 1.

    Raises:
        ValueError: a malformed pair (naming it), or no pairs at all.
    """
    if isinstance(pairs, (str, Path)):
        return read_pairs(pairs)
    out = []
    for i, obj in enumerate(pairs, 1):
        if isinstance(obj, Pair):
            out.append(obj if obj.line else Pair(obj.clean, obj.corrupt, obj.answer, obj.wrong, i))
            continue
        if isinstance(obj, (tuple, list)):
            if not 2 <= len(obj) <= 4:
                raise ValueError(f"pair {i}: a tuple is (clean, corrupt[, answer[, wrong]])")
            obj = dict(zip(("clean", "corrupt", "answer", "wrong"), obj))
        out.append(_pair(obj, f"pair {i}", i))
    if not out:
        raise ValueError("give at least one pair")
    return out


def read_pairs(path: str | Path) -> list[Pair]:
    """The pairs of a JSONL file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not UTF-8, a line that is not a JSON object with string ``clean`` and
            ``corrupt`` (and optional string ``answer``/``wrong``), or no pairs at all; the message
            names the file and the line.
    """
    text = read_text_file(path, "pairs file")
    pairs = []
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"pairs file {path}, line {i}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        pairs.append(_pair(obj, where, i))
    if not pairs:
        raise ValueError(f"pairs file {path} holds no pairs (one JSON object a line)")
    return pairs


@dataclass(frozen=True)
class PairBatch:
    """Tokenised pairs: ``clean`` and ``corrupt`` have one row per pair, the same shape and mask;
    ``answer`` / ``wrong`` are the single-token ids (``None`` when the pairs do not all give one)."""

    pairs: tuple[Pair, ...]
    clean: Batch
    corrupt: Batch
    answer: torch.Tensor | None
    wrong: torch.Tensor | None

    def __len__(self) -> int:
        return len(self.pairs)


def _one_token(model: LoadedModel, text: str, key: str, pair: Pair) -> int:
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        shown = [model.tokenizer.decode([t]) for t in ids]
        raise ValueError(
            f"pairs line {pair.line}: {key} {text!r} is {len(ids)} tokens {shown}, not one: give a "
            "single-token answer (often with its leading space)"
        )
    return int(ids[0])


def tokenize_pairs(model: LoadedModel, pairs: Sequence[Pair]) -> PairBatch:
    """Tokenise the pairs with the model's BOS choice.

    Raises:
        ValueError: a pair whose clean and corrupt text tokenise to different lengths, or an
            answer/wrong that is not one token (naming the line).
    """
    if not pairs:
        raise ValueError("give at least one pair")
    clean = model.tokenize([p.clean for p in pairs])
    corrupt = model.tokenize([p.corrupt for p in pairs])
    for p, a, b in zip(pairs, clean.lengths, corrupt.lengths):
        if a != b:
            raise ValueError(
                f"pairs line {p.line}: clean and corrupt tokenise to different lengths ({a} and "
                f"{b} tokens): patching compares the same positions, so they must match"
            )
    ids = {}
    for key in ("answer", "wrong"):
        given = [getattr(p, key) for p in pairs]
        ids[key] = (
            torch.tensor([_one_token(model, t, key, p) for t, p in zip(given, pairs)])
            if all(t is not None for t in given)
            else None
        )
    return PairBatch(tuple(pairs), clean, corrupt, ids["answer"], ids["wrong"])


def logit_metric(name: str, pb: PairBatch, clean_logits: torch.Tensor | None = None) -> PatchMetric:
    """The metric ``name`` (:data:`LOGIT_METRICS`) for the pairs ``pb``; ``kl`` needs the clean
    run's last-token logits.

    Raises:
        ValueError: an unknown name, or pairs without the answer/wrong tokens the metric needs.
    """
    if name not in LOGIT_METRICS:
        raise ValueError(f"unknown logit metric {name!r}; choose from {', '.join(LOGIT_METRICS)}")
    for key in _NEEDS[name]:
        if getattr(pb, key) is None:
            missing = next(p.line for p in pb.pairs if getattr(p, key) is None)
            raise ValueError(f"metric {name} needs {key!r} on every pair; line {missing} has none")
    if name == "logit_diff":
        return LogitDiff(pb.answer, pb.wrong)
    if name == "prob":
        return AnswerProb(pb.answer)
    if clean_logits is None:
        raise ValueError("metric kl needs the clean run's last-token logits")
    return KLToClean(clean_logits)


__all__ = [
    "LOGIT_METRICS",
    "Pair",
    "PairBatch",
    "PairsLike",
    "as_pairs",
    "logit_metric",
    "read_pairs",
    "tokenize_pairs",
]
