"""Sink heads: do the heads that attend most to the massive token carry its effect on the output?

* **Sink heads, chosen on other prompts.** The prompts are split in halves
  (:func:`me_interp.claims.halves`). On the *selection* half each head of the layers after the ME
  layer gets its clean attention to the massive position ``p`` (:func:`attention_to`: mean over the
  real queries ``q > p``); the ``k`` heads with the most are the sink heads.
* **Their outputs patched together** (``hook_z``, every position;
  :func:`me_interp.patching.heads.patch_head_sets`) into the corrupt run of the *held-out* half,
  scored by ``KL(clean ‖ patched)`` of the next-token distribution at each prompt's last real token
  and normalised on prompt means (clean = 1, corrupt = 0).
* **Against non-sink heads.** The control draws ``k`` heads, uniform without replacement, from the
  *non-sink* heads of the same layers: those not chosen whose selection-half attention to ``p`` is
  below the ``sink_attention`` threshold of :data:`me_interp.claims.THRESHOLDS`. (Random heads of
  the same layers would themselves be sink heads where most heads attend to ``p``: no contrast.)
  With fewer than ``k`` such heads the control does not apply (:attr:`SinkHeads.control_why`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from me_interp import claims, names
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.patching.attribution import attribution_sweep
from me_interp.patching.heads import patch_head_sets
from me_interp.patching.metrics import KLToClean
from me_interp.patching.suffix import gather_last
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record

SITE = "attn_head_out"
"""The per-head site patched: each head's output before ``W_O`` (``hook_z``)."""
KL = "kl"
Head = tuple[int, int]
"""A head: ``(layer, head)``, 0-based."""


def attention_to(
    model: LoadedModel, batch: Batch, layers: Sequence[int], position: int
) -> torch.Tensor:
    """Per prompt, layer of ``layers`` and head: the mean attention to ``position`` over the real
    queries after it, ``[batch, layer, head]``."""
    acts = Activations(model, batch, [names.pattern(la) for la in layers])
    record(model, batch, [acts], last_layer=acts.last_layer, max_tokens=None)
    q = batch.attention_mask.bool().cpu().clone()
    q[:, : position + 1] = False
    if not q.any(-1).all():
        raise claims.NotApplicable(f"a prompt has no token after the massive position {position}")
    qm = q.double()  # [batch q]
    out = []
    for la in layers:
        a = acts[names.pattern(la)].double().cpu()[..., position]  # [batch head q]
        out.append((a * qm[:, None]).sum(-1) / qm.sum(-1)[:, None])
    return torch.stack(out, 1)  # [batch layer head]


