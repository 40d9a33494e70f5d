"""Read-only measurements: (model, batch or scan) -> tensors and small dataclasses."""

from me_interp.probes.attention import AttentionStats, attention_stats
from me_interp.probes.massive import (
    Criterion,
    Event,
    MELocation,
    find_me_layer,
    locate_me_layer,
    massive_tokens,
)
from me_interp.probes.norms import NormScan, ratio_to_others, scan_norms, top_ratio

__all__ = [
    "AttentionStats",
    "attention_stats",
    "find_me_layer",
    "Criterion",
    "Event",
    "MELocation",
    "NormScan",
    "locate_me_layer",
    "massive_tokens",
    "ratio_to_others",
    "scan_norms",
    "top_ratio",
]
