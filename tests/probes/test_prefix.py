"""Runs from the unedited prefix (probes.batching.capture_prefix): the same measurement as the whole forward under
the same edit, on every architecture; refused when an edit lies before the start block."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
import torch

from me_interp import load_model, synthetic
from me_interp.edits import neurons_ablated, swapped_layers
from me_interp.experiments import weight_swap
from me_interp.probes.batching import capture_prefix, record
from me_interp.probes.measurement import measure
from me_interp.probes.norms import NormRecorder
from me_interp.study import weights

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]


def _setup(model, tmp_path, sink=True):
    f = tmp_path / "p.txt"
    f.write_text("\n".join(synthetic.planted_prompts(6)))
    cfg = weight_swap.Config(prompts=str(f), n_prompts=0, sink=sink)
    return weights.setup(weight_swap.EXPERIMENT, cfg, model, require=False)


def _assert_same(a, b):
    for k, va in asdict(a).items():
        x = np.asarray(va, dtype=np.float64)
        y = np.asarray(getattr(b, k), dtype=np.float64)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=k)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_run_equals_the_whole_forward_under_an_edit(arch, tmp_path):
    """A swap of two layers and a neuron ablation, measured from the first edited block, give the
    measurement of the whole forward under the same edit (norms, ME layer, sink per layer)."""
    model = load_model(f"synthetic:planted-{arch}")
    s = _setup(model, tmp_path)
    last = model.n_layers - 1
    a, b = 1, last
    s.reuse_from([a, last])
    assert "prefix" in s.unedited
    edits = [
        (a, lambda: swapped_layers(model, a, b, "ffn_path")),
        (last, lambda: neurons_ablated(model, last, [0, 1, 2])),
    ]
    for start, ctx in edits:
        with ctx():
            whole = measure(model, s.batch, s.criterion, s.positions, True)
            part = s.measure(start=start)
        _assert_same(part, whole)
        with ctx():  # and the edit did change something, so the equality is not vacuous
            moved = s.measure(start=start)
        assert not np.allclose(moved.top_ratio, s.baseline.top_ratio) or start == last


def test_an_edit_before_the_start_block_is_refused(tmp_path):
    model = load_model("synthetic:planted")
    s = _setup(model, tmp_path)
    s.reuse_from([2])
    with neurons_ablated(model, 1, [0]):  # layer 1 is before the start block 2
        with pytest.raises(RuntimeError, match="edited after the prefix was captured"):
            s.measure(start=2)
    with swapped_layers(model, 0, 3, "ffn_path"):  # a swap that reaches before block 2
        with pytest.raises(RuntimeError, match="edited after the prefix was captured"):
            s.measure(start=2)
    s.measure(start=2)  # restored: accepted again
    with pytest.raises(RuntimeError, match="no prefix captured for block 1"):
        record(model, s.batch, [], prefix=s.unedited["prefix"].prefix, start=1)


def test_uncaptured_start_or_other_model_runs_the_whole_forward(tmp_path):
    model = load_model("synthetic:planted")
    s = _setup(model, tmp_path, sink=False)
    s.reuse_from([2])
    other = load_model("synthetic:planted")
    _assert_same(s.measure(other, start=2), s.baseline)  # another model: whole forward
    _assert_same(s.measure(start=3), s.baseline)  # not captured: whole forward


def test_norm_scan_from_a_prefix_fills_earlier_layers_from_the_unedited_scan():
    model = load_model("synthetic:planted")
    batch = model.tokenize(synthetic.planted_prompts(4))
    full = NormRecorder(model, batch)
    record(model, batch, [full])
    want = full.result()
    prefix = capture_prefix(model, batch, [2])
    rec = NormRecorder(model, batch)
    record(model, batch, [rec], prefix=prefix, start=2)
    got = rec.result(below=want, start=2)
    torch.testing.assert_close(got.norms, want.norms, equal_nan=True, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.top_abs, want.top_abs, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.top_dims[2:], want.top_dims[2:])
    torch.testing.assert_close(got.kept_resid, want.kept_resid, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="whole batch"):
        record(model, batch, [rec], prefix=prefix, start=2, rows=[0])


def test_the_edit_mark_is_the_one_edits_set():
    from me_interp.edits import core
    from me_interp.probes import batching

    assert batching.EDITED_ATTR == core.EDITED_ATTR
    model = load_model("synthetic:planted")
    w = model.ffn_weights(0).down
    with core.edited_parameters({w: torch.zeros_like(w)}):
        assert getattr(w, core.EDITED_ATTR) == 1
    assert getattr(w, core.EDITED_ATTR) == 0
