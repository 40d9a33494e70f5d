"""Attention probes: how much attention goes to given key positions (the sink), and its entropy.

For layer l, head h, prompt b, over the real query positions ``q ≥ 1`` (query 0 can only attend to
itself, so it is left out):

* ``to_positions[l, b, h] = mean_q Σ_{p∈P_b} A[q, p]`` — attention mass on the positions ``P_b``
  (default ``{0}``: the first token);
* ``entropy[l, b, h] = mean_q ( −Σ_k A[q, k] log A[q, k] )`` in nats (uniform over n keys: ``log n``).

Patterns come from ``blocks.L.attn.hook_pattern`` (eager attention), one forward, no full cache.

:func:`attention_probe` adds, per layer and head (paper.md §3; Gu et al. 2024, "When attention sink
emerges"):

* ``to_ref[l, b, h] = mean_{q≥1} A[q, m_b]``: mean attention to the massive token ``m_b`` of prompt ``b``
  (position 0 by default), and ``to_each[p]`` the same for each massive position ``p`` (NaN for prompts
  where ``p`` is not massive);
* sink rate ``sink_rate[l] = mean_{b,h} 1[to_ref[l, b, h] > ε]`` (ε = 0.3): the share of heads whose mean
  attention to the token exceeds ε, averaged over prompts; ``head_sink_rate[l, h]`` per head;
* BOS-attention metric ``bos[l, b, h] = mean_{q ≥ ⌊n_b/2⌋, q≥1} A[q, 0]``: mean attention from the
  second half of the queries to position 0 (``n_b`` real tokens);
* ``entropy`` as above.
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


def attention_entropy(
    pattern: Float[torch.Tensor, "*lead key"],
) -> Float[torch.Tensor, "*lead"]:
    """``−Σ_k A_k log A_k`` in nats along the last dim (``0 log 0 = 0``)."""
    a = pattern.float()
    return -(a * torch.log(a.clamp_min(1e-30))).sum(-1)


def sink_rate(
    to_token: Float[torch.Tensor, "layer batch head"], eps: float = 0.3
) -> Float[torch.Tensor, " layer"]:
    """Share of (prompt, head) pairs per layer whose mean attention to the token exceeds ``eps``."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    return (to_token > eps).float().mean((1, 2))