@dataclass(frozen=True)
class SinkHeads:
    """What the sink-heads claims are judged on (see the module docstring).

    Attributes:
        layers: the layers after the ME layer; ``n_heads``: heads per layer.
        attention: ``[prompt][layer][head]`` clean attention to ``p`` (queries after ``p``).
        select, test: the selection and held-out prompts (indices).
        top: the ``k`` sink heads, chosen on ``select``.
        pool: the non-sink heads the control draws from.
        random_sets: the control's draws, each ``k`` heads of ``pool``.
        kl_clean, kl_corrupt, kl_top: per held-out prompt ``KL(clean ‖ run)`` at the last token.
        kl_random: ``[held-out prompt][draw]``.
        single: ``[layer][head]`` normalised KL of each head patched alone, estimated by
            attribution patching (the figure only); ``None`` when not run.
        n_forwards: patched forwards run for the head sets.
    """

    layers: list[int]
    n_heads: int
    attention: list[list[list[float]]]
    select: list[int]
    test: list[int]
    top: list[Head]
    pool: list[Head]
    random_sets: list[list[Head]]
    kl_clean: list[float]
    kl_corrupt: list[float]
    kl_top: list[float]
    kl_random: list[list[float]]
    single: list[list[float]] | None
    n_forwards: int = 0

    @property
    def k(self) -> int:
        return len(self.top)

    def rows(self) -> np.ndarray:
        """Held-out prompts × ``[clean, corrupt, sink heads]`` KL."""
        return np.column_stack([self.kl_clean, self.kl_corrupt, self.kl_top]).astype(np.float64)

    def excess(self) -> np.ndarray:
        """Held-out prompts × draws: ``(KL_random − KL_sink) / (mean KL_corrupt − mean KL_clean)``."""
        rand = np.asarray(self.kl_random, dtype=np.float64).reshape(len(self.test), -1)
        top = np.asarray(self.kl_top, dtype=np.float64)[:, None]
        d = float(np.mean(self.kl_corrupt) - np.mean(self.kl_clean))
        return (rand - top) / d if d > 0 else np.full_like(rand, np.nan)

    def restore(self, kl: Sequence[float] | np.ndarray) -> float:
        """Normalised KL (clean = 1, corrupt = 0) of per-held-out-prompt ``kl``."""
        c, x = float(np.mean(self.kl_clean)), float(np.mean(self.kl_corrupt))
        return float((np.mean(kl) - x) / (c - x)) if c != x else float("nan")

    def random_restores(self) -> list[float]:
        """Each draw's restore on the held-out prompts."""
        r = np.asarray(self.kl_random, dtype=np.float64).reshape(len(self.test), -1)
        return [self.restore(r[:, s]) for s in range(r.shape[1])]

    def selection_attention(self) -> np.ndarray:
        """``[layer, head]`` mean clean attention to ``p`` over the selection prompts."""
        return np.asarray(self.attention, dtype=np.float64)[self.select].mean(0)

    @property
    def control_why(self) -> str | None:
        """Why the non-sink control does not apply (``None``: it does)."""
        if len(self.pool) < self.k:
            return (
                f"only {len(self.pool)} non-sink heads (selection attention to p below "
                f"{claims.threshold('sink_attention'):g}, threshold 'sink_attention') for "
                f"{self.k} sink heads: no random set of non-sink heads to contrast them with"
            )
        return claims.too_few_seeds(len(self.random_sets), "--n-random")

    def details(self) -> str:
        """The context printed with the sink-heads claims."""
        att = self.selection_attention()
        idx = {la: i for i, la in enumerate(self.layers)}
        top_att = [att[idx[la], h] for la, h in self.top]
        rest = att.copy()
        for la, h in self.top:
            rest[idx[la], h] = -np.inf
        rand = self.random_restores()
        out = (
            f"{self.k} sink heads of {len(self.layers) * self.n_heads} (layers {self.layers[0]}.."
            f"{self.layers[-1]}) chosen on {len(self.select)} prompts: {heads_text(self.top)} "
            f"(their attention to p {min(top_att):.3g}..{max(top_att):.3g}; the largest of the "
            f"other heads {float(rest.max()):.3g}); {len(self.pool)} non-sink heads; tested on "
            f"{len(self.test)} held-out prompts: KL(clean ‖ corrupt) {np.mean(self.kl_corrupt):.4g} "
            f"nats, with the sink heads patched {np.mean(self.kl_top):.4g} (restore "
            f"{self.restore(self.kl_top):.3g})"
        )
        if rand:
            out += (
                f"; {len(rand)} draws of non-sink heads restore {np.mean(rand):.3g} on average "
                f"({min(rand):.3g}..{max(rand):.3g})"
            )
        return out


def heads_text(heads: Sequence[Head], limit: int = 8) -> str:
    """``L3h0, L4h0, …`` (at most ``limit`` shown)."""
    shown = ", ".join(f"L{la}h{h}" for la, h in heads[:limit])
    return shown + (f", … ({len(heads)} heads)" if len(heads) > limit else "")


def non_sink_pool(att: np.ndarray, layers: Sequence[int], top: Sequence[Head]) -> list[Head]:
    """The heads of ``att`` (``[layer, head]`` selection attention) that are not in ``top`` and
    attend to ``p`` below the ``sink_attention`` threshold."""
    cut, chosen = claims.threshold("sink_attention"), set(top)
    return [
        (la, h)
        for i, la in enumerate(layers)
        for h in range(att.shape[1])
        if (la, h) not in chosen and att[i, h] < cut
    ]


