"""Directional invariance: does the massive token point the same way for every input and every layer?

Paper.md §2, claim 4: after the ME layer ``cos(h_m^{(l)}(x_a), h_m^{(l)}(x_b)) ≈ 1`` across inputs, so the
massive token's key ``k_m = ĥ_m W_K`` is a fixed reference. With causal attention ``h_0`` depends only on
token 0, so that cosine is **trivially 1 when the inputs share their first token** (paper.md §4): only
pairs with *different* first tokens are evidence; pairs with the same first token are the control.

Measured on ``h_m^{(l)}`` = the layer output (``resid_post``) at the massive position ``m`` of each prompt
(position 0 by default) and on ``k_m^{(l,h)}`` = the key projection output at ``m`` (``attn.hook_k``,
before RoPE; one vector per key/value head under GQA):

* ``cos_across_inputs[l] = mean_{a<b, (a,b) ∈ P} cos(h^{(l)}(x_a), h^{(l)}(x_b))`` over a pair set ``P``
  (different first tokens, or the same first token for the control);
* ``cos_across_layers[l, l'] = mean_b cos(h^{(l)}(x_b), h^{(l')}(x_b))``;
* norm stability across inputs: ``CV[l] = std_b ‖h^{(l)}(x_b)‖ / mean_b ‖h^{(l)}(x_b)‖`` (population std).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from jaxtyping import Bool, Float, Int

from me_interp import names
from me_interp.loading.inputs import Prompts, as_batch
from me_interp.models import Batch, LoadedModel
from me_interp.probes.alignment import reference_positions
from me_interp.probes.batching import Chunk, record


def cosine_matrix(x: Float[torch.Tensor, "n d"]) -> Float[torch.Tensor, "n n"]:
    """``C[a, b] = ⟨x_a, x_b⟩ / (‖x_a‖ ‖x_b‖)`` (NaN rows for zero vectors), in float64."""
    x = x.double()
    u = x / x.norm(dim=-1, keepdim=True)
    return u @ u.T


def pair_mask(first_tokens: Sequence[int], same: bool) -> Bool[torch.Tensor, "n n"]:
    """Pairs ``a < b`` whose first tokens are equal (``same=True``) or different (``same=False``)."""
    t = torch.as_tensor(list(first_tokens))
    eq = t[:, None] == t[None, :]
    upper = torch.ones(len(t), len(t), dtype=torch.bool).triu(1)
    return upper & (eq if same else ~eq)


def mean_pair_cosine(x: Float[torch.Tensor, "n d"], pairs: Bool[torch.Tensor, "n n"]) -> float:
    """Mean of ``cos(x_a, x_b)`` over the pairs marked in ``pairs`` (NaN if there are none)."""
    if not pairs.any():
        return float("nan")
    return float(cosine_matrix(x)[pairs.to(x.device)].mean())


def partner_mean(
    mats: Float[torch.Tensor, "layer n n"], pairs: Bool[torch.Tensor, "n n"]
) -> Float[torch.Tensor, "layer n"]:
    """``[layer, prompt]`` mean of ``mats[l, a, b]`` over the partners ``b`` with ``pairs[a, b]``."""
    p = pairs.to(mats.dtype)
    return (mats * p).sum(-1) / p.sum(-1)  # NaN for a prompt without partners


def removed_misalignment(cos: np.ndarray, me: int) -> np.ndarray | float:
    """``1 − mean_{l ≥ me}(1 − cos_l) / mean_{l < me}(1 − cos_l)``: the fraction of the remaining
    non-alignment ``1 − cos`` that is gone from the ME layer on (1: perfectly aligned after it);
    over the last axis of ``cos [..., layer]``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return 1.0 - (1.0 - cos[..., me:]).mean(-1) / (1.0 - cos[..., :me]).mean(-1)


def norm_cv(x: Float[torch.Tensor, "n d"]) -> float:
    """``std(‖x_a‖) / mean(‖x_a‖)`` over the rows (population std)."""
    n = x.double().norm(dim=-1)
    return float(n.std(unbiased=False) / n.mean())


