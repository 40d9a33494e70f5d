"""The errors of model loading (every loading module raises these; the messages say what to do)."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model is not a pre-norm decoder with RMSNorm and a gated FFN."""


class PlacementError(ModelLoadError):
    """The model's placement (offloaded weights, :mod:`me_interp.loading.placement`) does not allow
    what was asked: reading or editing a weight that is not resident."""


__all__ = ["ModelLoadError", "PlacementError", "UnsupportedArchitectureError"]
