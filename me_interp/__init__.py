"""me_interp: locate, measure and causally test massive activations (the ME layer) in LLMs."""

from me_interp.loading import load_model
from me_interp.loading.errors import ModelLoadError, UnsupportedArchitectureError
from me_interp.loading.loaded import Batch, LoadedModel

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "LoadedModel",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "__version__",
    "load_model",
]