@dataclass(frozen=True)
class InvarianceScan:
    """The massive token's layer outputs and keys per layer and prompt (see module docstring).

    ``others`` (optional): per layer and prompt, the mean *unit* vector of the prompt's other real
    tokens' layer outputs, ``ū_b = mean_{t≠m_b} h_t / ‖h_t‖``, so that ``ū_a · ū_b`` is the mean cosine
    between the other tokens of two prompts (the baseline of :meth:`others_cos_matrices`).
    """

    states: Float[torch.Tensor, "layer batch d_model"]
    keys: Float[torch.Tensor, "layer batch kv_head d_head"]
    first_tokens: list[int]
    reference: Int[torch.Tensor, " batch"]
    others: Float[torch.Tensor, "layer batch d_model"] | None = None

    @property
    def n_layers(self) -> int:
        return int(self.states.shape[0])

    def pairs(self, same_first_token: bool = False) -> Bool[torch.Tensor, "batch batch"]:
        return pair_mask(self.first_tokens, same_first_token)

    def pair_array(self, same_first_token: bool = False) -> np.ndarray:
        """:meth:`pairs` with each pair both ways (symmetric), as a NumPy array (what
        :func:`me_interp.claims.pair_measure` reads)."""
        m = self.pairs(same_first_token)
        return (m | m.T).numpy()

    def n_pairs(self, same_first_token: bool = False) -> int:
        return int(self.pairs(same_first_token).sum())

    def cos_across_inputs(self, same_first_token: bool = False) -> list[float]:
        """Per layer, mean cosine of ``h_m`` over pairs of inputs (different first tokens by default)."""
        p = self.pairs(same_first_token)
        return [mean_pair_cosine(self.states[layer], p) for layer in range(self.n_layers)]

    def key_cos_across_inputs(self, same_first_token: bool = False) -> list[list[float]]:
        """``[layer][kv_head]`` mean cosine of ``k_m`` over pairs of inputs."""
        p = self.pairs(same_first_token)
        return [
            [mean_pair_cosine(self.keys[layer, :, h], p) for h in range(self.keys.shape[2])]
            for layer in range(self.n_layers)
        ]

    def cos_matrices(self) -> Float[torch.Tensor, "layer batch batch"]:
        """``[l, a, b] = cos(h_m^{(l)}(x_a), h_m^{(l)}(x_b))`` (float64)."""
        return torch.stack([cosine_matrix(self.states[layer]) for layer in range(self.n_layers)])

    def key_cos_matrices(self) -> Float[torch.Tensor, "layer kv_head batch batch"]:
        """``[l, h, a, b] = cos(k_m^{(l,h)}(x_a), k_m^{(l,h)}(x_b))`` (float64)."""
        k = self.keys.double()  # [layer batch kv d_head]
        u = k / k.norm(dim=-1, keepdim=True)
        return torch.einsum("lahd,lbhd->lhab", u, u)

    def others_cos_matrices(self) -> Float[torch.Tensor, "layer batch batch"]:
        """``[l, a, b] = ū_a · ū_b``: mean cosine between the other tokens of prompts ``a`` and ``b``.

        Raises:
            ValueError: the scan was made without ``others``.
        """
        if self.others is None:
            raise ValueError(
                "this scan has no other-token directions (invariance_scan(others=True))"
            )
        u = self.others.double()
        return torch.einsum("lad,lbd->lab", u, u)

    def cos_across_layers(self) -> Float[torch.Tensor, "layer layer"]:
        """``[l, l']`` mean over prompts of ``cos(h_m^{(l)}, h_m^{(l')})``."""
        return self.cos_to_layers().mean(-1)

    def cos_to_layers(self) -> Float[torch.Tensor, "layer layer batch"]:
        """``[l, l', b] = cos(h_m^{(l)}(x_b), h_m^{(l')}(x_b))`` per prompt (float64)."""
        u = self.states.double()
        u = u / u.norm(dim=-1, keepdim=True)
        return torch.einsum("ibd,jbd->ijb", u, u)

    def norm_cv(self) -> list[float]:
        """Per layer, coefficient of variation of ``‖h_m‖`` across inputs."""
        return [norm_cv(self.states[layer]) for layer in range(self.n_layers)]

    def mean_norm(self) -> list[float]:
        return self.states.double().norm(dim=-1).mean(-1).tolist()


class InvarianceRecorder:
    """Records the layer output and the key (``attn.hook_k``) of token ``positions[b]`` of every
    prompt at every layer. It reads nothing after those positions, so it can run on prefixes."""

    def __init__(self, model: LoadedModel, batch: Batch, positions: Sequence[int] | None = None):
        self.model = model
        self.positions = reference_positions(batch, positions)
        cfg = model.bridge.cfg
        n_kv = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
        L, B = model.n_layers, len(batch)
        self.states = torch.zeros(L, B, model.d_model)
        self.keys = torch.zeros(L, B, n_kv, int(cfg.d_head))

    def hooks(self, chunk: Chunk) -> list:
        pos = self.positions[chunk.rows]
        out = []
        for layer in range(self.model.n_layers):
            for site, store in (("resid_post", self.states), ("k", self.keys)):
                fn = partial(_record_at, out=store, layer=layer, rows=chunk.rows, pos=pos)
                out.append((names.site(site, layer), fn))
        return out


