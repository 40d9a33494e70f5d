"""Attention to one position and the norm ratio of its token, per layer, in one (edited) forward.

For the queries ``q > p`` of each prompt: the mean attention ``A[q, p]`` per layer and head, and the
attention entropy (nats) per layer (mean over heads and those queries); and the norm ratio
``R = ‖h_p‖ / mean_{t≠p}‖h_t‖`` of token ``p`` at the output of a given layer and of the last layer.
The sink-causality experiment reads it once per condition (its edits passed as ``fwd_hooks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Float

from me_interp import names
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.attention import attention_entropy
from me_interp.probes.batching import record
from me_interp.probes.norms import ratio_to_others


@dataclass(frozen=True)
class ToPosition:
    """One forward's reading of position ``p``.

    Attributes:
        attention: ``[layer, batch, head]`` mean attention of the real queries ``q > p`` to ``p``.
        entropy: ``[layer, batch]`` attention entropy (nats), mean over heads and those queries.
        ratio: ``[batch]`` norm ratio of token ``p`` at the output of the given layer.
        last_ratio: ``[batch]`` the same at the last layer.
    """

    attention: Float[torch.Tensor, "layer batch head"]
    entropy: Float[torch.Tensor, "layer batch"]
    ratio: Float[torch.Tensor, " batch"]
    last_ratio: Float[torch.Tensor, " batch"]


def _record_pattern(pattern, hook, *, store, layer, p, qmask):
    a = pattern.detach().float()  # [batch head q k]
    qm = qmask.to(a.device, a.dtype)[:, None, :]  # [batch 1 q]
    n = qm.sum(-1)
    to_p = (a[..., p] * qm).sum(-1) / n  # [batch head]
    ent = (attention_entropy(a) * qm).sum(-1) / n  # [batch head]
    store[layer] = (to_p.cpu(), ent.mean(-1).cpu())
    return pattern


def read_position(
    model: LoadedModel, batch: Batch, layer: int, p: int, fwd_hooks: Sequence = ()
) -> ToPosition:
    """One forward of ``batch`` under ``fwd_hooks`` (stopping before the unembedding): the attention
    of every layer to ``p`` and ``p``'s norm ratio at ``layer`` and the last layer."""
    q = batch.attention_mask.bool().clone()
    q[:, : p + 1] = False
    if not q.any(-1).all():
        raise ValueError(f"every prompt needs a token after position {p}")
    pats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    last = model.n_layers - 1
    hooks = [
        (names.pattern(x), partial(_record_pattern, store=pats, layer=x, p=p, qmask=q))
        for x in range(model.n_layers)
    ]
    res = Activations(model, batch, [names.resid_post(x) for x in {layer, last}])
    record(model, batch, [res], fwd_hooks=[*fwd_hooks, *hooks], last_layer=last)
    mask = batch.attention_mask.bool().cpu()
    ref = torch.full((len(batch),), p, dtype=torch.long)

    def ratio(x: int) -> torch.Tensor:
        return ratio_to_others(res[names.resid_post(x)].float().norm(dim=-1).cpu(), mask, ref)

    return ToPosition(
        attention=torch.stack([pats[x][0] for x in range(model.n_layers)]),
        entropy=torch.stack([pats[x][1] for x in range(model.n_layers)]),
        ratio=ratio(layer),
        last_ratio=ratio(last),
    )