def draw_random(pool: Sequence[Head], k: int, n: int, seed: int) -> list[list[Head]]:
    """``n`` seeded draws of ``k`` heads of ``pool``, uniform without replacement (none when the
    pool has fewer than ``k``)."""
    if len(pool) < k:
        return []
    rng = np.random.default_rng(seed)
    return [sorted(pool[int(i)] for i in rng.choice(len(pool), k, replace=False)) for _ in range(n)]


def measure(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    corrupt_hooks: Sequence,
    corrupt_for: Callable[[Batch], tuple[Batch, Sequence]],
    layer: int,
    position: int,
    *,
    k: int | None = None,
    n_random: int = 10,
    seed: int = 0,
    batch_size: int = 64,
    single: bool = True,
) -> SinkHeads:
    """The sink-heads measurement at the ME layer ``layer`` and massive position ``position``, on
    the clean/corrupt pair (``corrupt``, ``corrupt_hooks``: the attribution figure) and the
    corruption of any sub-batch (``corrupt_for``: the held-out prompts, on which alone the head
    sets are patched); ``k``: how many sink heads (``None``: one per layer after ``layer``).

    Raises:
        claims.NotApplicable: no layer after ``layer``; fewer than 4 prompts; ``k`` covers every
            head of the layers after ``layer``.
    """
    layers = list(range(layer + 1, model.n_layers))
    if not layers:
        raise claims.NotApplicable(f"the ME layer {layer} is the last layer: no head after it")
    B = int(clean.tokens.shape[0])
    if B < 4:
        raise claims.NotApplicable(f"the held-out test needs at least 4 prompts, got {B}")
    att = attention_to(model, clean, layers, position)  # [B layer head]
    H = int(att.shape[-1])
    k = len(layers) if k is None else int(k)
    if not 1 <= k < len(layers) * H:
        raise claims.NotApplicable(
            f"{k} sink heads of the {len(layers) * H} heads after the ME layer: no other head "
            "is left to compare them with"
        )
    select, test = claims.halves(B, seed)
    sel = att[torch.as_tensor(select)].mean(0)  # [layer head]
    order = torch.argsort(sel.flatten(), descending=True, stable=True)[:k].tolist()
    top = sorted((layers[i // H], i % H) for i in order)
    pool = non_sink_pool(sel.numpy(), layers, top)
    randoms = draw_random(pool, k, n_random, seed)
    held = Batch(clean.tokens[test], clean.attention_mask[test], None)
    held_corrupt, held_hooks = corrupt_for(held)
    clean_logits = gather_last(model.run_with_hooks(held), held.attention_mask.bool())
    res = patch_head_sets(
        model,
        held,
        held_corrupt,
        SITE,
        [top, *randoms],
        {KL: KLToClean(clean_logits)},
        batch_size,
        held_hooks,
    )
    grid = None
    if single:
        clean_logits = gather_last(model.run_with_hooks(clean), clean.attention_mask.bool())
        kl = {KL: KLToClean(clean_logits)}
        sw = attribution_sweep(
            model,
            clean,
            corrupt,
            SITE,
            kl,
            layers=layers,
            corrupt_hooks=corrupt_hooks,
            per_position=False,
        )
        grid = sw.normalized(KL).tolist()
    vals = res.values[KL].double()  # [set B]
    return SinkHeads(
        layers=layers,
        n_heads=H,
        attention=att.tolist(),
        select=[int(i) for i in select],
        test=[int(i) for i in test],
        top=top,
        pool=pool,
        random_sets=randoms,
        kl_clean=res.clean[KL].double().tolist(),
        kl_corrupt=res.corrupt[KL].double().tolist(),
        kl_top=vals[0].tolist(),
        kl_random=vals[1:].T.tolist(),
        single=grid,
        n_forwards=res.n_forwards,
    )
