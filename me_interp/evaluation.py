"""Evaluation under interventions: perplexity of a text set with TransformerLens hooks.

``perplexity = exp( Σ −log p(x_{t+1} | x_{≤t}) / N )`` over every real next-token prediction of every
text (padding excluded), the same token count with and without hooks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from me_interp.models import Batch, LoadedModel


def token_nll(
    model: LoadedModel, batch: Batch, fwd_hooks: Sequence = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position next-token NLL ``[batch, pos-1]`` and its validity mask."""
    logits = model.run_with_hooks(batch, fwd_hooks).float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target = batch.tokens[:, 1:]
    nll = -logp.gather(-1, target[..., None])[..., 0]
    valid = batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    return nll.cpu(), valid.cpu()


def perplexity(model: LoadedModel, texts: Sequence[str] | Batch, fwd_hooks: Sequence = ()) -> float:
    """Perplexity of ``texts`` (strings or a Batch) under ``fwd_hooks``."""
    batch = texts if isinstance(texts, Batch) else model.tokenize(list(texts))
    nll, valid = token_nll(model, batch, fwd_hooks)
    if not valid.any():
        raise ValueError("perplexity needs texts with at least 2 tokens")
    return math.exp(float(nll[valid].mean()))
