"""FFN concentration: is the massive token's FFN signal concentrated on few coordinates, and which neurons?

For a gated FFN ``FFN(ĥ) = W_down( σ(W_gate ĥ) ⊙ W_up ĥ )`` (paper.md §2, claim 3), at each stage
``s`` of each layer and for every token ``t``:

* concentration (Herfindahl index / inverse participation ratio)
  ``C_t = Σ_i (h_{t,i}² / Σ_j h_{t,j}²)²`` — ``1`` for a one-hot vector, ``1/d`` for a flat one;
* ``ΔC = C_m − mean_{t≠m} C_t`` over the real tokens (``m`` = the massive token, position 0 by default),
  averaged over prompts; the paper expects it large only at the ME layer, for every projection;
* FFN magnification of a token: ``‖FFN(ĥ_t)‖₂ / ‖ĥ_t‖₂`` with ``ĥ_t`` the pre-FFN RMSNorm output (after
  the gain), which the paper expects to peak at the ME layer for the massive token.

Stages (:data:`STAGES`): ``"input"`` = ``ĥ`` (``blocks.L.ln2.hook_out``), ``"gate"`` = ``W_gate ĥ`` before
the activation (``mlp.hook_pre``), ``"up"`` = ``W_up ĥ`` (``mlp.hook_pre_linear``), ``"product"`` =
``σ(W_gate ĥ) ⊙ W_up ĥ`` (``mlp.hook_post``, the input of ``W_down``), ``"down"`` = the FFN's own output
``W_down(…)`` (site ``ffn_own``, ``mlp.hook_out``). On sandwich-norm models (Gemma 2/3,
``model.arch.post_ffn_norm``) the FFN's contribution to the residual stream is that output after the
post-FFN norm (site ``ffn_out``, ``hook_mlp_out``); there the scan also records it, as the extra stage
``"residual"`` (:data:`RESIDUAL_STAGE`) and the norms behind :meth:`FFNScan.magnification_residual`. On
other models the two sites are one tensor and only ``"down"`` is recorded.

Neuron contributions (:func:`neuron_contributions`): the massive token's FFN output is
``y = Σ_n a_n W_down[:, n]`` with ``a`` the product stage, so neuron ``n`` explains the share
``s_n = a_n ⟨W_down[:, n], y⟩ / ‖y‖²`` of it (signed projection; ``Σ_n s_n = 1`` exactly).
Neuron scores (:func:`neuron_scores`): how much neuron ``n`` writes into the massive dims ``D`` at the
massive token ``t_b`` of each prompt, ``score_n = mean_b ‖a_n(b, t_b) · W_down[D, n]‖₂`` (the neurons
``ffn_svd_ablation`` removes).

The FFN share (:func:`ffn_share`, :class:`FfnShare`): per prompt, ``cos(FFN_p, h_p)`` and
``‖FFN_p‖ / ‖h_p‖`` of a layer's FFN output (site ``ffn_out``) at the massive token ``p`` against its
layer output ``h_p``: when the FFN output is (nearly) the whole state, patching or removing it is
patching or removing the state (a sanity check, not evidence, in the causal experiments).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from jaxtyping import Bool, Float, Int

from me_interp import claims, names
from me_interp.loading.inputs import Prompts, as_batch
from me_interp.models import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.alignment import delta_vs_others, mean_except_reference, reference_positions
from me_interp.probes.batching import Chunk, record

STAGES = ("input", "gate", "up", "product", "down")
PROJECTIONS = ("gate", "up", "product", "down")
RESIDUAL_STAGE = "residual"
"""The FFN's residual contribution after a post-FFN norm (recorded on sandwich-norm models only)."""
_STAGE_SITE = {
    "input": "ffn_in",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "product": "ffn_act",
    "down": "ffn_own",
    RESIDUAL_STAGE: "ffn_out",
}


def concentration(h: Float[torch.Tensor, "*tok d"]) -> Float[torch.Tensor, "*tok"]:
    """Herfindahl index ``C = Σ_i (h_i² / Σ_j h_j²)²`` along the last dim (NaN for a zero vector)."""
    e = h.float() ** 2
    p = e / e.sum(-1, keepdim=True)
    return (p**2).sum(-1)


