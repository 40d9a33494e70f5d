"""me_interp: locate, measure and causally test massive activations (the ME layer) in LLMs.

What a notebook needs, in one import (every function that runs a forward takes a prompt ``str``, a
list of prompts or a :class:`Batch`)::

    import me_interp
    model = me_interp.load_model()                          # the bundled SmolLM2-135M-Instruct
    me_interp.find_me_layer(model, "The capital of France is Paris.")   # where it is born
    me_interp.locate(model, ["…", "…"])                     # the Site: layer, positions, dims, units
    me_interp.attention_stats(model, "…")                   # attention to position 0, entropy
    me_interp.we_mask_effect(model, "…", rate=0.1)          # WeMask: perplexity, KL, sink
    me_interp.patch_sweep(model, clean, corrupt, "resid_pre", metrics)   # activation patching
    me_interp.load_run("runs/me_layer/<run_id>")            # a finished run's typed Result
"""

from typing import TYPE_CHECKING

from me_interp.evaluation import WeMaskEffect, we_mask_effect
from me_interp.interventions.wemask import we_mask
from me_interp.loading import load_model
from me_interp.loading.errors import ModelLoadError, UnsupportedArchitectureError
from me_interp.loading.inputs import as_batch
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.patching import LogitDiff, normalized, patch_sweep
from me_interp.patching.pairs import Pair, logit_metric, tokenize_pairs
from me_interp.probes import (
    MELocation,
    attention_probe,
    attention_stats,
    find_me_layer,
    geometry_scan,
    scan_norms,
)
from me_interp.probes.site import Site, locate

if TYPE_CHECKING:
    from me_interp.battery import load_run

__version__ = "0.1.0"


def __getattr__(name: str):  # load_run needs every experiment's Result type: imported on first use
    if name == "load_run":
        from me_interp.battery import load_run

        return load_run
    raise AttributeError(f"module 'me_interp' has no attribute {name!r}")


__all__ = [
    "Batch",
    "LoadedModel",
    "LogitDiff",
    "MELocation",
    "ModelLoadError",
    "Pair",
    "Site",
    "UnsupportedArchitectureError",
    "WeMaskEffect",
    "__version__",
    "as_batch",
    "attention_probe",
    "attention_stats",
    "find_me_layer",
    "geometry_scan",
    "load_model",
    "load_run",
    "locate",
    "logit_metric",
    "normalized",
    "patch_sweep",
    "scan_norms",
    "tokenize_pairs",
    "we_mask",
    "we_mask_effect",
]
