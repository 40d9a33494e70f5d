"""Helpers for the weight-edit tests: state-dict snapshots and an edit catalogue."""

from __future__ import annotations

import pytest
import torch


def snapshot(model) -> dict[str, torch.Tensor]:
    """A deep copy of the HF state dict (the bridge shares these tensors)."""
    return {k: v.detach().clone() for k, v in model.hf.state_dict().items()}


def changed_keys(model, before: dict[str, torch.Tensor]) -> set[str]:
    """Names whose tensors are not bit-identical to ``before``."""
    now = model.hf.state_dict()
    assert set(now) == set(before)
    return {k for k in now if not torch.equal(now[k], before[k])}


def changed_storages(model, before: dict[str, torch.Tensor]) -> set[int]:
    """Distinct tensors (by data pointer) that changed: the HF state dict lists aliases twice."""
    now = model.hf.state_dict()
    return {now[k].data_ptr() for k in changed_keys(model, before)}


@pytest.fixture
def snap():
    return snapshot


@pytest.fixture
def changed():
    return changed_keys


@pytest.fixture
def changed_ptrs():
    return changed_storages