@dataclass(frozen=True)
class FFNScan:
    """What :func:`ffn_scan` measured. Layers are 0-based."""

    conc: dict[str, Float[torch.Tensor, "layer batch pos"]]
    in_norm: Float[torch.Tensor, "layer batch pos"]
    out_norm: Float[torch.Tensor, "layer batch pos"]
    act_at_ref: Float[torch.Tensor, "layer batch d_mlp"]
    out_at_ref: Float[torch.Tensor, "layer batch d_model"]
    mask: Bool[torch.Tensor, "batch pos"]
    reference: Int[torch.Tensor, " batch"]
    residual_norm: Float[torch.Tensor, "layer batch pos"] | None = None

    def delta_c(self, stage: str) -> Float[torch.Tensor, "layer batch"]:
        """``ΔC`` at ``stage`` per layer and prompt."""
        if stage not in self.conc:
            raise ValueError(f"unknown FFN stage {stage!r}; choose from {tuple(self.conc)}")
        return delta_vs_others(self.conc[stage], self.mask, self.reference)

    def massive_c(self, stage: str) -> Float[torch.Tensor, "layer batch"]:
        return self._at_reference(self.conc[stage])

    def others_c(self, stage: str) -> Float[torch.Tensor, "layer batch"]:
        return mean_except_reference(self.conc[stage], self.mask, self.reference)

    def magnification(self) -> Float[torch.Tensor, "layer batch"]:
        """``‖FFN out‖ / ‖FFN in‖`` of the massive token per layer and prompt."""
        return self._at_reference(self.out_norm / self.in_norm)

    def _at_reference(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, torch.arange(len(self.reference)), self.reference]

    def magnification_others(self) -> Float[torch.Tensor, "layer batch"]:
        """Mean over the other real tokens of ``‖FFN out‖ / ‖FFN in‖``."""
        return mean_except_reference(self.out_norm / self.in_norm, self.mask, self.reference)

    def magnification_residual(self) -> Float[torch.Tensor, "layer batch"] | None:
        """``‖residual contribution‖ / ‖FFN in‖`` of the massive token (after the post-FFN norm);
        ``None`` on models without one, where it equals :meth:`magnification`."""
        if self.residual_norm is None:
            return None
        return self._at_reference(self.residual_norm / self.in_norm)

    def stage_means(self, which: str, layer: int) -> Stages:
        """The means over prompts (NaN-skipping) at ``layer`` of :meth:`delta_c` (``which="delta"``;
        with ``residual`` on sandwich-norm models), :meth:`massive_c` or :meth:`others_c` per stage."""
        c = {"delta": self.delta_c, "massive": self.massive_c, "others": self.others_c}[which]
        res = which == "delta" and self.residual_norm is not None
        residual = float(c(RESIDUAL_STAGE)[layer].nanmean()) if res else None
        return Stages(*(float(c(s)[layer].nanmean()) for s in STAGES), residual=residual)  # type: ignore[misc]


class FFNRecorder:
    """Records the concentration of every token at every FFN stage and the FFN's input and output
    norms, chunk by chunk (``probes.batching``)."""

    def __init__(self, model: LoadedModel, batch: Batch) -> None:
        L, (B, T) = model.n_layers, batch.tokens.shape
        self.model, self.batch = model, batch
        sandwich = model.arch.post_ffn_norm is not None
        self.stages = (*STAGES, RESIDUAL_STAGE) if sandwich else STAGES
        self.conc = {s: torch.full((L, B, T), float("nan")) for s in self.stages}
        self.in_norm = torch.full((L, B, T), float("nan"))
        self.out_norm = torch.full((L, B, T), float("nan"))
        self.residual_norm = torch.full((L, B, T), float("nan")) if sandwich else None

    def hooks(self, chunk: Chunk) -> list:
        out = []
        norm_sites = [("ffn_in", self.in_norm), ("ffn_own", self.out_norm)]
        if self.residual_norm is not None:
            norm_sites.append(("ffn_out", self.residual_norm))
        for layer in range(self.model.n_layers):
            for s in self.stages:
                fn = partial(self._put, out=self.conc[s], layer=layer, chunk=chunk, conc=True)
                out.append((names.site(_STAGE_SITE[s], layer), fn))
            for site, store in norm_sites:
                fn = partial(self._put, out=store, layer=layer, chunk=chunk, conc=False)
                out.append((names.site(site, layer), fn))
        return out

    @staticmethod
    def _put(x, hook, *, out, layer, chunk: Chunk, conc: bool):
        h = x.detach()
        v = concentration(h) if conc else h.float().norm(dim=-1)
        out[layer, chunk.rows, : chunk.width] = v.cpu()
        return x


