"""Activation patching: batched sweeps over layers, positions and heads, with user pairs.

* :mod:`me_interp.patching.metrics` — what a patched run is scored by (massive-activation metrics,
  logit metrics, any callable);
* :mod:`me_interp.patching.sweep` — the batched sweep (:func:`patch_sweep`) and its result;
* :mod:`me_interp.patching.suffix` — running only the blocks and positions a patch can change;
* :mod:`me_interp.patching.pairs` — clean/corrupt pairs from a JSONL file, with their metrics;
* :mod:`me_interp.patching.heads` — sets of heads patched together (:func:`patch_head_sets`);
* :mod:`me_interp.patching.attribution` — the first-order estimate of a whole sweep from one forward
  and one backward pass, and its rank agreement with exact patching.
"""

from me_interp.patching.attribution import attribution_sweep, rank_agreement
from me_interp.patching.heads import HeadSetResult, patch_head_sets
from me_interp.patching.metrics import (
    LOGITS,
    AnswerProb,
    Custom,
    KLToClean,
    LogitDiff,
    NormRatio,
    PatchMetric,
    Projection,
    SinkMass,
    normalized,
    tile_rows,
)
from me_interp.patching.suffix import last_token_logits
from me_interp.patching.sweep import (
    HEAD_SITES,
    PATCH_SITES,
    SweepResult,
    evaluate_metrics,
    patch_loop,
    patch_sweep,
    site_hook,
)
from me_interp.probes.batching import STRICT_ENV, strict

__all__ = [
    "HEAD_SITES",
    "LOGITS",
    "PATCH_SITES",
    "STRICT_ENV",
    "AnswerProb",
    "Custom",
    "KLToClean",
    "LogitDiff",
    "NormRatio",
    "PatchMetric",
    "Projection",
    "SinkMass",
    "SweepResult",
    "evaluate_metrics",
    "last_token_logits",
    "normalized",
    "patch_loop",
    "patch_sweep",
    "site_hook",
    "strict",
    "tile_rows",
    "attribution_sweep",
    "rank_agreement",
    "HeadSetResult",
    "patch_head_sets",
]
