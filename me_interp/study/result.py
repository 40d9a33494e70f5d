"""What every experiment's Result shares: the run header, and the one way a Result is written and read.

A Result is a tree of frozen dataclasses whose first field is a :class:`RunHeader` (model, BOS rule,
prompts, seed, and the Site the run studied). It is written by :func:`me_interp.io.to_jsonable` and
read back by :func:`me_interp.io.from_jsonable` from its type hints — no hand-written ``to_dict``, no
``dict[str, Any]`` field, no row found by a string key — so ``result.json`` and the typed object hold
the same thing (:func:`roundtrip` is the test of that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from me_interp import io
from me_interp.study.config import INDEX_CONVENTION, CommonConfig


@dataclass(frozen=True)
class RunHeader:
    """The run a Result comes from.

    Attributes:
        model: the model's name; ``bos``: the BOS rule it ran with.
        prompts: the prompt file, or ``built-in``; ``n_prompts``: how many prompts the run used.
        seed: the run's seed.
        layer: the layer the run studied (the Site's: given, or the detected ME layer; ``None``
            without one), ``layer_1based`` the same layer counted from 1, ``layer_given`` whether it
            was given; ``me_layer`` the detected ME layer.
        position: the massive position (commonest over prompts); ``dims`` the massive dims at
            ``layer``; ``n_units`` the distinct massive-token prefixes (the effective n);
            ``unit_keys`` per prompt, its massive-token prefix (what the claims engine resamples a
            statistic of the massive token's state by, ``claims.Spec.massive_state``).
        index_convention: how layers are counted.
    """

    model: str
    bos: str
    prompts: str
    n_prompts: int
    seed: int
    layer: int | None = None
    layer_1based: int | None = None
    layer_given: bool = False
    me_layer: int | None = None
    position: int | None = None
    dims: tuple[int, ...] = ()
    n_units: int | None = None
    index_convention: str = INDEX_CONVENTION
    unit_keys: tuple[str, ...] = ()


class Headed:
    """What a Result with a ``header: RunHeader`` field answers for it: ``model``, ``bos``, ``seed``
    (the claims' bootstrap seed), ``n_prompts`` and ``layer`` read from the header."""

    header: RunHeader

    @property
    def model(self) -> str:
        return self.header.model

    @property
    def bos(self) -> str:
        return self.header.bos

    @property
    def seed(self) -> int:
        return self.header.seed

    @property
    def n_prompts(self) -> int:
        return self.header.n_prompts

    @property
    def layer(self) -> int | None:
        return self.header.layer


def run_header(cfg: CommonConfig, model: Any, n_prompts: int, site: Any = None) -> RunHeader:
    """The :class:`RunHeader` of a run of ``cfg`` on ``model`` over ``n_prompts`` prompts, with the
    :class:`me_interp.probes.site.Site` it studied (if any)."""
    base = {
        "model": model.name,
        "bos": model.bos,
        "prompts": cfg.prompts or "built-in",
        "n_prompts": int(n_prompts),
        "seed": cfg.seed,
    }
    if site is None:
        return RunHeader(**base)
    layer = site.layer
    return RunHeader(
        **base,
        layer=layer,
        layer_1based=None if layer is None else layer + 1,
        layer_given=site.given,
        me_layer=site.me_layer,
        position=site.position,
        dims=tuple(site.dims),
        n_units=site.units.n,
        unit_keys=tuple(site.units.keys),
    )


def roundtrip(result: Any) -> Any:
    """``result`` written to JSON values and read back as its own type (equal, field by field, to
    ``result``; NaN stays NaN)."""
    return io.from_jsonable(type(result), io.to_jsonable(result))
