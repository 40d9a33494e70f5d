"""Read-only measurements: (model, batch or scan) -> tensors and small dataclasses."""

from me_interp.probes.massive import Criterion, Event, MELocation, locate_me_layer, massive_tokens
from me_interp.probes.norms import NormScan, ratio_to_others, scan_norms, top_ratio

__all__ = [
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