class FFNAtRecorder:
    """Records the product stage (input of ``W_down``) and the FFN output of one token per prompt,
    ``positions[b]``, at every layer up to ``last_layer``. It reads nothing after those positions, so
    it can run on prefixes (``record(..., upto=positions + 1)``)."""

    def __init__(
        self,
        model: LoadedModel,
        batch: Batch,
        positions: Sequence[int] | None = None,
        last_layer: int | None = None,
    ) -> None:
        self.model = model
        self.positions = reference_positions(batch, positions)
        self.last = model.n_layers - 1 if last_layer is None else model.check_layer(last_layer)
        L, B = model.n_layers, len(batch)
        self.act = torch.zeros(L, B, model.d_mlp)
        self.out = torch.zeros(L, B, model.d_model)

    def hooks(self, chunk: Chunk) -> list:
        pos = self.positions[chunk.rows]
        out = []
        for layer in range(self.last + 1):
            for site, store in (("ffn_act", self.act), ("ffn_own", self.out)):
                fn = partial(self._put, out=store, layer=layer, chunk=chunk, pos=pos)
                out.append((names.site(site, layer), fn))
        return out

    @staticmethod
    def _put(x, hook, *, out, layer, chunk: Chunk, pos):
        h = x.detach().float()
        out[layer, chunk.rows] = h[
            torch.arange(len(chunk), device=h.device), pos.to(h.device)
        ].cpu()
        return x


def ffn_scan(
    model: LoadedModel,
    batch: Prompts,
    positions: Sequence[int] | None = None,
    fwd_hooks: Sequence = (),
) -> FFNScan:
    """Concentration at every FFN stage, in/out norms, and the massive token's neuron activations.

    One forward (in length-sorted chunks unless ``fwd_hooks`` are given), statistics computed in the
    hooks (no cache).

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        batch: a prompt ``str``, a list of prompts or a :class:`~me_interp.models.Batch`.
        positions: the massive token of each prompt (``None``: position 0).
        fwd_hooks: interventions to run in the same forward.
    """
    batch = as_batch(model, batch)
    at = FFNAtRecorder(model, batch, positions)
    rec = FFNRecorder(model, batch)
    record(model, batch, [rec, at], fwd_hooks=fwd_hooks)
    return make_scan(rec, at)


def make_scan(rec: FFNRecorder, at: FFNAtRecorder) -> FFNScan:
    """The :class:`FFNScan` of a per-token recorder and a recorder at the massive tokens (which may
    have run in another forward, e.g. on prefixes once the massive tokens were known)."""
    mask = rec.batch.attention_mask.bool().cpu()
    nan = float("nan")
    return FFNScan(
        conc={s: v.masked_fill(~mask, nan) for s, v in rec.conc.items()},
        in_norm=rec.in_norm.masked_fill(~mask, nan),
        out_norm=rec.out_norm.masked_fill(~mask, nan),
        residual_norm=None
        if rec.residual_norm is None
        else rec.residual_norm.masked_fill(~mask, nan),
        act_at_ref=at.act,
        out_at_ref=at.out,
        mask=mask,
        reference=at.positions,
    )


def neuron_contributions(
    act: Float[torch.Tensor, "batch d_mlp"], w_down: Float[torch.Tensor, "d_model d_mlp"]
) -> Float[torch.Tensor, "batch d_mlp"]:
    """Share ``s_n = a_n ⟨W_down[:, n], y⟩ / ‖y‖²`` of the FFN output ``y = W_down a`` per neuron.

    ``Σ_n s_n = 1`` for every row (NaN when ``y = 0``).
    """
    a = act.float()
    W = w_down.detach().float().to(a.device)
    y = a @ W.T  # [batch d_model]
    proj = y @ W  # [batch d_mlp] = <W_down[:, n], y>
    return a * proj / (y**2).sum(-1, keepdim=True)


