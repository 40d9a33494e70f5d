"""Input layouts beyond short prompts: chat template, BOS toggled, long and packed inputs.

Each helper turns prompts into token-id rows for one model's tokenizer (``LoadedModel.batch_from_ids``
pads them, on the right or, as batched inference does, on the left):

* :func:`chat_rows`: every prompt as the user turn after a system turn, in the tokenizer's chat
  template with the generation prompt (refused in one line for a tokenizer without one);
* :func:`bos_rows`: every row with its first token BOS, or with a leading BOS removed;
* :func:`long_row`: the prompts concatenated (blank lines between) to ``n_tokens``, one row, the
  model's BOS rule at its start (refused beyond the model's ``max_position_embeddings``);
  :func:`long_rows`: several, row ``i`` opening with prompt ``i``;
* :func:`packed_rows`: pairs of prompts joined as pre-training packs them: the first document, the
  tokenizer's EOS, BOS when the model's rule adds one, the second document;
* :func:`layout_rows`: one of :data:`LAYOUTS` by name (the conditions experiment's inputs), and
  :func:`window_note`: what a long input means for sliding-window layers;
* :func:`condition_rows`: the rows of every condition of the conditions experiment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SYSTEM = "You are a helpful assistant."
"""The system turn of :func:`chat_rows`."""


def _ids(model: Any, text: str) -> list[int]:
    return list(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def _first(model: Any, text: str) -> list[int]:
    """``text`` tokenised by the model's own rule (its BOS choice), as one row."""
    batch = model.tokenize([text])
    return batch.tokens[0, : batch.lengths[0]].tolist()


def has_chat_template(model: Any) -> bool:
    return bool(getattr(model.tokenizer, "chat_template", None))


