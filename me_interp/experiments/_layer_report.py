"""What the per-layer reports (``mechanism``, ``invariance``, ``attention_sinks``) share.

:class:`DetectConfig` holds the fields of the experiments that detect the ME layer and the massive
token themselves, :func:`detect` turns a norm scan into a :class:`Detection`, :class:`LayerReport` is
the common part of their results (one dict of measures per layer), and :func:`peak_z` /
:func:`relative_drop` are the bootstrapped statistics their claims are judged on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from me_interp import claims
from me_interp.experiments.common import INDEX_CONVENTION, CommonConfig, fmt_table
from me_interp.experiments.me_layer import no_massive_why
from me_interp.models import LoadedModel
from me_interp.probes.massive import (
    Criterion,
    MELocation,
    locate_me_layer,
    massive_reference,
    massive_tokens,
)
from me_interp.probes.norms import NormScan

PositionChoice = Literal["detected", "zero"]


@dataclass(frozen=True)
class DetectConfig(CommonConfig):
    """Fields of the experiments that detect the ME layer and the massive token themselves.

    Attributes:
        criterion: massive-activation criterion for the ME-layer detection (sun, norm, either,
            both).
        position: ``detected`` = the detected massive token of each prompt; ``zero`` = position 0.
        layer: the ME layer to test (0-based); ``None`` = detected. On a model without a massive
            activation the claims are not applicable unless a layer is given.
    """

    criterion: str = "sun"
    position: PositionChoice = "detected"
    layer: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        Criterion(kind=self.criterion)  # type: ignore[arg-type]
        if self.position not in ("detected", "zero"):
            raise ValueError(f"position must be 'detected' or 'zero', got {self.position!r}")
        if self.layer is not None and self.layer < 0:
            raise ValueError(f"layer must be >= 0, got {self.layer}")

    def detection(self) -> Criterion:
        return Criterion(kind=self.criterion)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Detection:
    """The ME layer an experiment tests and the massive token of each prompt.

    Attributes:
        location: the full detection (``probes.massive``).
        me_layer: the tested layer: ``--layer`` if given, else the detected ME layer.
        given: whether ``me_layer`` was given rather than detected.
        reference: the massive token of each prompt (its largest-norm massive token at ``me_layer``,
            position 0 where none; all 0 with ``--position zero``).
        massive_positions: every massive position of each prompt at ``me_layer``.
    """

    location: MELocation
    me_layer: int
    given: bool
    reference: list[int]
    massive_positions: list[list[int]]


def detect(cfg: DetectConfig, model: LoadedModel, scan: NormScan) -> Detection:
    """The ME layer and massive tokens of a norm scan (see :class:`Detection`).

    Raises:
        claims.NotApplicable: no massive activation and no ``cfg.layer``.
    """
    crit = cfg.detection()
    loc = locate_me_layer(scan, crit)
    B = scan.mask.shape[0]
    if cfg.layer is not None:
        me = model.check_layer(cfg.layer)
        ref = massive_reference(scan, crit, me)
        mt = massive_tokens(scan, crit)[me]
        mpos = [torch.nonzero(row).flatten().tolist() for row in mt]
    elif loc.me_layer is None:
        raise claims.NotApplicable(
            no_massive_why(loc, B) + "; pass --layer to measure a chosen layer anyway"
        )
    else:
        me, ref, mpos = loc.me_layer, list(loc.reference_positions), loc.massive_positions
    if cfg.position == "zero":
        ref = [0] * B
    return Detection(loc, me, cfg.layer is not None, [int(r) for r in ref], mpos)


@dataclass
class LayerReport:
    """What the per-layer reports (mechanism, invariance, attention_sinks) share: the run, the
    tested ME layer (given or detected), and one dict of measures per layer."""

    model: str
    bos: str
    bos_prepended: bool
    n_prompts: int
    me_layer: int | None
    detected_me_layer: int | None
    layers: list[dict[str, Any]]

    def series(self, key: str, sub: str | None = None) -> list:
        """``layers[i][key]`` (or ``layers[i][key][sub]``) for every layer."""
        return [row[key][sub] if sub else row[key] for row in self.layers]

    def me_text(self) -> str:
        """``"L (1-based L+1)"`` (``given`` when not the detected one), or ``"none"``."""
        me = self.me_layer
        if me is None:
            return "none"
        given = (
            "" if me == self.detected_me_layer else f", given; detected {self.detected_me_layer}"
        )
        return f"{me} (1-based {me + 1}{given})"

    def layer_table(self, columns: Sequence[str], cells: Callable[[dict[str, Any]], tuple]) -> str:
        """A table with one row per layer: the layer, ``*`` at the ME layer, then ``cells(row)``."""
        rows = [
            (r["layer"], "*" if r["layer"] == self.me_layer else "", *cells(r)) for r in self.layers
        ]
        return fmt_table(["layer", "ME", *columns], rows)

    def header(self) -> dict[str, Any]:
        """The first keys of ``result.json``."""
        return {
            "model": self.model,
            "bos": self.bos,
            "bos_prepended": self.bos_prepended,
            "index_convention": INDEX_CONVENTION,
            "me_layer": self.me_layer,
            "me_layer_1based": None if self.me_layer is None else self.me_layer + 1,
            "detected_me_layer": self.detected_me_layer,
        }


def as_array(per_prompt: dict[str, Any], key: str) -> np.ndarray:
    """``per_prompt[key]`` as a float array (``[prompt]`` or ``[prompt, layer]``)."""
    return np.asarray(per_prompt[key], dtype=np.float64)


def peak_z(values: np.ndarray, layer: int, seed: int, unit: str = "prompts") -> claims.Estimate:
    """How far ``layer`` stands out from every other layer: ``claims.null_z`` of the per-layer means of
    ``values[prompt, layer]``, bootstrapped over prompts. Layers that are not finite for every prompt
    are left out of the null (a NaN estimate when ``layer`` itself is not finite)."""
    ok = np.isfinite(values).all(axis=0)
    if not ok[layer]:
        nan = float("nan")
        return claims.Estimate(nan, nan, nan, values.shape[0], unit)
    keep = np.flatnonzero(ok)
    at = int(np.flatnonzero(keep == layer)[0])
    return claims.bootstrap(
        values[:, keep], lambda a: claims.null_z(a.mean(0).tolist(), at), unit=unit, seed=seed
    )


def relative_drop(
    reference: np.ndarray, value: np.ndarray, seed: int, unit: str = "prompts"
) -> claims.Estimate:
    """``1 − mean(value) / mean(reference)`` over paired per-prompt values, bootstrapped over
    prompts: how far ``value`` lies below ``reference``, as a fraction of it."""
    rows = np.stack([reference, value], axis=1)
    return claims.bootstrap(
        rows, lambda a: 1.0 - a[:, 1].mean() / a[:, 0].mean(), unit=unit, seed=seed
    )