@dataclass(frozen=True)
class Stages:
    """One value per FFN stage (:data:`STAGES`; ``residual``: after a post-FFN norm, on
    sandwich-norm models only)."""

    input: float
    gate: float
    up: float
    product: float
    down: float
    residual: float | None = None


@dataclass(frozen=True)
class Neuron:
    """One row of :class:`NeuronTable`: mean share of the massive token's
    FFN output, mean activation, mean ``|a_n| ‖W_down[:, n]‖``."""

    neuron: int
    share: float
    activation: float
    contribution_norm: float


@dataclass(frozen=True)
class NeuronTable:
    """Top FFN neurons of one layer by their share of the massive token's FFN output."""

    layer: int
    neurons: list[int]
    mean_share: list[float]
    mean_activation: list[float]
    mean_contribution_norm: list[float]
    n_prompts: int

    def rows(self) -> list[Neuron]:
        """One :class:`Neuron` per ranked neuron."""
        cols = (self.neurons, self.mean_share, self.mean_activation, self.mean_contribution_norm)
        return [Neuron(*row) for row in zip(*cols, strict=True)]

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "layer_1based": self.layer + 1,
            "n_prompts": self.n_prompts,
            "neurons": [
                {
                    "neuron": n,
                    "share": s,
                    "activation": a,
                    "contribution_norm": c,
                }
                for n, s, a, c in zip(
                    self.neurons,
                    self.mean_share,
                    self.mean_activation,
                    self.mean_contribution_norm,
                )
            ],
        }


def top_neurons(model: LoadedModel, scan: FFNScan, layer: int, top: int = 10) -> NeuronTable:
    """The ``top`` neurons of ``layer`` ranked by mean share of the massive token's FFN output.

    ``contribution_norm = |a_n| ‖W_down[:, n]‖`` (mean over prompts).
    """
    model.check_layer(layer)
    if top < 1:
        raise ValueError("top must be >= 1")
    act = scan.act_at_ref[layer]  # [batch d_mlp]
    w_down = model.ffn_weights(layer).down
    share = neuron_contributions(act, w_down).mean(0)
    top = min(top, share.shape[0])
    order = torch.sort(share, descending=True, stable=True).indices[:top]
    col_norm = w_down.detach().float().norm(dim=0).cpu()
    contrib = (act.abs() * col_norm).mean(0)
    return NeuronTable(
        layer=layer,
        neurons=order.tolist(),
        mean_share=share[order].tolist(),
        mean_activation=act.mean(0)[order].tolist(),
        mean_contribution_norm=contrib[order].tolist(),
        n_prompts=int(act.shape[0]),
    )


def neuron_scores(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Int[torch.Tensor, " batch"],
    dims: Sequence[int],
    rows: Sequence[int] | None = None,
) -> Float[torch.Tensor, " d_mlp"]:
    """``score_n = mean_b ‖act_n(b, t_b) · W_down[D, n]‖₂`` (module docstring) with ``t_b`` =
    ``positions[b]`` and ``D`` = ``dims``, the mean over the prompts ``rows`` (``None``: all).

    One forward, stopped after ``layer``.

    Raises:
        ValueError: no massive dims, or a dim out of range.
    """
    model.check_layer(layer)
    dims = list(dims)
    if not dims or not all(0 <= d < model.d_model for d in dims):
        raise ValueError(
            f"dims must be a non-empty list of dims in 0..{model.d_model - 1}, got {dims}"
        )
    name = names.site("ffn_act", layer)
    acts = Activations(model, batch, [name])
    record(model, batch, [acts], last_layer=layer, max_tokens=None)
    full = acts[name].float()
    act = full[torch.arange(len(batch)), positions.to(full.device)]  # [batch d_mlp]
    W = model.ffn_weights(layer).down.detach().float()[dims].to(act.device)  # [D d_mlp]
    writes = act[:, None, :] * W[None]  # [batch D d_mlp]
    per_prompt = writes.norm(dim=1)  # [batch d_mlp]
    if rows is not None:
        per_prompt = per_prompt[torch.as_tensor(list(rows), dtype=torch.long)]
    return per_prompt.mean(0).cpu()


