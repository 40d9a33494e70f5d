"""Attention to one position and the norm ratio of its token, per layer, in one (edited) forward.

For the queries ``q > p`` of each prompt: the mean attention ``A[q, p]`` per layer and head, and the
attention entropy (nats) per layer (mean over heads and those queries); and the norm ratio
``R = ‖h_p‖ / mean_{t≠p}‖h_t‖`` of token ``p`` at the output of a given layer and of the last layer.
The sink-causality experiment reads it once per condition (its edits passed as ``fwd_hooks``);
:func:`read_metrics` reads given metrics and the next-token NLL of one forward (component ablation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from jaxtyping import Bool, Float, Int

from me_interp import names
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.attention import attention_entropy
from me_interp.probes.batching import record
from me_interp.probes.norms import ratio_to_others


def logits_nll(
    logits: Float[torch.Tensor, "batch pos vocab"],
    tokens: Int[torch.Tensor, "batch pos"],
    mask: Int[torch.Tensor, "batch pos"] | Bool[torch.Tensor, "batch pos"],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position next-token NLL ``[batch, pos-1]`` of ``tokens`` under ``logits`` and its validity
    mask (both the predicting and the predicted token are real), on the CPU."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = tokens[:, 1:].to(logp.device)
    nll = -logp.gather(-1, target[..., None])[..., 0]
    m = mask.bool()
    valid = m[:, 1:] & m[:, :-1]
    return nll.cpu(), valid.cpu()


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


def read_metrics(
    model: LoadedModel, batch: Batch, metrics: Mapping[str, Any], fwd_hooks: Sequence = ()
) -> tuple[dict[str, list[float]], list[float], list[float]]:
    """One forward with logits under ``fwd_hooks``: every metric (a ``me_interp.patching`` metric:
    ``m(acts, mask) -> [batch]``, reading ``m.hook_names()``) per prompt, and per prompt the
    next-token NLL sum and the number of predicted tokens."""
    acts = Activations(model, batch, [n for m in metrics.values() for n in m.hook_names()])
    logits = record(model, batch, [acts], fwd_hooks=fwd_hooks, logits=True)
    nll, valid = logits_nll(logits, batch.tokens, batch.attention_mask)
    mask = batch.attention_mask.bool()
    got = {k: m(acts, mask).float().cpu().tolist() for k, m in metrics.items()}
    return got, (nll.double() * valid).sum(-1).tolist(), valid.sum(-1).double().tolist()


def sink_heads(
    attention: Float[torch.Tensor, "layer head"], first: int = 0
) -> list[tuple[int, int]]:
    """``(layer, head)`` from layer ``first`` on whose mean attention to the massive token
    (``attention``, mean over prompts) reaches the ``sink_attention`` threshold."""
    from me_interp import claims

    t = claims.threshold("sink_attention")
    n_layers, n_heads = attention.shape
    return [(x, h) for x in range(first, n_layers) for h in range(n_heads) if attention[x, h] >= t]


def heads_mean(
    attention: Float[torch.Tensor, "layer batch head"], heads: Sequence[tuple[int, int]]
) -> list[float]:
    """Per prompt, the mean of ``attention`` over ``heads`` (NaN without heads)."""
    if not heads:
        return [float("nan")] * attention.shape[1]
    return torch.stack([attention[x, :, h] for x, h in heads]).mean(0).tolist()


def sink_claims_why(
    why_not: str | None, layer: int, n_layers: int, position: int, heads: Sequence
) -> str | None:
    """Why a claim about the sink downstream of ``layer`` does not apply: no massive activation
    (``why_not``), no later layer, or no sink head (``None``: it applies)."""
    from me_interp.probes.site import no_sink_why

    if why_not is not None:
        return why_not
    if layer + 1 >= n_layers:
        return f"the ME layer {layer} is the last layer: no later layer reads the massive token"
    return None if heads else no_sink_why(layer, position)
