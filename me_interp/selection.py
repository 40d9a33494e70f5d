"""The ground floor of dim and neuron selection: how a rate becomes a count, and TopK(|x|).

Probes, interventions and edits all select dims the same way (WeMask's ``TopK(|w|, r·d)``, the
alignment probes' top-|w| dims, the gain edits' top dims), so the rule lives here, below all of them:
no probe imports an intervention to select.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float, Int


def check_fraction(value: Any, name: str) -> float:
    """Return ``value`` as a float if it is a number in [0, 1], else raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(value).__name__}")
    v = float(value)
    if not (0.0 <= v <= 1.0) or math.isnan(v):
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return v


#: How a rate ``r`` of ``d`` dims becomes a count (:func:`n_selected`): ``"half_up"`` rounds
#: ``r·d`` half up, ``floor(r·d + 0.5)`` — the one rule of this package (every WeMask variant of the
#: paper, ``probes.alignment``'s fractional ``k``); ``"int"`` truncates, Python's ``int(r·d)`` — the
#: released WeMask code's rule, used only by its ``activation`` variant. ``d = 576``, ``r = 0.1``:
#: 58 and 57.
COUNT_RULES: tuple[str, ...] = ("half_up", "int")


def n_selected(rate: float | int, d: int, rule: str = "half_up") -> int:
    """How many of ``d`` dims a rate ``rate`` ∈ [0, 1] selects, by ``rule`` (:data:`COUNT_RULES`):
    ``floor(rate·d + 0.5)`` (``"half_up"``) or ``int(rate·d)`` (``"int"``, the released code)."""
    rate = check_fraction(rate, "rate")
    if rule == "half_up":
        return min(d, int(math.floor(rate * d + 0.5)))
    if rule == "int":
        return min(d, int(rate * d))
    raise ValueError(f"unknown count rule {rule!r}; choose one of {COUNT_RULES}")


def top_abs_dims(x: Float[torch.Tensor, "*lead d"], k: int) -> Int[torch.Tensor, "*lead k"]:
    """``TopK(|x|, k)``: indices of the ``k`` largest ``|x|`` along the last axis, largest first
    (ties: lower index first, a stable sort). The one TopK-``|x|`` of the package: WeMask's dim
    selections, :func:`me_interp.probes.alignment.top_gain_dims` and
    :func:`me_interp.edits.gains.top_dims` all call it."""
    order = torch.sort(x.detach().abs().float(), dim=-1, descending=True, stable=True).indices
    return order[..., :k]
