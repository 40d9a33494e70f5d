"""Threads on a busy machine: the free cores are read from /proc/stat, and a large model gets as many
threads as cores are free, a small one always one."""

from __future__ import annotations

import pytest
import torch

from me_interp import usage
from me_interp.study import experiment
from me_interp.study.config import CommonConfig


def _stat(idle: int, busy: int) -> str:
    # cpu user nice system idle iowait irq softirq steal
    return f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n"


@pytest.mark.parametrize(
    ("d_idle", "d_busy", "free"), [(200, 0, 2.0), (100, 100, 1.0), (0, 200, 0.0)]
)
def test_free_cores_is_the_idle_share_of_the_jiffies_times_the_cores(
    tmp_path, monkeypatch, d_idle, d_busy, free
):
    stat = tmp_path / "stat"
    stat.write_text(_stat(1000, 5000))
    monkeypatch.setattr(usage, "_PROC_STAT", stat)
    monkeypatch.setattr(
        usage.time, "sleep", lambda s: stat.write_text(_stat(1000 + d_idle, 5000 + d_busy))
    )
    assert usage.free_cores(cores=2) == pytest.approx(free)


def test_free_cores_without_proc_stat_uses_the_load_average(tmp_path, monkeypatch):
    monkeypatch.setattr(usage, "_PROC_STAT", tmp_path / "missing")
    monkeypatch.setattr(usage.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert usage.free_cores(cores=4) == pytest.approx(2.5)


def test_free_cores_on_this_machine_is_between_zero_and_the_cores():
    assert 0.0 <= usage.free_cores(sample_s=0.05) <= (usage.os.cpu_count() or 1) + 1e-9


@pytest.mark.parametrize(
    ("free", "large", "threads"),
    [(2.0, True, 2), (1.1, True, 1), (0.2, True, 1), (2.0, False, 1)],
)
def test_apply_threads_takes_the_free_cores_for_a_large_model(
    planted, monkeypatch, free, large, threads
):
    """``large``: the planted model counts as above the small-model cut-off."""
    model = planted[0]
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(experiment.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(usage, "free_cores", lambda **kw: free)
    n = sum(p.numel() for p in model.hf.parameters())
    monkeypatch.setattr(experiment, "SMALL_MODEL_PARAMS", n if large else n + 1)
    try:
        experiment.apply_threads(CommonConfig(), model)
        assert torch.get_num_threads() == threads
        experiment.apply_threads(CommonConfig(threads=2), model)  # a given count wins
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_battery_cost_model_scales_one_measured_forward(planted, monkeypatch):
    from me_interp import battery

    model = planted[0]
    assert battery.forward_seconds(model, CommonConfig()) > 0
    monkeypatch.setattr(battery, "forward_seconds", lambda m, c: 0.5)
    monkeypatch.setattr(battery, "FORWARDS", {"a": 10.0, "b": 30.0, "c": 20.0})
    assert battery.predicted_seconds(model, CommonConfig(), ["a", "x"]) == {"a": 5.0, "x": 10.0}
    assert battery.predicted_seconds(model, CommonConfig(), []) == {}
    monkeypatch.setattr(battery, "FORWARDS", {})
    assert battery.predicted_seconds(model, CommonConfig(), ["a"]) == {}