def _record_at(x, hook, *, out, layer, rows, pos):
    h = x.detach().float()
    out[layer, rows] = h[torch.arange(h.shape[0], device=h.device), pos.to(h.device)].cpu()
    return x


class UnitSumRecorder:
    """Records, per layer and prompt, the sum and the count of the unit vectors ``h_t / ‖h_t‖`` of the
    real tokens' layer outputs (float64); with the massive token's own state this gives the other
    tokens' mean direction (:meth:`others`)."""

    def __init__(self, model: LoadedModel, batch: Batch) -> None:
        self.model, self.batch = model, batch
        self.sums = torch.zeros(model.n_layers, len(batch), model.d_model, dtype=torch.float64)

    def hooks(self, chunk: Chunk) -> list:
        mask = chunk.batch.attention_mask.bool()
        return [
            (names.resid_post(layer), partial(self._record, layer=layer, chunk=chunk, mask=mask))
            for layer in range(self.model.n_layers)
        ]

    def _record(self, x, hook, *, layer, chunk: Chunk, mask):
        h = x.detach().double()
        u = h / h.norm(dim=-1, keepdim=True)
        u = torch.where(mask[..., None], u, torch.zeros((), dtype=u.dtype, device=u.device))
        self.sums[layer, chunk.rows] = u.sum(1).cpu()
        return x

    def others(
        self, states: Float[torch.Tensor, "layer batch d_model"]
    ) -> Float[torch.Tensor, "layer batch d_model"]:
        """``ū_b = (Σ_t u_t − u_{m_b}) / (n_b − 1)`` with ``states`` the massive tokens' layer outputs.

        Raises:
            ValueError: a prompt with a single token.
        """
        n = torch.tensor(self.batch.lengths, dtype=torch.float64)
        if (n < 2).any():
            raise ValueError("the other tokens' direction needs prompts with at least 2 tokens")
        s = states.double()
        u = s / s.norm(dim=-1, keepdim=True)
        return (self.sums - u) / (n[None, :, None] - 1)


def invariance_scan(
    model: LoadedModel,
    batch: Prompts,
    positions: Sequence[int] | None = None,
    fwd_hooks: Sequence = (),
    others: bool = False,
) -> InvarianceScan:
    """Record the massive token's layer output and key at every layer, in one forward (no cache).

    Without ``fwd_hooks`` and ``others`` the forward runs on the prefixes ``x_b[: m_b + 1]`` only (the
    states at ``m_b`` depend on nothing after it), in length-sorted chunks.

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        batch: a list of at least 2 prompts or a :class:`~me_interp.models.Batch`.
        positions: the massive token of each prompt (``None``: position 0).
        fwd_hooks: interventions to run in the same forward (then the full batch runs at once).
        others: also record the other tokens' mean direction (``InvarianceScan.others``; needs the
            full prompts).

    Raises:
        ValueError: fewer than 2 prompts (nothing to compare), or bad positions.
    """
    batch = as_batch(model, batch)
    if len(batch) < 2:
        raise ValueError("directional invariance compares inputs: give at least 2 prompts")
    rec = InvarianceRecorder(model, batch, positions)
    recs: list = [rec]
    unit = UnitSumRecorder(model, batch) if others else None
    if unit is not None:
        recs.append(unit)
    upto = None if (fwd_hooks or others) else (rec.positions + 1).tolist()
    record(model, batch, recs, upto=upto, fwd_hooks=fwd_hooks)
    return InvarianceScan(
        states=rec.states,
        keys=rec.keys,
        first_tokens=[int(t) for t in batch.tokens[:, 0].tolist()],
        reference=rec.positions,
        others=None if unit is None else unit.others(rec.states),
    )


def same_first_token_control(batch: Batch, token: int | None = None) -> Batch:
    """The control batch: ``batch`` with the first token of every prompt replaced by ``token``
    (default: prompt 0's first token), so that position 0 is identical across inputs by construction."""
    tokens = batch.tokens.clone()
    tokens[:, 0] = int(tokens[0, 0]) if token is None else int(token)
    return Batch(tokens, batch.attention_mask.clone(), batch.prompts)


__all__ = [
    "InvarianceRecorder",
    "InvarianceScan",
    "UnitSumRecorder",
    "cosine_matrix",
    "invariance_scan",
    "mean_pair_cosine",
    "norm_cv",
    "pair_mask",
    "same_first_token_control",
]
