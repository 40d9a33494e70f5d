"""What a public entry point that runs a forward accepts, and the one coercion to a :class:`Batch`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from me_interp.loading.loaded import Batch

Prompts = Batch | str | Sequence[str]
"""What every public entry point that runs a forward accepts: one prompt, a list of prompts, or an
already tokenised :class:`Batch` (:func:`as_batch`)."""


def as_batch(model: Any, prompts: object) -> Batch:  # anything: a clear TypeError for the rest
    """``prompts`` as a :class:`Batch`: the one coercion of every public entry point.

    Args:
        model: the :class:`LoadedModel` (or any model with ``tokenize``) that will run the batch.
        prompts: a ``str`` (one prompt, a batch of 1), a sequence of ``str`` (one row each,
            tokenised with the model's BOS choice by ``model.tokenize``), or a :class:`Batch`
            (returned as it is).

    Raises:
        TypeError: anything else (e.g. token ids: build a Batch with ``model.batch_from_ids``).
        ValueError: from ``model.tokenize`` (an empty list, an empty prompt, one too long).
    """
    if isinstance(prompts, Batch):
        return prompts
    if isinstance(prompts, str):
        return model.tokenize([prompts])
    if isinstance(prompts, Sequence) and all(isinstance(p, str) for p in prompts):
        return model.tokenize(list(prompts))
    raise TypeError(
        f"expected a str, a list of str or a Batch, got {type(prompts).__name__}"
        + (" (token ids: use model.batch_from_ids)" if isinstance(prompts, torch.Tensor) else "")
    )
