"""What the attention-sink study reads of one forward over its prompts, in one call.

:func:`sink_scan` runs the prompts once with three recorders (``probes.batching.record``): the token
norms at the sites of :data:`me_interp.names.SITES` (:class:`~me_interp.probes.norms.NormRecorder`,
for the detection of the massive token), the attention to every key, its entropy and the BOS metric
(:class:`~me_interp.probes.attention.AttentionRecorder`) and the geometry of each prompt's layer
outputs over all tokens and without position 0 (:class:`~me_interp.probes.geometry.GeometryRecorder`).
The geometry without the massive token needs that token, known only after the detection:
:meth:`SinkScan.geometry` re-runs the prompts whose massive token is not the first.

A model of another backend (:func:`~me_interp.probes.batching.own_backend`) computes the same
statistics in its own traces (``model.sink_scan``; the nnsight backend keeps each prompt's Gram
matrix, so its geometry without any token needs no second run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from me_interp import names
from me_interp.loading.inputs import Prompts, as_batch
from me_interp.models import LoadedModel
from me_interp.probes.attention import AttentionRecorder
from me_interp.probes.batching import own_backend, record
from me_interp.probes.geometry import GeometryRecorder, GeometryScan
from me_interp.probes.norms import NormRecorder, NormScan


@dataclass(frozen=True)
class SinkScan:
    """The norms (:class:`NormScan`), the attention statistics (an :class:`AttentionRecorder`, whose
    ``probe`` gives the sink statistics of any positions) and ``without(reference)``: the
    :class:`GeometryScan` whose ``others`` leave out prompt ``b``'s token ``reference[b]``."""

    norms: NormScan
    attention: AttentionRecorder
    without: Callable[[Sequence[int]], GeometryScan]

    def geometry(self, reference: Sequence[int]) -> GeometryScan:
        """The geometry over all tokens and without each prompt's ``reference`` token (call once)."""
        return self.without(reference)


def sink_scan(model: LoadedModel, batch: Prompts) -> SinkScan:
    """Norms, attention statistics and geometry of ``batch`` (a prompt ``str``, a list of prompts or a :class:`~me_interp.models.Batch`) in one
    forward (see module docstring)."""
    batch = as_batch(model, batch)
    if own_backend(model):
        return model.sink_scan(batch)
    norms = NormRecorder(model, batch, names.SITES)
    att = AttentionRecorder(model, batch)
    geo = GeometryRecorder(model, batch)  # "others" without position 0
    record(model, batch, [norms, att, geo])

    def without(reference: Sequence[int]) -> GeometryScan:
        moved = [b for b, r in enumerate(reference) if r != 0]
        if moved:  # the geometry without the massive token, where it is not the first token
            geo.reference = torch.tensor(list(reference), dtype=torch.long)
            record(model, batch, [geo], rows=moved)
        return geo.result()

    return SinkScan(norms.result(), att, without)


__all__ = ["SinkScan", "sink_scan"]
