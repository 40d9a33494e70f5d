"""Whole activations at named hook points: the recorder to ask for when a caller needs the tensors
themselves (an intervention's input values, a statistic computed afterwards), not a statistic kept as
the forward runs.

:class:`Activations` is a :class:`~me_interp.probes.batching.Recorder`, run by
:func:`~me_interp.probes.batching.record` like every probe: what TransformerLens's ``run_with_cache``
keeps, for the names asked only, and (with ``last_layer=acts.last_layer``) no block after the last one
they are in. Run with ``max_tokens=None`` (or ``fwd_hooks``) the batch goes through as it is, in one
forward, and ``acts[name]`` is the activation of that forward, padding positions included; run in
length-sorted chunks, positions that no chunk ran (padding beyond a chunk's longest prompt) are NaN.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.batching import Chunk, Hook, block_of

_QUERY_KEY = ("hook_pattern", "hook_attn_scores")
"""Hook points whose activation is ``[batch, head, query_pos, key_pos]`` (two position axes)."""


def _pos_axes(name: str) -> tuple[int, ...]:
    return (2, 3) if name.endswith(_QUERY_KEY) else (1,)


class Activations(Mapping[str, torch.Tensor]):
    """The activations at ``hook_names`` of one forward of ``batch``, read as a mapping
    ``acts[name]`` (detached copies, on the model's device and in its dtype; ``[batch pos …]``,
    attention patterns and scores ``[batch head query_pos key_pos]``), after any ``fwd_hooks`` of
    the same forward. With ``at``, only position ``at`` of each row is kept (``[batch …]``).

    Raises:
        ValueError: no hook name, or ``at`` with a pattern or score (two position axes).
        KeyError: reading a name that did not fire (TransformerLens refuses a name that is not one
            of its hook points before the forward).
    """

    def __init__(
        self, model: LoadedModel, batch: Batch, hook_names: Sequence[str], at: int | None = None
    ) -> None:
        self.names = list(dict.fromkeys(hook_names))
        if not self.names:
            raise ValueError("give at least one hook name to record")
        if at is not None and any(len(_pos_axes(n)) > 1 for n in self.names):
            raise ValueError("at= keeps one position of [batch pos ...] activations, not patterns")
        self.model, self.at = model, at
        self.shape = (len(batch), int(batch.tokens.shape[1]))
        self._acts: dict[str, torch.Tensor] = {}

    @property
    def last_layer(self) -> int | None:
        """The last block any name is in (``record(..., last_layer=)``); ``None`` when a name is
        outside the blocks (the embedding, the final norm, the unembedding)."""
        blocks = [block_of(n) for n in self.names]
        return None if any(b is None for b in blocks) else max(blocks)  # type: ignore[type-var]

    def hooks(self, chunk: Chunk) -> list[Hook]:
        """The hooks that keep this chunk's rows (:class:`~me_interp.probes.batching.Recorder`)."""
        B, T = self.shape
        whole = len(chunk) == B and chunk.width == T and torch.equal(chunk.rows, torch.arange(B))
        return [
            (n, partial(self._keep, name=n, chunk=None if whole else chunk)) for n in self.names
        ]

    def _keep(self, x: torch.Tensor, hook: Any, *, name: str, chunk: Chunk | None) -> torch.Tensor:
        y = x.detach() if self.at is None else x.detach()[:, self.at]  # at: [batch …]
        if chunk is None:  # the batch as it is
            self._acts[name] = y.clone()
            return x
        axes = () if self.at is not None else _pos_axes(name)
        out = self._acts.get(name)
        if out is None:
            shape = [self.shape[0], *y.shape[1:]]
            for a in axes:
                shape[a] = self.shape[1]
            out = self._acts[name] = torch.full(shape, float("nan"), dtype=y.dtype, device=y.device)
        idx: list[Any] = [chunk.rows.to(y.device)] + [slice(None)] * (y.dim() - 1)
        for a in axes:
            idx[a] = slice(0, chunk.width)
        out[tuple(idx)] = y
        return x

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._acts:
            if name in self.names:
                raise KeyError(
                    f"{name!r} has not been recorded: run record(...) with this recorder"
                )
            raise KeyError(f"{name!r} is not one of the recorded names {self.names}")
        return self._acts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)


__all__ = ["Activations"]
