"""The experiment descriptor and the one way an experiment is run: set up, execute, judge, write.

An experiment module declares its ``Config``, its ``Result``, ``run(cfg, model, site) -> Result``
(pure: no printing, no files, no loading), how the inputs its Site is located on are built
(``inputs(cfg, model)``), its ``SPECS``, ``figures(result)``, ``summary(result)`` and one
:class:`Experiment` that names them::

    EXPERIMENT = Experiment("weight_swap", Config, run, SPECS, figures, summary, __doc__,
                            key_figures=("me_layer_after_swap",), inputs=weights.inputs)
    main = command(EXPERIMENT)

Everything else is done here, once: the model is loaded (:func:`model_for`) and the Site located
on the experiment's inputs (:func:`prepare`: one :func:`me_interp.probes.site.locate`, with the
layer, position, criterion and seed of the Config, :func:`site_arguments`), threads and seeds set,
``run`` executed under the attention kernel it asks for, its claims judged by
:func:`me_interp.claims.judge` (a :class:`claims.NotApplicable` from ``run`` makes every claim "not
applicable", with the reason), and ``config.json``, ``env.json``, ``result.json`` and the figures
written (:func:`write_outcome`). The command line is :mod:`me_interp.study.cli`; the battery is
:mod:`me_interp.battery`, a list of these descriptors.
"""

from __future__ import annotations

import os
import random
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from me_interp import claims, io, names, usage
from me_interp.interventions.causal import PromptBatch, prompt_batch
from me_interp.loading import load_model
from me_interp.loading.attention import kernel as attention_kernel
from me_interp.loading.errors import PlacementError
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.batching import record
from me_interp.probes.norms import NormRecorder, NormScan
from me_interp.probes.site import Site, locate
from me_interp.study.config import CommonConfig, placement_kwargs


@dataclass(frozen=True)
class Inputs:
    """What an experiment's ``inputs`` hook builds when a batch alone is not enough.

    A hook returns a :class:`Batch`, an object with a ``batch`` (e.g. an
    ``interventions.causal.PromptBatch``), or this; ``None`` when the run needs no Site.

    Attributes:
        batch: the prompts the Site is located on.
        scan: their norm scan when the hook ran one (the Site is located on it: one forward).
        made: what else the hook made for ``run`` (recorders read in the same forward, the number
            of prompts given, tokenised pairs), in the order ``run`` unpacks them from
            ``site.inputs.made``.
    """

    batch: Batch
    scan: NormScan | None = None
    made: tuple[Any, ...] = ()


def scanned_inputs(
    model: LoadedModel, batch: Batch, *recorders: Any, sites: Sequence[str] = names.SITES
) -> Inputs:
    """One forward over ``batch`` that records the norm scan at ``sites`` (the Site is located on
    it) and ``recorders`` (the ``made`` of :class:`Inputs`, in this order)."""
    norms = NormRecorder(model, batch, sites)
    record(model, batch, [norms, *recorders])
    return Inputs(batch, norms.result(), made=recorders)


def prompt_inputs(cfg: Any, model: LoadedModel) -> PromptBatch:
    """The ``inputs`` of the experiments that intervene at the Site: ``cfg``'s prompts, each cut to
    ``cfg.max_tokens`` tokens, at most ``cfg.max_prompts`` (``interventions.causal.prompt_batch``)."""
    return prompt_batch(model, cfg.load_prompts(), cfg.max_tokens, cfg.max_prompts)


