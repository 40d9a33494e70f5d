"""Read-only measurements: (model, batch or scan) -> tensors and small dataclasses.

Entry points (one forward pass each, hooks only at the sites they need, in length-sorted chunks and
without the unembedding: ``probes.batching``):

* :func:`scan_norms` / :func:`locate_me_layer` / :func:`find_me_layer` — token norms, massive
  activations over all positions, the ME layer and every emergence event;
* :func:`alignment_scan` — RMSNorm alignment (WeightNorm, Frac over TopK(|w|), KL(p‖g), deltas);
* :func:`ffn_scan` / :func:`top_neurons` — FFN concentration (Herfindahl C), magnification, neurons;
* :func:`invariance_scan` — directional invariance of the massive token (and its key) across inputs;
* :func:`attention_stats` / :func:`attention_probe` — attention to positions, sink rate, entropy;
* :func:`geometry_scan` — mean pairwise cosine, effective rank, participation ratio.

Each probe also has a *recorder* (``NormRecorder``, ``AlignmentRecorder``, ``FFNRecorder``,
``InvarianceRecorder``, ``AttentionRecorder``, ``GeometryRecorder``, …): :func:`record` runs several
of them in one forward pass, so an experiment measures everything it needs at once. Where a caller
needs the tensors themselves, :class:`Activations` keeps the whole activations at the hook points it
names (and only there).
"""

from me_interp.probes.activations import Activations
from me_interp.probes.alignment import (
    AlignmentRecorder,
    AlignmentScan,
    alignment_scan,
    massive_dim_gain_ranks,
)
from me_interp.probes.attention import (
    AttentionProbe,
    AttentionRecorder,
    AttentionStats,
    attention_probe,
    attention_stats,
)
from me_interp.probes.batching import Chunk, chunks, record
from me_interp.probes.ffn import FFNAtRecorder, FFNRecorder, FFNScan, ffn_scan, top_neurons
from me_interp.probes.geometry import (
    GeometryRecorder,
    GeometryScan,
    effective_rank,
    geometry_scan,
    participation_ratio,
)
from me_interp.probes.invariance import (
    InvarianceRecorder,
    InvarianceScan,
    UnitSumRecorder,
    invariance_scan,
)
from me_interp.probes.massive import (
    Criterion,
    Event,
    MELocation,
    find_me_layer,
    locate_me_layer,
    massive_reference,
    massive_tokens,
)
from me_interp.probes.norms import (
    NormRecorder,
    NormScan,
    ratio_to_others,
    scan_norms,
    top_ratio,
)

__all__ = [
    "Activations",
    "AlignmentRecorder",
    "AlignmentScan",
    "AttentionProbe",
    "AttentionRecorder",
    "AttentionStats",
    "Chunk",
    "Criterion",
    "Event",
    "FFNAtRecorder",
    "FFNRecorder",
    "FFNScan",
    "GeometryRecorder",
    "GeometryScan",
    "InvarianceRecorder",
    "InvarianceScan",
    "MELocation",
    "NormRecorder",
    "NormScan",
    "UnitSumRecorder",
    "alignment_scan",
    "attention_probe",
    "attention_stats",
    "chunks",
    "effective_rank",
    "ffn_scan",
    "find_me_layer",
    "geometry_scan",
    "invariance_scan",
    "locate_me_layer",
    "massive_dim_gain_ranks",
    "massive_reference",
    "massive_tokens",
    "participation_ratio",
    "ratio_to_others",
    "record",
    "scan_norms",
    "top_neurons",
    "top_ratio",
]
