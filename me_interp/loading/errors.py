"""The errors of model loading (every loading module raises these; the messages say what to do)."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model is not a pre-norm decoder with RMSNorm and a gated FFN."""


__all__ = ["ModelLoadError", "UnsupportedArchitectureError"]
