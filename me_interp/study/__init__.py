"""The experiment framework: what every experiment shares, written once.

* :mod:`.config` — :class:`CommonConfig` (the shared fields), the shared bases (:class:`SiteConfig`,
  :class:`DetectConfig`, :class:`WeightConfig`, :class:`CriterionConfig`, :class:`BackendConfig`)
  and :func:`checked` (a field's checks as metadata, applied by one :func:`validate`);
* :mod:`.experiment` — the :class:`Experiment` descriptor each experiment module declares, and the one
  way it runs: load the model and locate the Site on the experiment's inputs (:func:`prepare`),
  execute, judge, write (:func:`execute`, :func:`write_outcome`);
* :mod:`.result` — the :class:`RunHeader` every Result opens with, and the round trip of a Result
  through JSON (``io.to_jsonable`` / ``io.from_jsonable``);
* :mod:`.cli` — the command line built from a Config (:func:`main`);
* :mod:`.layer_report` — what the per-layer reports share (:class:`~.layer_report.LayerReport`);
  :mod:`.weights` — what the weight experiments share (their inputs, the parts they move).

Dependencies point one way: the battery and the experiments import this package; it imports
``claims``, ``io``, ``terminal``, ``prompts``, ``loading``, ``probes`` and ``edits``, never an
experiment.
"""

from me_interp.study.cli import (
    BAD_INPUT,
    INTERRUPTED,
    ArgumentParser,
    build_parser,
    command,
    config_from_args,
    field_docs,
    flag_names,
    is_bad_input,
    main,
)
from me_interp.study.config import (
    INDEX_CONVENTION,
    BackendConfig,
    Check,
    CommonConfig,
    CriterionConfig,
    DetectConfig,
    SiteConfig,
    WeightConfig,
    check_placement,
    checked,
    placement_kwargs,
    validate,
)
from me_interp.study.experiment import (
    SMALL_MODEL_PARAMS,
    Experiment,
    Inputs,
    Outcome,
    apply_threads,
    execute,
    locate_inputs,
    model_for,
    prepare,
    prompt_inputs,
    scanned_inputs,
    seed_everything,
    site_arguments,
    write_outcome,
)
from me_interp.study.result import Headed, RunHeader, roundtrip, run_header

__all__ = [
    "BAD_INPUT",
    "INTERRUPTED",
    "INDEX_CONVENTION",
    "SMALL_MODEL_PARAMS",
    "ArgumentParser",
    "Check",
    "BackendConfig",
    "CommonConfig",
    "CriterionConfig",
    "DetectConfig",
    "Experiment",
    "Headed",
    "Inputs",
    "Outcome",
    "RunHeader",
    "SiteConfig",
    "WeightConfig",
    "apply_threads",
    "build_parser",
    "command",
    "check_placement",
    "checked",
    "config_from_args",
    "execute",
    "field_docs",
    "flag_names",
    "is_bad_input",
    "locate_inputs",
    "main",
    "model_for",
    "placement_kwargs",
    "prepare",
    "prompt_inputs",
    "scanned_inputs",
    "roundtrip",
    "run_header",
    "seed_everything",
    "site_arguments",
    "validate",
    "write_outcome",
]
