"""Attention probes: how much attention goes to given key positions (the sink), and its entropy.

For layer l, head h, prompt b, over the real query positions ``q ≥ 1`` (query 0 can only attend to
itself, so it is left out):

* ``to_positions[l, b, h] = mean_q Σ_{p∈P_b} A[q, p]`` — attention mass on the positions ``P_b``
  (default ``{0}``: the first token);
* ``entropy[l, b, h] = mean_q ( −Σ_k A[q, k] log A[q, k] )`` in nats (uniform over n keys: ``log n``).

Patterns come from ``blocks.L.attn.hook_pattern`` (eager attention), one forward, no full cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Float

from me_interp import names
from me_interp.models import Batch, LoadedModel


@dataclass(frozen=True)
class AttentionStats:
    """Per-layer, per-prompt, per-head attention statistics (see module docstring)."""

    to_positions: Float[torch.Tensor, "layer batch head"]
    entropy: Float[torch.Tensor, "layer batch head"]
    positions: list[list[int]]

    def mean_to_positions(self) -> list[float]:
        """Per layer: mean over prompts and heads of the attention mass on the positions."""
        return self.to_positions.mean((1, 2)).tolist()

    def mean_entropy(self) -> list[float]:
        return self.entropy.mean((1, 2)).tolist()


def _query_mask(batch: Batch) -> torch.Tensor:
    q = batch.attention_mask.bool().clone()
    q[:, 0] = False
    if not q.any(-1).all():
        raise ValueError("attention statistics need prompts with at least 2 tokens")
    return q


def _record(pattern, hook, *, layer, store, key_mask, qmask):
    a = pattern.detach().float()  # [batch head q k]
    to_pos = (a * key_mask[:, None, None, :]).sum(-1)  # [batch head q]
    ent = -(a * torch.log(a.clamp_min(1e-30))).sum(-1)  # [batch head q]
    qm = qmask[:, None, :].to(a.dtype)
    n = qm.sum(-1)
    store["to"][layer] = ((to_pos * qm).sum(-1) / n).cpu()
    store["ent"][layer] = ((ent * qm).sum(-1) / n).cpu()
    return pattern


def attention_stats(
    model: LoadedModel,
    batch: Batch,
    positions: Sequence[Sequence[int]] | Sequence[int] | None = None,
    fwd_hooks: Sequence = (),
) -> AttentionStats:
    """Attention mass on ``positions`` and attention entropy, per layer/prompt/head.

    Args:
        positions: ``None`` for position 0; a list of ints applied to every prompt; or one list
            per prompt.
        fwd_hooks: interventions to run in the same forward.
    """
    B, T = batch.tokens.shape
    if positions is None:
        per = [[0] for _ in range(B)]
    elif len(positions) > 0 and all(isinstance(p, int) for p in positions):
        per = [list(positions) for _ in range(B)]  # type: ignore[arg-type]
    else:
        per = [list(p) for p in positions]  # type: ignore[union-attr]
    if len(per) != B:
        raise ValueError(f"positions has {len(per)} rows for {B} prompts")
    key_mask = torch.zeros(B, T)
    for b, ps in enumerate(per):
        for p in ps:
            if not 0 <= p < batch.lengths[b]:
                raise ValueError(f"position {p} is outside prompt {b} (length {batch.lengths[b]})")
            key_mask[b, p] = 1.0
    qmask = _query_mask(batch)
    L, H = model.n_layers, model.n_heads
    store = {"to": torch.zeros(L, B, H), "ent": torch.zeros(L, B, H)}
    hooks = [
        (
            names.pattern(layer),
            partial(
                _record,
                layer=layer,
                store=store,
                key_mask=key_mask.to(model.device),
                qmask=qmask.to(model.device),
            ),
        )
        for layer in range(L)
    ]
    model.run_with_hooks(batch, [*fwd_hooks, *hooks])
    return AttentionStats(store["to"], store["ent"], per)
