"""Fixtures of the probe tests: a tiny Llama without BOS (so first tokens differ) and a full-capture helper
that records activations independently of the probes (for reference re-derivations)."""

from __future__ import annotations

from functools import partial

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_nobos():
    """A seeded tiny Llama whose prompts start with their first word (BOS removed)."""
    from me_interp import load_model, synthetic

    hf, tok = synthetic.tiny_llama(n_layers=3, seed=3)
    return load_model(hf, tokenizer=tok, bos="no", device="cpu")


@pytest.fixture(scope="session")
def word_prompts():
    """Prompts of different lengths and different first words."""
    return ["w1 w2 w3 w4 w5", "w9 w8 w7 w6 w5 w4 w3", "w20 w21 w22", "w30 w31 w32 w33 w34 w35"]


def _grab(x, hook, *, store, key):
    store[key] = x.detach().clone().float()
    return x


@pytest.fixture(scope="session")
def capture():
    """``capture(model, batch, {key: hook_name})`` -> ``{key: full activation}`` (one forward)."""

    def run(model, batch, wanted):
        store: dict[str, torch.Tensor] = {}
        hooks = [(name, partial(_grab, store=store, key=key)) for key, name in wanted.items()]
        model.run_with_hooks(batch, hooks)
        return store

    return run
