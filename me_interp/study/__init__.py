"""The experiment framework: what every experiment shares, written once.

* :mod:`.config` — :class:`CommonConfig` (the shared fields) and :func:`checked` (a field's checks as
  metadata, applied by one :func:`validate`);
* :mod:`.experiment` — the :class:`Experiment` descriptor each experiment module declares, and the one
  way it runs: load the model, execute, judge, write (:func:`execute`, :func:`write_outcome`);
* :mod:`.result` — the :class:`RunHeader` every Result opens with, and the round trip of a Result
  through JSON (``io.to_jsonable`` / ``io.from_jsonable``);
* :mod:`.cli` — the command line built from a Config (:func:`main`).

Dependencies point one way: the battery and the experiments import this package; it imports
``claims``, ``io``, ``terminal``, ``prompts`` and ``loading``, never an experiment.
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
    Check,
    CommonConfig,
    SiteConfig,
    check_placement,
    checked,
    placement_kwargs,
    validate,
)
from me_interp.study.experiment import (
    SMALL_MODEL_PARAMS,
    Experiment,
    Outcome,
    apply_threads,
    execute,
    model_for,
    seed_everything,
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
    "CommonConfig",
    "Experiment",
    "Headed",
    "Outcome",
    "RunHeader",
    "SiteConfig",
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
    "main",
    "model_for",
    "placement_kwargs",
    "roundtrip",
    "run_header",
    "seed_everything",
    "validate",
    "write_outcome",
]