@dataclass(frozen=True)
class FfnShare:
    """How much of the massive token's state at the output of a layer is that layer's FFN output.

    Attributes:
        cos: per prompt ``cos(FFN_p, h_p)`` (``h_p`` the layer output of the massive token).
        norm_ratio: per prompt ``‖FFN_p‖ / ‖h_p‖``.
    """

    cos: tuple[float, ...]
    norm_ratio: tuple[float, ...]

    def is_state(self) -> bool:
        """Whether the FFN output is (nearly) the state itself (the thresholds ``ffn_state_cos``
        and ``ffn_state_norm`` of :data:`me_interp.claims.THRESHOLDS`, on prompt means)."""
        c, r = float(np.mean(self.cos)), float(np.mean(self.norm_ratio))
        cos_min, norm_tol = claims.threshold("ffn_state_cos"), claims.threshold("ffn_state_norm")
        return c > cos_min and abs(r - 1) < norm_tol

    def text(self) -> str:
        c, r = float(np.mean(self.cos)), float(np.mean(self.norm_ratio))
        return f"the FFN output at p has cosine {c:.5g} with the state and {r:.3%} of its norm"

    def to_dict(self) -> dict:
        return {
            "cos": list(self.cos),
            "norm_ratio": list(self.norm_ratio),
            "is_state": self.is_state(),
        }


class HasFfnShare:
    """What a Result holding per-prompt ``ffn_cos`` and ``ffn_norm_ratio`` (of :func:`ffn_share`)
    answers: their :class:`FfnShare`, ``ffn``."""

    ffn_cos: Sequence[float]
    ffn_norm_ratio: Sequence[float]

    @property
    def ffn(self) -> FfnShare:
        return FfnShare(tuple(self.ffn_cos), tuple(self.ffn_norm_ratio))


def _acts_of(acts: Mapping[str, torch.Tensor], name: str, batch: Batch) -> torch.Tensor:
    if name not in acts:
        raise ValueError(f"acts has no {name!r}: capture it on the unmodified run of the batch")
    x = acts[name]
    if x.shape[0] != len(batch):
        raise ValueError(f"acts[{name!r}] has {x.shape[0]} rows for a batch of {len(batch)}")
    return x


def ffn_share(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    position: int,
    acts: Mapping[str, torch.Tensor],
) -> FfnShare:
    """The FFN output of ``position`` at ``layer`` (site ``ffn_out``) against that token's layer
    output (``resid_post``), per prompt, read from ``acts``: the unmodified run's activations of
    ``batch`` at ``names.ffn_out(layer)`` and ``names.resid_post(layer)`` (no forward here).

    Raises:
        ValueError: a layer or position out of range, or ``acts`` without those activations.
    """
    model.check_layer(layer)
    position, shortest = int(position), min(batch.lengths)
    if not 0 <= position < shortest:
        raise ValueError(f"position {position} is outside the shortest prompt ({shortest} tokens)")
    f = _acts_of(acts, names.ffn_out(layer), batch).float()[:, position]  # [B d]
    h = _acts_of(acts, names.resid_post(layer), batch).float()[:, position]  # [B d]
    cos = torch.nn.functional.cosine_similarity(f, h, dim=-1)
    ratio = f.norm(dim=-1) / h.norm(dim=-1)
    return FfnShare(tuple(cos.cpu().tolist()), tuple(ratio.cpu().tolist()))


__all__ = [
    "FFNAtRecorder",
    "FFNRecorder",
    "FFNScan",
    "FfnShare",
    "NeuronTable",
    "PROJECTIONS",
    "RESIDUAL_STAGE",
    "STAGES",
    "concentration",
    "ffn_scan",
    "ffn_share",
    "make_scan",
    "neuron_contributions",
    "neuron_scores",
    "top_neurons",
]
