"""Shared fixtures: offline, single-threaded, seeded; tiny, planted and bundled models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("ME_INTERP_STRICT", "1")  # patching fails loudly instead of falling back

import contextlib
import fcntl
import random
from pathlib import Path

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


def _shared_dir(tmp_path_factory) -> Path:
    """A directory shared by every pytest-xdist worker of this run (the run's own dir without
    xdist), for results computed once per run."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    path = base.parent / f"shared-{run}" if run else base / "shared"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path, block: bool = True):
    """An exclusive lock on ``path`` for the block (yields False when ``block`` is False and another
    process holds it)."""
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def constructed_battery(tmp_path_factory):
    """``get(model)``: the battery state of a constructed model (``me_interp.falsifiability``), run
    once per test run and shared by the meta-tests and the falsifiability tests, across pytest-xdist
    workers too (on disk, under a lock per model). ``get.prefetch(models)`` runs the batteries of
    ``models`` that no other worker is running, so two workers split the constructed models."""
    from me_interp import falsifiability, io

    shared = _shared_dir(tmp_path_factory) / "constructed"
    shared.mkdir(exist_ok=True)

    def paths(model: str) -> tuple[Path, Path, Path]:
        stem = model.replace(":", "_")
        return shared / f"{stem}.json", shared / f"{stem}.lock", shared / stem

    def compute(model: str) -> None:
        done, _, root = paths(model)
        if not done.is_file():
            io.write_json(done, falsifiability.battery_state(model, root))

    def get(model: str) -> dict:
        done, lock, _ = paths(model)
        if not done.is_file():
            with _locked(lock):
                compute(model)
        return io.read_json(done)

    def prefetch(models) -> None:
        for model in models:
            done, lock, _ = paths(model)
            if done.is_file():
                continue
            with _locked(lock, block=False) as mine:
                if mine:
                    compute(model)

    get.prefetch = prefetch
    return get


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test that loads the bundled model (the ``bundled`` fixture), before ``-m``
    selects; then order the files for the workers (longest first): files with slow tests, the
    other files, and last the tests of :data:`SPREAD_FILES`, which go one by one to whichever worker
    is free and so even out the end of the run. The order within a file is kept."""
    for item in items:
        if "bundled" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path.name in SPREAD_FILES, item.path not in heavy))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``--dist loadscope``, as ``pyproject.toml`` sets) keep each test file on one
    worker, so its module fixtures are built once, except the files whose tests are independent and
    expensive one by one (:data:`SPREAD_FILES`), whose tests spread over the workers.

    A scheduler rather than ``xdist_group`` marks: pytest-xdist 3.8 applies a mark by renaming the
    test's ``_nodeid``, which pytest 9.2 no longer reads, so every test was its own unit and a
    module fixture was built once per worker (measured: the bundled mechanism fixture, 62 s, twice).
    """
    if config.getvalue("dist") not in ("loadscope", "loadgroup"):
        return None  # the user's own --dist
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return nodeid if Path(file).name in SPREAD_FILES else file

    return ByFile(config, log)


SPREAD_FILES = {
    "test_falsifiability.py",
    "test_cli_inputs.py",
    "test_architectures.py",
    "test_patching_pairs.py",
    "test_patching.py",
}
