"""Greedy generation under interventions, correct with a KV cache.

The released WeMask code masks "position 0" of every forward call. With a KV cache, a decode step
forwards only the newly generated token, so that token — not the first token of the prompt — gets
masked at every step (``paper.md`` §4). Here the HF hooks target *absolute* positions, read from the
``position_ids`` each decoder layer receives: the prompt's first token during prefill, never a
generated token. With the fix, generation with a cache equals generation without one (where every
step re-runs the whole sequence), token for token; ``positions_from="index"`` reproduces the bug.

Prompts are left-padded for batching, with ``position_ids = cumsum(attention_mask) − 1`` so that each
prompt's first real token is at absolute position 0 whatever its padding (pad slots get position 1 and
are never attended to).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from me_interp.interventions.hf_hooks import HFInterventions


@dataclass(frozen=True)
class Generation:
    """Greedy continuations: ``new_tokens[b]`` token ids after prompt ``b``, and their text."""

    prompt_tokens: list[list[int]]
    new_tokens: list[list[int]]
    texts: list[str]

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "texts": self.texts,
        }


def _cache_kwarg(hf: Any) -> str:
    params = inspect.signature(hf.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _left_pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def generate(
    model: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 16,
    specs: Sequence[Any] = (),
    *,
    use_cache: bool = True,
    positions_from: str = "absolute",
    tokenizer: Any = None,
) -> Generation:
    """Greedy generation from ``prompts`` with intervention ``specs`` applied through HF hooks.

    Args:
        model: a :class:`~me_interp.models.LoadedModel` (its tokenizer and BOS choice are used) or an
            HF causal LM (pass ``tokenizer`` or token-id rows).
        prompts: strings, or token-id rows.
        max_new_tokens: number of tokens to generate per prompt (no early stop, so rows align).
        specs: intervention specs (``WeMask.build(...)``, ``DirectionProjection.build(...)``, ...).
        use_cache: KV cache (one token per decode step) or a full re-run per step.
        positions_from: ``"absolute"`` (correct) or ``"index"`` (the released code's bug).

    Raises:
        ValueError: empty prompts or ``max_new_tokens < 1``.
    """
    from me_interp.loading.loaded import LoadedModel

    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if len(prompts) == 0:
        raise ValueError("no prompts to generate from")
    if isinstance(model, LoadedModel) and use_cache:
        raise ValueError(
            "KV-cache generation needs a plain HF model: the TransformerBridge behind a LoadedModel "
            "replaces the attention modules and does not use HF's cache correctly. Load one with "
            "me_interp.interventions.load_hf(...) or pass use_cache=False"
        )
    hf = model.hf if isinstance(model, LoadedModel) else model
    tok = model.tokenizer if isinstance(model, LoadedModel) else tokenizer
    if isinstance(prompts[0], str):
        if isinstance(model, LoadedModel):
            b = model.tokenize(list(prompts))  # type: ignore[arg-type]
            rows = [b.tokens[i, :n].tolist() for i, n in enumerate(b.lengths)]
        elif tok is None:
            raise ValueError("string prompts with an HF model need tokenizer=")
        else:
            rows = [list(tok(p)["input_ids"]) for p in prompts]
    else:
        rows = [list(map(int, r)) for r in prompts]
    if any(len(r) == 0 for r in rows):
        raise ValueError("a prompt has no tokens")
    device = next(hf.parameters()).device
    pad = 0
    if tok is not None:
        pad = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
    ids, mask = _left_pad(rows, int(pad), device)
    new: list[torch.Tensor] = []
    handle = HFInterventions(hf, list(specs), positions_from) if specs else None
    cache_kw = _cache_kwarg(hf)
    try:
        if handle is not None:
            handle.register()
        with torch.no_grad():
            if use_cache:
                out = hf(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=_positions(mask),
                    use_cache=True,
                )
                cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                for step in range(max_new_tokens):
                    nxt = out.logits[:, -1].argmax(-1)
                    new.append(nxt)
                    if step == max_new_tokens - 1:
                        break
                    pos = _positions(mask)[:, -1:] + 1
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                    out = hf(
                        input_ids=nxt[:, None],
                        attention_mask=mask,
                        position_ids=pos,
                        use_cache=True,
                        **{cache_kw: cache},
                    )
                    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            else:
                for _ in range(max_new_tokens):
                    out = hf(
                        input_ids=ids,
                        attention_mask=mask,
                        position_ids=_positions(mask),
                        use_cache=False,
                    )
                    nxt = out.logits[:, -1].argmax(-1)
                    new.append(nxt)
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    finally:
        if handle is not None:
            handle.remove()
    new_rows = torch.stack(new, dim=1).tolist()
    texts = [tok.decode(r) if tok is not None else "" for r in new_rows]
    return Generation(prompt_tokens=rows, new_tokens=new_rows, texts=texts)


__all__ = ["Generation", "generate"]
