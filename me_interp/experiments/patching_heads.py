"""Which heads' attention to the massive token carries the sink's effect: the per-head question of
activation_patching.

The massive activation matters downstream through attention: later heads attend to the massive token
(the sink) and what they write depends on it. Removing the massive activation (the experiment's
corrupt run) changes the model's next-token distribution; this module asks whether that change is
carried by *a few* heads, the ones that attend most to the massive token, or spread over many.

* **Sink heads, chosen on other prompts.** The prompts are split in halves
  (:func:`me_interp.claims.halves`). On the *selection* half, each head of the layers after the ME
  layer gets its clean attention to the massive token ``p`` (mean over the real queries ``q > p``);
  the ``k`` heads with the most are the sink heads (``k``: ``--n-sink-heads``, default one per layer
  after the ME layer).
* **Their outputs patched together.** On the *held-out* half, the sink heads' clean outputs
  (``hook_z``, every position; :func:`me_interp.patching.heads.patch_head_sets`) are patched together
  into the corrupt run, and the next-token distribution at each prompt's last real token is scored
  by ``KL(clean ‖ patched)``, normalised the TransformerLens way on prompt means (clean = 1, corrupt
  = 0): ``restore = 1 − mean KL_patched / mean KL_corrupt`` (the clean KL, 0 up to float noise, is
  kept in the formula).
* **Against random heads of the same layers.** ``--n-random`` draws of ``k`` heads, as many in each
  layer as the sink heads have there (uniform, without replacement within a layer), patched the
  same way. Per held-out prompt ``b`` and draw ``s``: ``(KL_random[b, s] − KL_sink[b]) / (mean KL_corrupt −
  mean KL_clean)``, whose mean is the sink heads' restore minus the random heads'.

Patching a head's *pattern* instead would restore that head's own attention to ``p`` by
construction, and a head's output does not bring the massive key back, so neither the pattern nor the
downstream sink is the outcome: the output distribution is, which the sink heads need not control.

Claims (in :data:`me_interp.experiments.activation_patching.SPECS`):

* ``sink_heads_restore`` [claim] — the sink heads' outputs restore at least half (``restore``) of the
  clean next-token distribution;
* ``sink_heads_beat_random`` [claim] — they restore at least ``head_excess`` more than random heads
  of the same layers (two-way bootstrap over held-out prompts × draws).

On a model whose sink's effect is concentrated in one head per layer both hold
(``synthetic:planted-needsink``); on one where every head of those layers attends to the sink and
carries an equal part (``synthetic:decoy-sinkspread``) both fail. With the ``first_token``
corruption, token 0 differs in every layer, so part of ``KL(clean ‖ corrupt)`` comes from layers
before the ME layer, which no head after it can restore; ``remove_input`` leaves them clean.

The figure (``sink_heads``) is a layer × head map of each head's clean attention to ``p`` and of each
head's own restore (patched alone, all positions), estimated by attribution patching
(:func:`me_interp.patching.attribution_sweep`, one forward and one backward: exact patching of every
head costs minutes on the bundled model), with the sink heads marked. The claims use exact patching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from me_interp import claims, names
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.patching import KLToClean, attribution_sweep
from me_interp.patching.heads import patch_head_sets
from me_interp.patching.suffix import gather_last
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record

SITE = "attn_head_out"
"""The per-head site patched: each head's output before ``W_O`` (``hook_z``)."""
KL = "kl"


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


