"""What the per-layer reports (``me_layer``, ``mechanism``, ``invariance``, ``attention_sinks``) share.

:func:`detect` (a Site to a :class:`Detection`), :class:`LayerReport` (the common part of their
results) and the statistics of their claims. Their Config is
:class:`~me_interp.study.config.DetectConfig`.

**Units.** The massive token's state depends only on its prefix ``x[: m + 1]`` (causal attention), so
prompts whose massive token has the same prefix measure it once: the claims are resampled over those
distinct prefixes (``Units``, the ``Sample.keys``), and the held-out claims select on one seeded half
of them and test on the other.

**Peaks** (:func:`peak_measure`): the ME layer is chosen on the selection half, and each held-out unit
is one outcome: is that layer the argmax of its per-layer curve? Chance is 1 / L under exchangeable
layers. With ``--layer`` the layer is given, not selected, and every unit is tested.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from me_interp import claims
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.site import Site, Units, selected_layer
from me_interp.study.config import CommonConfig
from me_interp.study.result import Headed, RunHeader, run_header
from me_interp.terminal import fmt_table


@dataclass(frozen=True)
class Detection:
    """The ME layer an experiment tests and the massive token of each prompt.

    Attributes:
        site: where the massive activation is (``probes.site.locate``): the tested layer
            (``--layer`` if given, else the detected ME layer), each prompt's massive token (position
            0 with ``--position zero``), its massive positions, and the units.
        selected_layer: the layer the held-out claims test: the ME layer detected on the selection
            half alone (``None`` when that half has none), the tested layer when given or when
            nothing can be held out.
    """

    site: Site
    selected_layer: int | None

    @property
    def me_layer(self) -> int:
        assert self.site.layer is not None  # detect raises otherwise
        return self.site.layer

    @property
    def reference(self) -> list[int]:
        return list(self.site.reference)

    @property
    def massive_positions(self) -> list[list[int]]:
        return [list(p) for p in self.site.positions]

    def report_fields(self, cfg: CommonConfig, model: LoadedModel, batch: Batch) -> dict[str, Any]:
        """The :class:`LayerReport` fields this detection fills (the run header with the Site)."""
        return {
            "header": run_header(cfg, model, len(batch), self.site),
            "bos_prepended": model.bos_prepended(batch),
            "detected_me_layer": self.site.location.me_layer,
            "units": self.site.units,
            "selected_layer": self.selected_layer,
        }


def detect(site: Site) -> Detection:
    """The tested layer and massive tokens of ``site`` (located by the framework on the
    experiment's scan), with the layer the held-out claims test (``probes.site.selected_layer``).

    Raises:
        claims.NotApplicable: no massive activation and no ``--layer``.
    """
    site.require("pass --layer to measure a chosen layer anyway")
    return Detection(site, selected_layer(site))


@dataclass(frozen=True)
class LayerReport(Headed):
    """What the per-layer reports (mechanism, invariance, attention_sinks) share: the run header
    (with the tested ME layer, ``header.layer``, given by ``--layer`` or detected), the detected ME
    layer, the units of the massive token with the layer the held-out claims test
    (``selected_layer``, see :class:`Detection`). Each report adds ``layers``: one typed row per
    layer (a dataclass with a ``layer`` field)."""

    header: RunHeader
    bos_prepended: bool
    detected_me_layer: int | None
    units: Units
    selected_layer: int | None

    @property
    def me_layer(self) -> int | None:
        """The tested ME layer (given, or detected)."""
        return self.header.layer

    @property
    def given(self) -> bool:
        return self.header.layer_given

    def me_text(self) -> str:
        """``"L (1-based L+1)"`` (``given`` when not the detected one), or ``"none"``."""
        me = self.me_layer
        if me is None:
            return "none"
        given = (
            "" if me == self.detected_me_layer else f", given; detected {self.detected_me_layer}"
        )
        return f"{me} (1-based {me + 1}{given})"

    def layer_table(
        self, head: Sequence[str], columns: Sequence[str], cells: Callable[[Any], tuple]
    ) -> str:
        """The summary: a line with the model, BOS, prompts and ``head``, then a table with one
        row per layer: the layer, ``*`` at the ME layer, then ``cells(row)``."""
        layers = self.layers  # type: ignore[attr-defined]  # every report declares its rows
        rows = [(r.layer, "*" if r.layer == self.me_layer else "", *cells(r)) for r in layers]
        line = f"model: {self.model}   bos: {self.bos}   prompts: {self.n_prompts}   "
        return line + "   ".join(head) + "\n\n" + fmt_table(["layer", "ME", *columns], rows)

    def peak(self, values: np.ndarray) -> claims.Outcomes:
        """:func:`peak_measure` of ``values[prompt, layer]`` at the selected layer.

        Raises:
            claims.NotApplicable: the selection half has no ME layer.
        """
        if self.selected_layer is None:
            raise claims.NotApplicable(
                f"the selection half ({len(self.units.prompts(self.units.select))} prompts) has no "
                "ME layer of its own, so there is no layer chosen apart from the tested prompts"
            )
        return peak_measure(values, self.selected_layer, self.units, self.given)

    def peak_placebo(self, values: np.ndarray) -> claims.Placebo:
        """Every layer in the selected layer's place: the share of the tested units peaking there."""
        at = lambda la: peak_measure(values, la, self.units, self.given)  # noqa: E731
        return claims.placebo(at, self.peak(values) and self.selected_layer, range(len(values[0])))

    def peak_details(self, values: np.ndarray) -> str:
        """Where the selected layer is, how the prompts were split, and where the curve peaks."""
        return peak_details(values, self.selected_layer, self.units, self.given, self.me_text())


# ------------------------------------------------------------------------------------------
# statistics shared by the claims
# ------------------------------------------------------------------------------------------


def as_array(values: Sequence) -> np.ndarray:
    """Per-prompt values as a float array (``[prompt]`` or ``[prompt, layer]``)."""
    return np.asarray(values, dtype=np.float64)


def unit_curves(values: np.ndarray, units: Units) -> np.ndarray:
    """``[unit, layer]``: the mean over each unit's prompts of ``values[prompt, layer]`` (NaN where
    all of them are)."""
    out = np.full((units.n, values.shape[1]), np.nan)
    for u, g in enumerate(units.groups):
        rows = values[list(g)]
        ok = np.isfinite(rows)
        n = ok.sum(0)
        out[u] = np.where(n > 0, np.where(ok, rows, 0.0).sum(0) / np.maximum(n, 1), np.nan)
    return out


def peak_measure(values: np.ndarray, layer: int, units: Units, given: bool) -> claims.Outcomes:
    """Per tested unit, whether ``layer`` is where its curve (:func:`unit_curves`) peaks.

    The tested units are the held-out half (``layer`` chosen on the other half), or every unit when
    the layer is ``given`` or when fewer than 2 units leave nothing to hold out (one outcome, which
    the engine does not decide on). Units whose curve is all NaN are left out.
    """
    curves = unit_curves(np.asarray(values, dtype=np.float64), units)
    tested = range(units.n) if given or not units.held_out else units.heldout
    ok = [u for u in tested if np.isfinite(curves[u]).any()]
    o = claims.peak_outcomes(curves, layer, ok)
    unit = "prompts (layer given)" if given else "held-out prompts"
    return claims.Outcomes(o.outcomes, [units.label(u) for u in ok], unit=unit)


def peak_details(
    values: np.ndarray, layer: int | None, units: Units, given: bool, me_text: str
) -> str:
    """The context of a peak claim: the layer and how it was chosen, the split, the chance level,
    and where the mean curve peaks."""
    means = np.nanmean(unit_curves(np.asarray(values, dtype=np.float64), units), axis=0)
    L = len(means)
    best = int(np.nanargmax(np.where(np.isfinite(means), means, -np.inf)))
    if given:
        how = f"layer {layer} given (--layer), not selected: all {units.n} units tested"
    else:
        how = f"ME layer of the selection half: {layer}; {units.text()}"
    at = "nan" if layer is None else f"{means[layer]:.3g}"
    return (
        f"ME layer {me_text}; {how}; chance of a given layer under the null of exchangeable "
        f"layers 1/{L} = {1 / L:.3g}; mean curve {at} at the tested layer, largest at layer {best} "
        f"({means[best]:.3g})"
    )