def head_sink_rate(
    to_token: Float[torch.Tensor, "layer batch head"], eps: float = 0.3
) -> Float[torch.Tensor, "layer head"]:
    """Per layer and head: share of prompts whose mean attention to the token exceeds ``eps``."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    return (to_token > eps).float().mean(1)


def _query_mask(batch: Batch) -> torch.Tensor:
    q = batch.attention_mask.bool().clone()
    q[:, 0] = False
    if not q.any(-1).all():
        raise ValueError("attention statistics need prompts with at least 2 tokens")
    return q


def _record(pattern, hook, *, layer, store, key_mask, qmask):
    a = pattern.detach().float()  # [batch head q k]
    to_pos = (a * key_mask[:, None, None, :]).sum(-1)  # [batch head q]
    ent = attention_entropy(a)  # [batch head q]
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


# ------------------------------------------------------------------------------------------
# sink probe
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionProbe:
    """What :func:`attention_probe` measured (see module docstring). Layers are 0-based."""

    to_ref: Float[torch.Tensor, "layer batch head"]
    to_each: dict[int, Float[torch.Tensor, "layer batch head"]]
    bos: Float[torch.Tensor, "layer batch head"]
    entropy: Float[torch.Tensor, "layer batch head"]
    reference: list[int]
    massive_positions: list[list[int]]
    eps: float

    def sink_rate(self, eps: float | None = None) -> list[float]:
        return sink_rate(self.to_ref, self.eps if eps is None else eps).tolist()

    def head_sink_rate(self, eps: float | None = None) -> list[list[float]]:
        return head_sink_rate(self.to_ref, self.eps if eps is None else eps).tolist()

    def mean_to_ref(self) -> list[float]:
        return self.to_ref.mean((1, 2)).tolist()

    def head_to_ref(self) -> list[list[float]]:
        """``[layer][head]`` mean over prompts of the attention to the massive token."""
        return self.to_ref.mean(1).tolist()

    def mean_to_each(self) -> dict[int, list[float]]:
        """Per massive position: per layer, mean over the prompts where it is massive, and heads."""
        return {p: v.nanmean((1, 2)).tolist() for p, v in self.to_each.items()}

    def mean_bos(self) -> list[float]:
        return self.bos.mean((1, 2)).tolist()

    def mean_entropy(self) -> list[float]:
        return self.entropy.mean((1, 2)).tolist()

    def head_entropy(self) -> list[list[float]]:
        return self.entropy.mean(1).tolist()


def _record_probe(pattern, hook, *, layer, store, masks, qmask, bosq):
    a = pattern.detach().float()  # [batch head q k]
    qm = qmask[:, None, :].to(a.dtype)
    n = qm.sum(-1)
    bq = bosq[:, None, :].to(a.dtype)
    for key, km in masks.items():
        mass = (a * km[:, None, None, :]).sum(-1)  # [batch head q]
        store[key][layer] = ((mass * qm).sum(-1) / n).cpu()
    store["bos"][layer] = ((a[..., 0] * bq).sum(-1) / bq.sum(-1)).cpu()
    store["ent"][layer] = ((attention_entropy(a) * qm).sum(-1) / n).cpu()
    return pattern


def attention_probe(
    model: LoadedModel,
    batch: Batch,
    reference: Sequence[int] | None = None,
    massive_positions: Sequence[Sequence[int]] | None = None,
    eps: float = 0.3,
    fwd_hooks: Sequence = (),
) -> AttentionProbe:
    """Attention to the massive token(s), sink rate, BOS metric and entropy per layer/prompt/head.

    Args:
        reference: the massive token of each prompt (``None``: position 0); sink rate uses it.
        massive_positions: every massive position of each prompt (``None``: ``[reference]``).
        eps: sink threshold ε.
        fwd_hooks: interventions to run in the same forward.

    Raises:
        ValueError: a position outside its prompt, a one-token prompt, or ``eps`` outside [0, 1).
    """
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    B, T = batch.tokens.shape
    lengths = batch.lengths
    ref = [0] * B if reference is None else [int(p) for p in reference]
    if len(ref) != B:
        raise ValueError(f"reference has {len(ref)} positions for {B} prompts")
    mpos = [[r] for r in ref] if massive_positions is None else [list(p) for p in massive_positions]
    if len(mpos) != B:
        raise ValueError(f"massive_positions has {len(mpos)} rows for {B} prompts")
    for b in range(B):
        for p in [ref[b], *mpos[b]]:
            if not 0 <= p < lengths[b]:
                raise ValueError(f"position {p} is outside prompt {b} (length {lengths[b]})")
    qmask = _query_mask(batch)
    bosq = qmask.clone()
    for b, n in enumerate(lengths):
        bosq[b, : n // 2] = False
    masks = {"ref": torch.zeros(B, T)}
    for b, r in enumerate(ref):
        masks["ref"][b, r] = 1.0
    each = sorted({p for ps in mpos for p in ps})
    for p in each:
        m = torch.zeros(B, T)
        for b, ps in enumerate(mpos):
            if p in ps:
                m[b, p] = 1.0
        masks[p] = m
    L, H = model.n_layers, model.n_heads
    store = {key: torch.zeros(L, B, H) for key in [*masks, "bos", "ent"]}
    dev = model.device
    hooks = [
        (
            names.pattern(layer),
            partial(
                _record_probe,
                layer=layer,
                store=store,
                masks={k: v.to(dev) for k, v in masks.items()},
                qmask=qmask.to(dev),
                bosq=bosq.to(dev),
            ),
        )
        for layer in range(L)
    ]
    model.run_with_hooks(batch, [*fwd_hooks, *hooks])
    to_each = {}
    for p in each:
        has = torch.tensor([p in ps for ps in mpos])
        to_each[p] = store[p].masked_fill(~has[None, :, None], float("nan"))
    return AttentionProbe(
        to_ref=store["ref"],
        to_each=to_each,
        bos=store["bos"],
        entropy=store["ent"],
        reference=ref,
        massive_positions=mpos,
        eps=eps,
    )


__all__ = [
    "AttentionProbe",
    "AttentionStats",
    "attention_entropy",
    "attention_probe",
    "attention_stats",
    "head_sink_rate",
    "sink_rate",
]
