"""The shared config bases of ``study/config.py``: ``BackendConfig`` and ``CriterionConfig``."""

from __future__ import annotations

import pytest

from me_interp.study import BackendConfig, CriterionConfig, DetectConfig, WeightConfig


def test_backend_config_accepts_nnsight_remote_and_refuses_remote_alone():
    assert BackendConfig(backend="nnsight", remote=True).remote
    with pytest.raises(ValueError, match="--backend nnsight"):
        BackendConfig(remote=True)


@pytest.mark.parametrize("cls", [CriterionConfig, DetectConfig, WeightConfig])
def test_criterion_configs_detect_by_their_criterion(cls):
    assert cls(criterion="norm").detection().kind == "norm"
    with pytest.raises(ValueError, match="criterion"):
        cls(criterion="bogus")
