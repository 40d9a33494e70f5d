"""The named edits of the causal experiments at one token of the ME layer, as hook lists.

Each name is one edit of :mod:`me_interp.interventions.causal` at the massive token ``p`` of layer
``L`` (``dims``: the massive dims), so an experiment declares its conditions by name and gets their
hooks here:

* removals (``sink_causality``): ``remove_ffn`` (the FFN output of ``p`` set to the other tokens'
  mean), ``remove_dims`` (``p``'s massive dims of the layer output set to the others' mean),
  ``remove_all`` (``p``'s whole layer output set to the others' mean), ``patch_other`` (``p``'s
  layer output replaced by the next prompt's);
* component edits (``component_ablation``): ``flatten_gain`` (``p``'s pre-FFN norm output
  ``ĥ_p ⊙ mean(w)``), ``cap_ffn`` (``‖FFN_p‖`` capped at the others' median), ``scale_product``
  (the FFN product ``act(W_gate x) ⊙ W_up x`` of ``p`` × α), ``normalize_product`` (that product
  at the others' mean norm), ``zero_dims`` / ``mean_dims`` (the massive dims of ``p``'s layer output
  set to 0 / to their mean over the prompts).

``acts``: an :class:`~me_interp.probes.activations.Activations` of the unedited run holding
:func:`unedited_names` (one capture shared by every condition).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from jaxtyping import Float

from me_interp import claims, names
from me_interp.interventions import causal
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.removal import not_ordinary

REMOVALS: tuple[str, ...] = ("remove_ffn", "remove_dims", "remove_all", "patch_other")
COMPONENTS: tuple[str, ...] = (
    "flatten_gain",
    "cap_ffn",
    "scale_product",
    "normalize_product",
    "zero_dims",
    "mean_dims",
)


class Conditions:
    """What a Result of these conditions answers about its ``conditions`` (``baseline`` first, each
    with a ``name``; for :meth:`not_removed`, ``p``'s per-prompt norm ratios ``me_ratio`` and
    ``last_ratio``)."""

    conditions: list[Any]

    def of(self, name: str) -> Any:
        """Condition ``name`` (``None``: not run)."""
        return next((c for c in self.conditions if c.name == name), None)

    def not_run(self, name: str) -> str | None:
        """Why a claim about condition ``name`` does not apply: it was not run (``None``: it was)."""
        if self.of(name) is None:
            return f"the condition {name} was not run (--conditions)"
        return None

    def excess(self, name: str, last: bool = True) -> float:
        """:func:`~me_interp.claims.excess_fraction` of condition ``name``'s prompt-mean norm ratio
        over the baseline's, at the last (or the ME) layer."""
        key = "last_ratio" if last else "me_ratio"
        after, before = (np.mean(getattr(self.of(n), key)) for n in (name, "baseline"))
        return claims.excess_fraction(float(after), float(before))

    def not_removed(self, name: str, edit: str, at_last: bool = True) -> str | None:
        """Why condition ``name`` (said as ``edit``) was not a removal (``None``: it was): its token
        is not ordinary at the ME layer or (``at_last``) the last layer (:func:`not_ordinary`)."""
        c = self.of(name)
        where = {"the ME layer": c.me_ratio}
        if at_last:
            where["the last layer"] = c.last_ratio
        return not_ordinary(where, edit)


def unedited_names(layer: int) -> list[str]:
    """The unedited activations of ``layer`` every condition's factory reads."""
    sites = ("ffn_normalized", "ffn_out", "ffn_act", "resid_post")
    return [names.site(s, layer) for s in sites]


def condition_hooks(
    model: LoadedModel,
    batch: Batch,
    cond: str,
    layer: int,
    p: int,
    dims: Sequence[int],
    alpha: float = 1.0,
    acts: Mapping[str, torch.Tensor] | None = None,
) -> list:
    """The hooks of condition ``cond`` (module docstring) at token ``p`` of ``layer``."""
    L, at = layer, [p]
    edits = {
        "remove_ffn": lambda: causal.remove_massive(
            model, batch, L, at, None, "ffn_out", acts=acts
        ),
        "remove_dims": lambda: causal.remove_massive(model, batch, L, at, dims, acts=acts),
        "remove_all": lambda: causal.remove_massive(model, batch, L, at, None, acts=acts),
        "patch_other": lambda: causal.patch_across_prompts(model, batch, L, at, acts=acts),
        "flatten_gain": lambda: causal.flatten_ffn_norm_gain(model, batch, L, at, acts=acts),
        "cap_ffn": lambda: causal.cap_ffn_output(model, batch, L, at, acts=acts),
        "scale_product": lambda: causal.scale_ffn_product(model, batch, L, at, alpha, acts=acts),
        "normalize_product": lambda: causal.normalize_ffn_product(model, batch, L, at, acts=acts),
        "zero_dims": lambda: causal.ablate_dims(model, batch, L, at, dims, "zero"),
        "mean_dims": lambda: causal.ablate_dims(model, batch, L, at, dims, "mean", acts=acts),
    }
    if cond not in edits:
        raise ValueError(f"unknown condition {cond!r}; choose from {', '.join(edits)}")
    return edits[cond]()


def edit_sizes(
    h: Float[torch.Tensor, "batch d_model"], dims: Sequence[int], conds: Sequence[str]
) -> dict[str, list[float]]:
    """Per prompt ``‖Δ‖ / ‖h_p‖`` of the residual edits among ``conds`` (``zero_dims``,
    ``mean_dims``) on the unedited state ``h`` of the massive token: how large an edit each is (a
    mean ablation of a state shared by every prompt is the identity)."""
    d = list(dims)
    delta = {"zero_dims": h[:, d], "mean_dims": h[:, d] - h[:, d].mean(0, keepdim=True)}
    norm = h.norm(dim=-1)
    return {c: (x.norm(dim=-1) / norm).tolist() for c, x in delta.items() if c in conds}
