"""Shared fixtures: offline, single-threaded, seeded; tiny, planted and bundled models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("ME_INTERP_STRICT", "1")  # patching fails loudly instead of falling back

import random

import numpy as np
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def planted():
    """(LoadedModel, Plant) of the planted-mechanism tiny Llama (ME layer 2 of 5)."""
    from me_interp import load_model, synthetic

    hf, tok, plant = synthetic.planted_llama()
    return load_model(hf, tokenizer=tok, device="cpu"), plant


@pytest.fixture(scope="session")
def twin():
    """The unplanted twin of ``planted``: same weights but no planted mechanism."""
    from me_interp import load_model, synthetic

    hf, tok, plant = synthetic.planted_llama(plant=False)
    return load_model(hf, tokenizer=tok, device="cpu"), plant


@pytest.fixture(scope="session")
def tiny_llama():
    from me_interp import load_model, synthetic

    hf, tok = synthetic.tiny_llama()
    return load_model(hf, tokenizer=tok, device="cpu")


@pytest.fixture(scope="session")
def tiny_qwen3():
    from me_interp import load_model, synthetic

    hf, tok = synthetic.tiny_qwen3()
    return load_model(hf, tokenizer=tok, device="cpu")


@pytest.fixture(scope="session")
def bundled():
    """The bundled real model (SmolLM2-135M-Instruct), fp32 on CPU, tokenizer's BOS behaviour."""
    from me_interp import load_model

    return load_model(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def planted_prompts():
    from me_interp import synthetic

    return synthetic.planted_prompts()


@pytest.fixture(scope="session")
def constructed_battery(tmp_path_factory):
    """``get(model)``: the battery state of a constructed model (``me_interp.falsifiability``), run
    once per session and shared by the meta-tests and the falsifiability test."""
    from me_interp import falsifiability

    cache: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in cache:
            root = tmp_path_factory.mktemp(model.replace(":", "_"))
            cache[model] = falsifiability.battery_state(model, root)
        return cache[model]

    return get
