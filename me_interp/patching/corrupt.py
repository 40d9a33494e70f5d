"""Corrupt runs in which the massive activation never forms, and the check that it did not.

* ``first_token`` — token 0 replaced by token 1 of each prompt (same length): on a model whose
  massive token is a BOS it removes the activation without overwriting anything inside the model;
* ``remove_input`` — the massive token's residual stream entering the ME layer set to the other
  tokens' mean (:func:`me_interp.interventions.causal.remove_massive` at ``resid_pre``);
* ``remove_ffn`` — the ME layer's FFN output at the massive token set to the other tokens' mean.

:func:`median_ratios` measures ``R = ‖h_p‖ / median_{t≠p} ‖h_t‖`` at a layer's output under such
hooks; the median, not the mean, of the others, so that a corruption that makes a *second* token
massive (SmolLM2 does this when token 0 is doubled) does not count as removing the activation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from me_interp import claims, names
from me_interp.interventions import causal
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record

CORRUPTIONS = ("first_token", "remove_input", "remove_ffn")


def first_token_corrupt(clean: Batch) -> Batch:
    """Token 0 replaced by token 1 of each prompt (same length)."""
    t = clean.tokens.clone()
    t[:, 0] = t[:, 1]
    return Batch(t, clean.attention_mask.clone(), None)


def corrupt_for(
    model: LoadedModel, corruption: str, layer: int, position: int, batch: Batch
) -> tuple[Batch, list]:
    """The corrupt run of ``batch`` under ``corruption`` (one of :data:`CORRUPTIONS`): its tokens
    and its hooks (per prompt, for this batch)."""
    if corruption == "first_token":
        return first_token_corrupt(batch), []
    if corruption not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {corruption!r}; choose from {CORRUPTIONS}")
    where = "resid_pre" if corruption == "remove_input" else "ffn_out"
    return batch, causal.remove_massive(model, batch, layer, [position], None, site=where)


def undo_cell(corruption: str, layer: int, position: int) -> tuple[str, int, int]:
    """The (site, layer, position) cell the corruption overwrote: patching it back undoes it."""
    return {
        "first_token": ("resid_pre", 0, 0),
        "remove_input": ("resid_pre", layer, position),
        "remove_ffn": ("mlp_out", layer, position),
    }[corruption]


def median_ratios(
    model: LoadedModel, batch: Batch, layer: int, position: int, fwd_hooks: Sequence = ()
) -> torch.Tensor:
    """Per prompt ``‖h_p‖ / median_{t≠p} ‖h_t‖`` at the output of ``layer`` (under ``fwd_hooks``)."""
    name = names.resid_post(layer)
    acts = Activations(model, batch, [name])
    record(model, batch, [acts], fwd_hooks=fwd_hooks, last_layer=layer, max_tokens=None)
    n = acts[name].float().norm(dim=-1).cpu()
    keep = batch.attention_mask.bool().cpu().clone()
    keep[:, position] = False
    others = n.masked_fill(~keep, float("nan")).nanmedian(-1).values
    return n[:, position] / others


@dataclass(frozen=True)
class Corrupted:
    """A chosen corruption of a clean batch: its name, tokens and hooks, how it was chosen, and
    ``R`` per prompt at the ME layer's output in the clean and the corrupt run."""

    corruption: str
    batch: Batch
    hooks: list
    note: str
    ratio_clean: torch.Tensor
    ratio_corrupt: torch.Tensor


def corrupt(
    model: LoadedModel, clean: Batch, corruption: str, layer: int, position: int
) -> Corrupted:
    """The corrupt run of ``clean`` under ``corruption``; ``auto`` is ``first_token`` when that
    removes the massive activation (the ``removed`` rule of :data:`me_interp.claims.THRESHOLDS` on
    ``(R − 1)`` corrupt over clean, prompt means), else ``remove_input``."""
    before = median_ratios(model, clean, layer, position)
    note = ""
    if corruption in ("auto", "first_token"):
        after = median_ratios(model, first_token_corrupt(clean), layer, position)
        frac = claims.excess_fraction(float(after.mean()), float(before.mean()))
        note = (
            f"first-token replacement: ME-layer (R - 1) corrupt / clean = {frac:.3g} (R = norm / "
            f"median of the others: {float(before.mean()):.4g} -> {float(after.mean()):.4g})"
        )
        if corruption == "auto":
            corruption = "first_token" if frac <= claims.threshold("removed") else "remove_input"
            note += f"; auto chose {corruption}"
    batch, hooks = corrupt_for(model, corruption, layer, position, clean)
    if corruption != "first_token":
        after = median_ratios(model, clean, layer, position, hooks)
    return Corrupted(corruption, batch, hooks, note, before, after)