def chat_rows(model: Any, prompts: Sequence[str], system: str = SYSTEM) -> list[list[int]]:
    """Every prompt as a chat: a system turn, the prompt as the user turn, the generation prompt.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not has_chat_template(model):
        raise ValueError(f"the tokenizer of {model.name} has no chat template: no chat condition")
    out = []
    for p in prompts:
        turns = [{"role": "system", "content": system}, {"role": "user", "content": str(p)}]
        text = model.tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=True
        )
        out.append(_ids(model, text))  # the template writes its own BOS where it has one
    return out


def bos_rows(model: Any, rows: Sequence[Sequence[int]], bos: bool) -> list[list[int]]:
    """``rows`` with BOS as first token (``bos``), or without a leading BOS.

    Raises:
        ValueError: ``bos`` and the tokenizer has no BOS token.
    """
    tid = model.bos_token_id
    if tid is None:
        if bos:
            raise ValueError(f"the tokenizer of {model.name} has no BOS token")
        return [list(r) for r in rows]
    if bos:
        return [list(r) if r[:1] == [tid] else [tid, *r] for r in rows]
    return [list(r[1:]) if r[:1] == [tid] and len(r) > 1 else list(r) for r in rows]


def long_row(model: Any, prompts: Sequence[str], n_tokens: int) -> list[int]:
    """The prompts, blank lines between (repeated as needed), cut to ``n_tokens`` tokens.

    Raises:
        ValueError: ``n_tokens`` beyond the model's context, below 2, or no prompts.
    """
    limit = model.context_length
    if limit is not None and n_tokens > limit:
        raise ValueError(
            f"{n_tokens} tokens is beyond the {limit} positions of {model.name} "
            "(max_position_embeddings)"
        )
    if n_tokens < 2 or not prompts:
        raise ValueError(f"a long input needs prompts and at least 2 tokens, got {n_tokens}")
    row = _first(model, prompts[0])
    i = 1
    while len(row) < n_tokens:
        row += _ids(model, "\n\n" + prompts[i % len(prompts)])
        i += 1
    return row[:n_tokens]


def long_rows(
    model: Any, prompts: Sequence[str], n_tokens: int, n_rows: int = 1
) -> list[list[int]]:
    """``min(n_rows, len(prompts))`` long rows (:func:`long_row`), row ``i`` opening with prompt
    ``i`` (the prompts rotated), so that the rows differ from their first prompt on."""
    k = min(n_rows, len(prompts))
    return [long_row(model, [*prompts[i:], *prompts[:i]], n_tokens) for i in range(k)]


def packed_rows(model: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Prompts ``2i`` and ``2i + 1`` packed into row ``i``: the first, EOS (and BOS where the model's
    rule starts a document with it), the second.

    Raises:
        ValueError: fewer than 2 prompts, or a tokenizer without an EOS token.
    """
    eos = getattr(model.tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(f"the tokenizer of {model.name} has no EOS token: no packed condition")
    if len(prompts) < 2:
        raise ValueError("packing needs at least 2 prompts")
    out = []
    for a, b in zip(prompts[0::2], prompts[1::2]):
        second = _first(model, b)  # the model's rule: BOS first where it adds one
        out.append([*_first(model, a), int(eos), *second])
    return out


LAYOUTS = ("as_is", "bos", "no_bos", "chat", "long", "packed")
"""The layouts :func:`layout_rows` builds."""


def layout_rows(
    model: Any, layout: str, prompts: Sequence[str], n_tokens: int = 0, n_rows: int = 1
) -> list[list[int]]:
    """The token rows of ``prompts`` in ``layout`` (:data:`LAYOUTS`; ``long``: ``n_rows`` rows of
    ``n_tokens``, :func:`long_rows`), as the model's rule tokenises them (``as_is``) or rearranged
    as above.

    Raises:
        ValueError: an unknown layout, or one this model's tokenizer cannot build (the reason).
    """
    if layout == "chat":
        return chat_rows(model, prompts)
    if layout == "packed":
        return packed_rows(model, prompts)
    if layout == "long":
        return long_rows(model, prompts, n_tokens, n_rows)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    batch = model.tokenize(prompts)
    rows = [batch.tokens[i, :n].tolist() for i, n in enumerate(batch.lengths)]
    return rows if layout == "as_is" else bos_rows(model, rows, layout == "bos")


SAME = "the rows of as_is"
"""The note of a condition whose rows are those of ``as_is`` (:func:`condition_rows`)."""


def condition_rows(
    model: Any,
    names: Sequence[str],
    prompts: Sequence[str],
    long_tokens: Sequence[int] = (),
    n_rows: int = 1,
    explicit: bool = False,
) -> list[tuple[str, list[list[int]], str]]:
    """``(name, rows, note)`` per condition (``as_is`` first, then ``names``; ``left_pad``: the rows
    of ``as_is``, to be padded on the left; ``long``: ``long_<n>`` per length of ``long_tokens``,
    each cut to the model's window, ``n_rows`` rows), before any forward. Rows ``[]``: skipped,
    the note says why; note :data:`SAME`: the rows of ``as_is`` (``bos`` where the model adds BOS).

    Raises:
        ValueError: ``explicit`` (asked for by name) and a condition this model cannot build.
    """
    limit = model.context_length or max(long_tokens, default=0)
    out: list[tuple[str, list[list[int]], str]] = []
    for name in dict.fromkeys(("as_is", *names)):
        for n in sorted({min(k, limit) for k in long_tokens}) if name == "long" else [0]:
            label = f"long_{n}" if n else name
            try:
                rows = layout_rows(model, name.replace("left_pad", "as_is"), prompts, n, n_rows)
            except ValueError as e:
                if explicit:
                    raise ValueError(f"--conditions {name}: {e}") from e
                out.append((label, [], f"skipped: {e}"))
                continue
            same = name not in ("as_is", "left_pad") and rows == out[0][1]
            out.append((label, rows, SAME if same else window_note(model, n)))
    return out


def window_note(model: Any, n_tokens: int) -> str:
    """A note where ``n_tokens`` is beyond the sliding window of the model's local layers."""
    window = getattr(model.hf.config, "sliding_window", None)
    if window and n_tokens > window:
        return f"beyond the sliding window ({window}) of the local layers"
    return ""


__all__ = [
    "LAYOUTS",
    "SAME",
    "SYSTEM",
    "bos_rows",
    "chat_rows",
    "condition_rows",
    "has_chat_template",
    "layout_rows",
    "long_row",
    "long_rows",
    "packed_rows",
    "window_note",
]
