"""me_interp: locate, measure and causally test massive activations (the ME layer) in LLMs."""

from me_interp.models import (
    Batch,
    LoadedModel,
    ModelLoadError,
    UnsupportedArchitectureError,
    load_model,
)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "LoadedModel",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "__version__",
    "load_model",
]
