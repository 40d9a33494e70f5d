"""Where an experiment's forward passes run: the TransformerLens bridge (``tl``, the default) or
nnsight (``nnsight``): a plain HF model wrapped by nnsight, on this machine or, with ``remote``, on
NDIF's servers for models no single machine holds (Llama-3.1-70B, 405B, ...).

The nnsight backend (:mod:`me_interp.backends.nnsight`) reduces every activation to small per-layer
statistics inside the trace (:mod:`me_interp.backends._reduce`) and hands them to the same
localisation, attention and perplexity code as the TransformerLens path. It serves the ME-layer scan
(``me_layer``, ``survey``), the attention-sink statistics (``attention_sinks``) and the WeMask
perplexity study (``wemask``); the other experiments need hooks or weight edits nnsight does not
reproduce here and run on ``tl`` only. ``docs/remote.md`` has the commands.
"""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("tl", "nnsight")
#: The experiments with a ``--backend`` flag.
NNSIGHT_EXPERIMENTS: tuple[str, ...] = ("me_layer", "survey", "attention_sinks", "wemask")


def check_backend(backend: str, remote: bool) -> None:
    """Validate a config's ``backend`` and ``remote`` fields (``ValueError`` naming them)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if remote and backend != "nnsight":
        raise ValueError("remote runs on NDIF through nnsight: add --backend nnsight")


__all__ = ["BACKENDS", "NNSIGHT_EXPERIMENTS", "check_backend"]
