"""Hook factories (TransformerLens and HF): interventions never mutate the model.

* :mod:`~me_interp.interventions.wemask` — WeMask and its dim selections (``weight``, ``activation``,
  ``random``, ``magnitude``), :func:`we_mask` (TL hooks), :func:`select_dims` (the shared selection);
* :mod:`~me_interp.interventions.soft` — ``h − α P_S h`` and ``h − α (⟨h,v⟩/‖v‖²) v``;
* :mod:`~me_interp.interventions.hf_hooks` — the same specs as PyTorch hooks on a plain HF model
  (training-aware WeMask);
* :mod:`~me_interp.interventions.generation` — greedy generation, correct with a KV cache;
* :mod:`~me_interp.interventions.causal` — the causal tests' hooks (remove, ablate, patch across
  prompts, transplant, cap or rescale the FFN, flatten its norm gain, set the FFN's own output at
  given positions), imported from there.
"""

from me_interp.interventions.core import tl_hooks
from me_interp.interventions.generation import Generation, generate
from me_interp.interventions.hf_hooks import HFInterventions, hf_interventions, hf_we_mask, load_hf
from me_interp.interventions.soft import (
    DirectionProjection,
    dim_projection,
    estimate_direction,
    project_dims,
    project_direction,
)
from me_interp.interventions.wemask import (
    STARTS,
    VARIANTS,
    WeMask,
    mask_layers,
    massive_positions,
    select_dims,
    we_mask,
)

__all__ = [
    "STARTS",
    "VARIANTS",
    "DirectionProjection",
    "Generation",
    "HFInterventions",
    "WeMask",
    "dim_projection",
    "estimate_direction",
    "generate",
    "hf_interventions",
    "hf_we_mask",
    "load_hf",
    "mask_layers",
    "massive_positions",
    "project_dims",
    "project_direction",
    "select_dims",
    "tl_hooks",
    "we_mask",
]
