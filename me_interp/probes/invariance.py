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

import torch
from jaxtyping import Bool, Float, Int

from me_interp import names
from me_interp.models import Batch, LoadedModel
from me_interp.probes.alignment import reference_positions


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


def norm_cv(x: Float[torch.Tensor, "n d"]) -> float:
    """``std(‖x_a‖) / mean(‖x_a‖)`` over the rows (population std)."""
    n = x.double().norm(dim=-1)
    return float(n.std(unbiased=False) / n.mean())


@dataclass(frozen=True)
class InvarianceScan:
    """The massive token's layer outputs and keys per layer and prompt (see module docstring)."""

    states: Float[torch.Tensor, "layer batch d_model"]
    keys: Float[torch.Tensor, "layer batch kv_head d_head"]
    first_tokens: list[int]
    reference: Int[torch.Tensor, " batch"]

    @property
    def n_layers(self) -> int:
        return int(self.states.shape[0])

    def pairs(self, same_first_token: bool = False) -> Bool[torch.Tensor, "batch batch"]:
        return pair_mask(self.first_tokens, same_first_token)

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

    def cos_across_layers(self) -> Float[torch.Tensor, "layer layer"]:
        """``[l, l']`` mean over prompts of ``cos(h_m^{(l)}, h_m^{(l')})``."""
        u = self.states.double()
        u = u / u.norm(dim=-1, keepdim=True)
        return torch.einsum("ibd,jbd->ijb", u, u).mean(-1)

    def norm_cv(self) -> list[float]:
        """Per layer, coefficient of variation of ``‖h_m‖`` across inputs."""
        return [norm_cv(self.states[layer]) for layer in range(self.n_layers)]

    def mean_norm(self) -> list[float]:
        return self.states.double().norm(dim=-1).mean(-1).tolist()


def _record_at_ref(x, hook, *, layer, out, ref):
    h = x.detach().float()
    out[layer] = h[torch.arange(h.shape[0], device=h.device), ref.to(h.device)].cpu()
    return x


def invariance_scan(
    model: LoadedModel,
    batch: Batch,
    positions: Sequence[int] | None = None,
    fwd_hooks: Sequence = (),
) -> InvarianceScan:
    """Record the massive token's layer output and key at every layer, in one forward (no cache).

    Args:
        positions: the massive token of each prompt (``None``: position 0).
        fwd_hooks: interventions to run in the same forward.

    Raises:
        ValueError: fewer than 2 prompts (nothing to compare), or bad positions.
    """
    if len(batch) < 2:
        raise ValueError("directional invariance compares inputs: give at least 2 prompts")
    ref = reference_positions(batch, positions)
    L, B = model.n_layers, len(batch)
    cfg = model.bridge.cfg
    n_kv = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
    d_head = int(cfg.d_head)
    states = torch.zeros(L, B, model.d_model)
    keys = torch.zeros(L, B, n_kv, d_head)
    hooks = []
    for layer in range(L):
        hooks.append(
            (names.resid_post(layer), partial(_record_at_ref, layer=layer, out=states, ref=ref))
        )
        hooks.append(
            (names.site("k", layer), partial(_record_at_ref, layer=layer, out=keys, ref=ref))
        )
    model.run_with_hooks(batch, [*fwd_hooks, *hooks])
    first = [int(t) for t in batch.tokens[:, 0].tolist()]
    return InvarianceScan(states=states, keys=keys, first_tokens=first, reference=ref)


def same_first_token_control(batch: Batch, token: int | None = None) -> Batch:
    """The control batch: ``batch`` with the first token of every prompt replaced by ``token``
    (default: prompt 0's first token), so that position 0 is identical across inputs by construction."""
    tokens = batch.tokens.clone()
    tokens[:, 0] = int(tokens[0, 0]) if token is None else int(token)
    return Batch(tokens, batch.attention_mask.clone(), batch.prompts)


__all__ = [
    "InvarianceScan",
    "cosine_matrix",
    "invariance_scan",
    "mean_pair_cosine",
    "norm_cv",
    "pair_mask",
    "same_first_token_control",
]