@dataclass
class SinkHeads:
    """What the sink-heads claims are judged on (see the module docstring).

    Attributes:
        layers: the layers after the ME layer (the heads' layers).
        n_heads: heads per layer.
        attention: ``[prompt][layer][head]`` clean attention to ``p`` (queries after ``p``).
        select, test: the selection and held-out prompts (indices).
        k: how many sink heads.
        top: the sink heads ``(layer, head)``, chosen on ``select``.
        random_sets: the random draws, each ``k`` heads with ``top``'s count per layer.
        kl_clean, kl_corrupt, kl_top: per held-out prompt (in the order of ``test``)
            ``KL(clean ‖ run)`` at the last token.
        kl_random: ``[held-out prompt][draw]``.
        single: ``[layer][head]`` normalised KL of each head patched alone, estimated by attribution
            patching (first order: one forward and one backward; all prompts; the figure only),
            ``None`` when not run.
        n_forwards: patched forwards run for the head sets.
    """

    layers: list[int]
    n_heads: int
    attention: list[list[list[float]]]
    select: list[int]
    test: list[int]
    k: int
    top: list[tuple[int, int]]
    random_sets: list[list[tuple[int, int]]]
    kl_clean: list[float]
    kl_corrupt: list[float]
    kl_top: list[float]
    kl_random: list[list[float]]
    single: list[list[float]] | None
    n_forwards: int = 0

    def rows(self) -> np.ndarray:
        """Held-out prompts × ``[clean, corrupt, sink heads]`` KL."""
        return np.column_stack(
            [np.asarray(x, dtype=np.float64) for x in (self.kl_clean, self.kl_corrupt, self.kl_top)]
        )

    def excess(self) -> np.ndarray:
        """Held-out prompts × draws: ``(KL_random − KL_sink) / (mean KL_corrupt − mean KL_clean)``
        (the denominators over the held-out prompts)."""
        rand = np.asarray(self.kl_random, dtype=np.float64)  # [test draw]
        top = np.asarray(self.kl_top, dtype=np.float64)[:, None]
        d = float(np.mean(self.kl_corrupt) - np.mean(self.kl_clean))
        return (rand - top) / d if d > 0 else np.full_like(rand, np.nan)

    def restore(self, kl: Sequence[float] | np.ndarray) -> float:
        """Normalised KL (clean = 1, corrupt = 0) of per-held-out-prompt ``kl``."""
        c, x = float(np.mean(self.kl_clean)), float(np.mean(self.kl_corrupt))
        return float((np.mean(kl) - x) / (c - x)) if c != x else float("nan")

    def random_restores(self) -> list[float]:
        """Each draw's restore on the held-out prompts."""
        r = np.asarray(self.kl_random, dtype=np.float64)
        return [self.restore(r[:, s]) for s in range(r.shape[1])]

    def selection_attention(self) -> np.ndarray:
        """``[layer, head]`` mean clean attention to ``p`` over the selection prompts."""
        return np.asarray(self.attention, dtype=np.float64)[self.select].mean(0)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["top"] = [list(h) for h in self.top]
        d["random_sets"] = [[list(h) for h in s] for s in self.random_sets]
        d["restore_sink_heads"] = self.restore(self.kl_top)
        d["restore_random_heads"] = self.random_restores()
        return d