@dataclass(frozen=True)
class Experiment:
    """What the framework needs of one experiment.

    Attributes:
        name: the experiment's name (its module, its run folder, its claims' id prefix).
        config: its Config class (a :class:`CommonConfig`; every field is a command-line flag).
        run: ``run(cfg, model, site) -> Result``; raises :class:`claims.NotApplicable` when the
            model lacks what its claims presuppose.
        specs: every claim it can state, declared (:class:`claims.Spec`).
        figures: ``figures(result) -> {stem: plotly Figure}``.
        summary: ``summary(result) -> str``, the short table the command line prints.
        doc: the module docstring (the command's description).
        key_figures: the figure stems the report shows inline beside the claims.
        attention: ``eager`` (attention patterns are read) or ``sdpa`` (the fused kernel: the
            experiment reads no attention pattern; recorded in ``env.json``).
        specs_for: when the result decides which claims apply, ``specs_for(result)``.
        result_type: its Result class, for readers of a finished run's ``result.json``
            (``io.read_result(result_type, run_dir)``); by default ``run``'s return annotation
            (given only where ``run`` may return more than one type).
        inputs: ``inputs(cfg, model)``: what the Site is located on (see :class:`Inputs`);
            ``None``: the experiment has no Site (``run`` gets ``site=None``).
    """

    name: str
    config: type[CommonConfig]
    run: Callable[..., Any]
    specs: tuple[claims.Spec, ...]
    figures: Callable[[Any], Mapping[str, Any]]
    summary: Callable[[Any], str]
    doc: str = ""
    key_figures: tuple[str, ...] = ()
    attention: str = "eager"
    specs_for: Callable[[Any], Sequence[claims.Spec]] | None = field(default=None, repr=False)
    result_type: type | None = field(default=None, repr=False)
    inputs: Callable[[Any, LoadedModel], Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.result_type is None:
            returned = typing.get_type_hints(self.run).get("return")
            if not isinstance(returned, type):
                raise TypeError(f"{self.name}: give result_type= (run returns {returned})")
            object.__setattr__(self, "result_type", returned)

    def judged(self, result: Any) -> list[claims.Claim]:
        """Every claim of this experiment judged on ``result``."""
        specs = self.specs if self.specs_for is None else self.specs_for(result)
        return claims.judge(specs, result)


SMALL_MODEL_PARAMS = 10_000_000
"""Below this many parameters a model's CPU forward is dominated by per-op overhead, not arithmetic."""


def apply_threads(cfg: CommonConfig, model: LoadedModel | None = None) -> None:
    """Set torch's CPU threads: ``cfg.threads`` if given; else, on small CPU machines (≤ 4 cores, no
    ``OMP_NUM_THREADS``), 1 thread for a small model (fewer than :data:`SMALL_MODEL_PARAMS`
    parameters, or before the model is known), where one thread measured several times faster than
    two, and for a larger one as many threads as cores are free now (:func:`usage.free_cores`,
    at least 1): on SmolLM2-135M with 2 idle cores the WeMask sweep is 1.8× and the mechanism scan
    1.5× faster than on one thread, but beside one CPU-bound process two threads make ``me_layer``
    1.5× slower than one (docs/performance.md). The battery calls it before every experiment, so a
    process that starts or stops on the machine in between is noticed."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
        return
    cores = os.cpu_count() or 1
    if not (
        (cfg.device or "cpu").startswith("cpu")
        and "OMP_NUM_THREADS" not in os.environ
        and cores <= 4
    ):
        return
    params = 0 if model is None else sum(p.numel() for p in model.hf.parameters())
    if params < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)
        return
    torch.set_num_threads(max(1, min(cores, round(usage.free_cores(cores=cores)))))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def model_for(cfg: CommonConfig, model: Any = None) -> LoadedModel:
    """``model`` if given (a LoadedModel, or an HF object is not accepted here), else load ``cfg.model``;
    with ``cfg.backend == "nnsight"`` the nnsight backend's model (:mod:`me_interp.backends.nnsight`)."""
    if getattr(cfg, "backend", "tl") == "nnsight":
        from me_interp.backends.nnsight import model_for as nnsight_model_for

        return nnsight_model_for(cfg, model)  # type: ignore[return-value]
    if isinstance(model, LoadedModel):
        return model
    if model is not None:
        raise TypeError("pass a LoadedModel (me_interp.load_model(...)) or None")
    return load_model(
        cfg.model, bos=cfg.bos, dtype=cfg.dtype, device=cfg.device, **placement_kwargs(cfg)
    )


def site_arguments(cfg: CommonConfig) -> dict[str, Any]:
    """What :func:`locate` is given from ``cfg``: its ``layer`` and ``position`` where it has them
    (``position`` ``"zero"`` is 0, ``"detected"`` the detected token), the criterion of its
    ``detection()`` where it has one (else the default :class:`~me_interp.probes.massive.Criterion`)
    and its ``seed``."""
    position = getattr(cfg, "position", None)
    return {
        "criterion": cfg.detection() if hasattr(cfg, "detection") else None,
        "layer": getattr(cfg, "layer", None),
        "position": {"zero": 0, "detected": None}.get(position, position),
        "seed": cfg.seed,
    }


def locate_inputs(cfg: CommonConfig, model: LoadedModel, made: Any) -> Site | None:
    """The Site on what an ``inputs`` hook ``made`` (see :class:`Inputs`; ``None``: no Site), located
    once with :func:`site_arguments`; it carries ``made`` as ``site.inputs``."""
    if made is None:
        return None
    batch = getattr(made, "batch", made)
    site = locate(model, batch, scan=getattr(made, "scan", None), **site_arguments(cfg))
    return replace(site, inputs=made)


def prepare(
    exp: Experiment, cfg: CommonConfig, model: Any = None, site: Site | None = None
) -> tuple[LoadedModel, Site | None]:
    """The model (:func:`model_for`) and the Site ``exp.run`` works on: ``site`` if given, else
    located on ``exp.inputs(cfg, model)`` (:func:`locate_inputs`). :func:`execute` calls it before
    ``run``; a ``run`` called without them (from a library or a test) calls it first itself."""
    if site is not None and model is None:
        raise ValueError("a site was given without the model it was located on")
    model = model_for(cfg, model)
    if site is None and exp.inputs is not None:
        site = locate_inputs(cfg, model, exp.inputs(cfg, model))
    return model, site


@dataclass
class Outcome:
    """What one experiment produced: its result (``None`` when not applicable), its claims and its
    figures; ``not_applicable`` holds the reason when the experiment did not apply."""

    result: Any
    claims: list[claims.Claim]
    figures: dict[str, Any]
    not_applicable: str | None = None
    attention: str = "eager"

    def result_json(self) -> Any:
        """What ``result.json`` holds: the result's fields plus ``claims`` (every claim as a dict)."""
        body = (
            {"not_applicable": self.not_applicable}
            if self.result is None
            else io.to_jsonable(self.result)
        )
        if not isinstance(body, dict):
            body = {"result": body}
        return {**body, "claims": io.to_jsonable(self.claims)}


def execute(
    exp: Experiment, cfg: CommonConfig, model: LoadedModel, figures: bool = True
) -> Outcome:
    """Locate the Site (:func:`prepare`), run ``exp`` with ``cfg`` on ``model`` and the Site, and
    judge its claims; without ``figures`` none are drawn (for callers that read only the claims).

    A :class:`claims.NotApplicable` raised by ``run`` (or while its inputs are built) becomes "not
    applicable" for every claim of ``exp.specs``, with its message as the reason. The inputs and
    ``run`` run under :func:`me_interp.loading.attention.kernel` with ``exp.attention``. On a model
    with offloaded weights, an experiment that reads or edits weights is refused with a
    :class:`PlacementError` naming it.
    """
    try:
        with attention_kernel(model, exp.attention) as attention:
            model, site = prepare(exp, cfg, model)
            result = exp.run(cfg, model, site)
    except claims.NotApplicable as e:
        return Outcome(None, claims.not_applicable(exp.specs, str(e)), {}, str(e))
    except PlacementError as e:
        raise PlacementError(f"{exp.name} is refused on {model.name} as placed: {e}") from None
    from me_interp.plotting import tidy  # plotly is imported only where figures are drawn

    drawn = {k: tidy(f) for k, f in exp.figures(result).items()} if figures else {}
    return Outcome(result, exp.judged(result), drawn, attention=attention)


def write_outcome(name: str, cfg: CommonConfig, model: LoadedModel, outcome: Outcome) -> Path:
    """Write ``<cfg.out>/<name>/<run_id>/`` for ``outcome``; returns the run directory."""
    info = {**model.info(), "attn_implementation": outcome.attention}  # what ran (execute)
    return io.write_run(
        cfg.out, name, cfg, outcome.result_json(), io.environment(info), outcome.figures
    )
