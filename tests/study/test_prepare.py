"""study.prepare: the framework loads the model and locates the Site once, before ``run(cfg, model,
site)``; a ``run`` called without them prepares them through the same function; the Site carries the
experiment's own batch and scan (no second forward); a Result class is read off ``run``."""

from __future__ import annotations

import dataclasses

import pytest

from me_interp import battery, io, study, synthetic
from me_interp.experiments import (
    me_layer,
    mechanism,
    sink_causality,
    weight_input_cross,
    weight_swap,
)
from me_interp.probes.massive import Criterion
from me_interp.study import experiment


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "planted.txt"
    path.write_text("\n".join(synthetic.planted_prompts(5)) + "\n")
    return str(path)


@pytest.fixture
def located(monkeypatch):
    """The Sites :func:`study.experiment.locate` returned, in order."""
    sites = []

    def counting(*args, **kwargs):
        site = locate(*args, **kwargs)
        sites.append(site)
        return site

    locate = experiment.locate
    monkeypatch.setattr(experiment, "locate", counting)
    return sites


@pytest.mark.parametrize(
    "module", [me_layer, mechanism, weight_input_cross, weight_swap, sink_causality]
)
def test_execute_locates_once_before_run_on_the_experiments_own_inputs(
    module, planted, prompt_file, located, monkeypatch
):
    model, plant = planted
    given = []

    def spy(cfg, model, site):
        given.append(site)
        return module.run(cfg, model, site)

    exp = dataclasses.replace(module.EXPERIMENT, run=spy)
    out = study.execute(exp, module.Config(prompts=prompt_file), model, figures=False)
    assert out.not_applicable is None
    assert len(located) == 1 and given == located  # one locate, before run, handed to it
    site = given[0]
    assert site.layer == plant.layer and site.inputs is not None and site.batch is not None
    made_scan = getattr(site.inputs, "scan", None)
    if made_scan is not None:  # the experiment's own scan: locating cost no forward
        assert site.scan is made_scan


def test_run_without_a_site_prepares_it_by_the_same_path(planted, prompt_file, located):
    model, _ = planted
    cfg = me_layer.Config(prompts=prompt_file)
    alone = me_layer.run(cfg, model)
    assert len(located) == 1
    _, site = study.prepare(me_layer.EXPERIMENT, cfg, model)
    assert len(located) == 2
    given = me_layer.run(cfg, model, site)
    assert len(located) == 2  # a given Site is used, not located again
    assert io.to_jsonable(given) == io.to_jsonable(alone)
    with pytest.raises(ValueError, match="without the model"):
        study.prepare(me_layer.EXPERIMENT, cfg, None, site)


def test_a_logit_metric_on_pairs_locates_no_site(planted, located):
    from me_interp.experiments import activation_patching
    from me_interp.patching.pairs import as_pairs

    model, _ = planted
    pairs = tuple(as_pairs([("The cat sat on the mat.", "The dog sat on the mat.")]))
    cfg = activation_patching.Config(pairs=pairs, metric="logit_diff")
    assert study.prepare(activation_patching.EXPERIMENT, cfg, model) == (model, None)
    assert located == []


def test_site_arguments_read_the_config():
    from me_interp.experiments import attention_sinks

    d = study.site_arguments(attention_sinks.Config(position="zero", layer=1, criterion="norm"))
    assert d == {"criterion": Criterion(kind="norm"), "layer": 1, "position": 0, "seed": 0}
    d = study.site_arguments(sink_causality.Config(position=3, seed=7))
    assert d == {"criterion": None, "layer": None, "position": 3, "seed": 7}
    assert study.site_arguments(weight_swap.Config())["criterion"] == Criterion(kind="sun")


def test_only_the_experiments_without_one_site_declare_no_inputs():
    assert {e.name for e in battery.EXPERIMENTS if e.inputs is None} == {"conditions", "wemask"}


def test_the_result_type_is_read_off_run():
    assert me_layer.EXPERIMENT.result_type is me_layer.Result
    assert weight_swap.EXPERIMENT.result_type is weight_swap.Result

    def two(cfg, model=None, site=None) -> me_layer.Result | weight_swap.Result: ...

    with pytest.raises(TypeError, match="give result_type"):
        dataclasses.replace(me_layer.EXPERIMENT, run=two, result_type=None)