def draw_random(
    top: Sequence[tuple[int, int]], n_heads: int, n: int, seed: int
) -> list[list[tuple[int, int]]]:
    """``n`` draws of as many heads as ``top`` has in each of its layers, uniform without
    replacement within a layer (seeded)."""
    rng = np.random.default_rng(seed)
    per_layer: dict[int, int] = {}
    for la, _ in top:
        per_layer[la] = per_layer.get(la, 0) + 1
    out = []
    for _ in range(n):
        out.append(
            sorted(
                (la, int(h))
                for la, c in sorted(per_layer.items())
                for h in rng.choice(n_heads, size=c, replace=False)
            )
        )
    return out


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
    """The sink-heads measurement (module docstring) at the ME layer ``layer`` and massive position
    ``position``, on the experiment's clean/corrupt pair (``corrupt``, ``corrupt_hooks``: the
    attribution figure) and its corruption of any sub-batch (``corrupt_for``: the held-out prompts,
    on which alone the head sets are patched).

    Raises:
        claims.NotApplicable: no layer after ``layer``; fewer than 4 prompts; ``k`` covers every head
            of the layers after ``layer``.
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
            f"{k} sink heads of the {len(layers) * H} heads after the ME layer: random heads of "
            "the same layers would be the same heads"
        )
    select, test = claims.halves(B, seed)
    sel = att[torch.as_tensor(select)].mean(0).flatten()  # [layer*head]
    order = torch.argsort(sel, descending=True, stable=True)[:k].tolist()
    top = sorted((layers[i // H], i % H) for i in order)
    randoms = draw_random(top, H, n_random, seed)
    held = Batch(clean.tokens[test], clean.attention_mask[test], None)
    held_corrupt, held_hooks = corrupt_for(held)
    clean_logits = gather_last(model.run_with_hooks(held), held.attention_mask.bool())
    metrics = {KL: KLToClean(clean_logits)}
    res = patch_head_sets(
        model, held, held_corrupt, SITE, [top, *randoms], metrics, batch_size, held_hooks
    )
    grid, n_fwd = None, res.n_forwards
    if single:
        clean_logits = gather_last(model.run_with_hooks(clean), clean.attention_mask.bool())
        sw = attribution_sweep(
            model,
            clean,
            corrupt,
            SITE,
            {KL: KLToClean(clean_logits)},
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
        k=k,
        top=top,
        random_sets=randoms,
        kl_clean=res.clean[KL].double().tolist(),
        kl_corrupt=res.corrupt[KL].double().tolist(),
        kl_top=vals[0].tolist(),
        kl_random=vals[1:].T.tolist(),
        single=grid,
        n_forwards=n_fwd,
    )


def heads_text(heads: Sequence[tuple[int, int]], limit: int = 8) -> str:
    """``L3h0, L4h0, …`` (at most ``limit`` shown)."""
    shown = ", ".join(f"L{la}h{h}" for la, h in heads[:limit])
    return shown + (f", … ({len(heads)} heads)" if len(heads) > limit else "")


def details(sh: SinkHeads) -> str:
    """The context printed with the sink-heads claims."""
    att = sh.selection_attention()
    idx = {la: i for i, la in enumerate(sh.layers)}
    top_att = [att[idx[la], h] for la, h in sh.top]
    rand = sh.random_restores()
    out = (
        f"{sh.k} sink heads of {len(sh.layers) * sh.n_heads} (layers {sh.layers[0]}..{sh.layers[-1]}) "
        f"chosen on {len(sh.select)} prompts: {heads_text(sh.top)} (their attention to p "
        f"{min(top_att):.3g}..{max(top_att):.3g}; the largest of the other heads "
        f"{_largest_other(att, sh):.3g}); tested on {len(sh.test)} held-out prompts: KL(clean ‖ corrupt) "
        f"{np.mean(sh.kl_corrupt):.4g} nats, with the sink heads patched "
        f"{np.mean(sh.kl_top):.4g} (restore {sh.restore(sh.kl_top):.3g})"
    )
    if rand:
        out += (
            f"; {len(rand)} random draws restore {np.mean(rand):.3g} on average "
            f"({min(rand):.3g}..{max(rand):.3g})"
        )
    return out


def _largest_other(att: np.ndarray, sh: SinkHeads) -> float:
    idx = {la: i for i, la in enumerate(sh.layers)}
    rest = att.copy()
    for la, h in sh.top:
        rest[idx[la], h] = -np.inf
    return float(rest.max())


def figure(sh: SinkHeads, title: str) -> go.Figure:
    """Layer × head: each head's clean attention to ``p`` (mean over the selection prompts) and its
    own restore (patched alone), the sink heads marked."""
    att = sh.selection_attention().T  # [head layer]
    panels = [("attention to p (selection prompts)", att, 0.0, 1.0)]
    if sh.single is not None:
        single = np.asarray(sh.single, dtype=np.float64).T
        # symmetric around 0 at the largest |restore| (single heads restore little: a ±1 scale
        # would show a blank panel), never narrower than ±0.05
        top = float(np.nanmax(np.abs(single), initial=0.0))
        top = max(top if np.isfinite(top) else 1.0, 0.05)
        panels.append(("restore, head alone (attribution estimate)", single, -top, top))
    fig = make_subplots(
        rows=1, cols=len(panels), subplot_titles=[p[0] for p in panels], shared_yaxes=True
    )
    for i, (name, z, lo, hi) in enumerate(panels):
        fig.add_trace(
            go.Heatmap(
                z=z.tolist(),
                x=sh.layers,
                y=list(range(sh.n_heads)),
                zmin=lo,
                zmax=hi,
                colorscale="Viridis" if i == 0 else "RdBu",
                reversescale=i > 0,
                colorbar={"x": 0.46 if len(panels) > 1 and i == 0 else 1.02, "len": 0.9},
                hovertemplate="layer %{x}<br>head %{y}<br>%{z:.3f}<extra>" + name + "</extra>",
            ),
            row=1,
            col=i + 1,
        )
        fig.add_trace(
            go.Scatter(
                x=[la for la, _ in sh.top],
                y=[h for _, h in sh.top],
                mode="markers",
                marker={"symbol": "square-open", "size": 14, "color": "red", "line": {"width": 2}},
                name="sink heads (chosen on the selection prompts)",
                showlegend=i == 0,
            ),
            row=1,
            col=i + 1,
        )
        fig.update_xaxes(title_text="layer (0-based)", row=1, col=i + 1)
    fig.update_yaxes(title_text="head", autorange="reversed", row=1, col=1)
    fig.update_layout(
        title=title,
        template="plotly_white",
        height=max(380, 22 * sh.n_heads + 220),
        legend={"orientation": "h", "y": -0.2},
    )
    return fig
