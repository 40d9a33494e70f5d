"""The WeMask sweep runs each condition from its first masked block (the earlier blocks are the
unmasked model's): the same rows as full forwards, on several length groups."""

from __future__ import annotations

import numpy as np
import pytest

from me_interp import evaluation, load_model, synthetic
from me_interp.experiments import wemask


def _numbers(rows):
    keys = ("perplexity", "kl", "top1", "sink", "entropy", "eff_rank")
    return np.array([[getattr(r.metrics, k) for k in keys] for r in rows], dtype=np.float64)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_sweep_from_the_first_masked_block_equals_full_forwards(arch, tmp_path, monkeypatch):
    model = load_model(f"synthetic:planted-{arch}")
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(synthetic.planted_prompts(6)))
    texts = tmp_path / "t.txt"
    texts.write_text("\n".join(synthetic.words(6 + i % 5, start=4 * i) for i in range(8)))
    cfg = wemask.Config(
        prompts=str(prompts),
        texts=str(texts),
        rates=(0.0, 0.5, 1.0),
        alphas=(1.0,),
        mc="none",
        batch_tokens=30,
    )
    used = []
    real = evaluation.capture_prefix

    def spy(*args, **kwargs):
        used.append(real(*args, **kwargs))
        return used[-1]

    monkeypatch.setattr(evaluation, "capture_prefix", spy)
    part = wemask.run(cfg, model)
    # the prefix was used (the ME layer is not layer 0), for each length group, and checked
    assert len(used) > 1 and all(p.why is None and p.starts[0] > 0 for p in used)
    monkeypatch.setattr(evaluation, "capture_prefix", lambda *args, **kwargs: None)
    full = wemask.run(cfg, model)
    assert [r.condition for r in part.rows] == [r.condition for r in full.rows]
    np.testing.assert_allclose(_numbers(part.rows), _numbers(full.rows), rtol=1e-5, atol=1e-7)
