"""HF sources: a local directory written by ``save_pretrained``, an HF hub name, an HF model object,
and booting any of them into a TransformerLens ``TransformerBridge``.

Every model is loaded with eager attention (so attention patterns exist); the bridge is booted with
the RMSNorm gains left unfolded. A :class:`~me_interp.loading.placement.Placement` (device map, memory
budget, offload folder) goes to ``from_pretrained``, or to accelerate's ``dispatch_model`` for a model
built in memory; TransformerLens boots a dispatched model where accelerate put it. The cached conversions of :mod:`me_interp.loading.bundled` and
:mod:`me_interp.loading.packaged` are HF directories too and load through :func:`load_cached`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from me_interp.loading.errors import ModelLoadError, PlacementError, UnsupportedArchitectureError
from me_interp.loading.placement import Placement, dispatch, execution_device

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which a saved tokenizer has at least one (``save_pretrained`` writes the first two)."""


def check_model_dir(path: str, need_tokenizer: bool) -> None:
    """Raise a clear ``ModelLoadError`` when ``path`` exists locally but is not a saved model."""
    p = Path(path).expanduser()
    if not p.exists():
        return  # not local: an HF hub name
    if not p.is_dir():
        raise ModelLoadError(
            f"{path!r} is a file, not a model: pass a directory written by save_pretrained, "
            "the bundled model (no argument) or an HF name"
        )
    lacks = []
    if not (p / "config.json").is_file():
        lacks.append("no config.json")
    if need_tokenizer and not any((p / f).is_file() for f in TOKENIZER_FILES):
        lacks.append(f"no tokenizer ({' / '.join(TOKENIZER_FILES)})")
    if lacks:
        raise ModelLoadError(
            f"the directory {path!r} is not a saved model: it has {' and '.join(lacks)}. Pass a "
            "directory written by save_pretrained (model and tokenizer), the bundled model "
            "(no argument) or an HF name"
        )


def load_dir(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    load_tokenizer: bool = True,
    placement: Placement | None = None,
    hint: str = "",
):
    """The HF model (eager attention, ``dtype``, on ``device``, or dispatched by accelerate as
    ``placement`` says) and tokenizer (``None`` when not ``load_tokenizer``) saved at ``path``, a
    local directory or an HF hub name. ``hint``: what to say when it does not load (e.g. the known
    name it resembles); the error is one line (the cause's first line)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_dir(path, need_tokenizer=load_tokenizer)
    where = {} if placement is None else placement.hf_kwargs()
    try:
        tok = AutoTokenizer.from_pretrained(path) if load_tokenizer else None
        hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="eager", **where
        )
    except (OSError, ValueError) as e:
        if placement is not None and "offload" in str(e):
            raise PlacementError(
                f"could not place {path!r} as asked ({placement.to_dict()}): {e}. Give "
                "--offload-folder DIR for what does not fit, or more --max-memory"
            ) from e
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
        where = "as a local directory" if Path(path).exists() else "locally or on the HF hub"
        cause = (str(e).strip().splitlines() or [""])[0]  # HF adds "Check your internet ..."
        raise ModelLoadError(
            f"could not load model {path!r} {where}"
            + (" (HF_HUB_OFFLINE is set, so the hub was not asked)" if offline else "")
            + (
                f"; {hint}"
                if hint
                else ". Pass the bundled model (no argument), a directory written by "
                "save_pretrained, or an HF name where the hub is reachable"
            )
            + f". Cause: {type(e).__name__}: {cause}"
        ) from e
    return (hf if placement is not None else hf.to(device)), tok


def load_cached(
    ensure: Callable[..., Path],
    dtype: torch.dtype,
    device: torch.device,
    placement: Placement | None = None,
):
    """``(hf, tokenizer, path)`` of the converted model in the cache directory ``ensure()`` returns;
    a cache that verifies but will not load is rebuilt once (``ensure(rebuild=True)``, under the
    cache lock)."""
    path = ensure()
    try:
        hf, tok = load_dir(str(path), dtype, device, placement=placement)
    except PlacementError:
        raise
    except ModelLoadError:
        path = ensure(rebuild=True)
        hf, tok = load_dir(str(path), dtype, device, placement=placement)
    return hf, tok, path


def from_object(
    model: Any,
    tokenizer: Any,
    dtype: torch.dtype,
    device: torch.device,
    placement: Placement | None = None,
):
    """``(hf, tokenizer, dtype, device)`` of an already-built HF model: moved and cast, or dispatched
    as ``placement`` says, unless it is dispatched by accelerate already (``hf_device_map``), whose
    placement is left alone and reported; its attention is switched to eager."""
    if tokenizer is None:
        raise ModelLoadError(
            "an HF model object was given without its tokenizer: pass tokenizer=..."
        )
    if getattr(model, "hf_device_map", None):  # dispatched by accelerate: leave placement alone
        if placement is not None:
            raise ValueError(
                "device_map: the HF model is dispatched already (hf_device_map); its placement is "
                "kept, so give no --device-map/--max-memory/--offload-folder with it"
            )
        hf = model
        device = execution_device(model)
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    elif placement is not None:
        hf = dispatch(model, placement, dtype)
        device = execution_device(hf)
    else:
        hf = model.to(device=device, dtype=dtype)
    if getattr(hf.config, "_attn_implementation", "eager") != "eager":
        hf.config._attn_implementation = "eager"
    return hf, tokenizer, dtype, device


def boot(name: str, hf: Any, tok: Any, device: torch.device, dtype: torch.dtype):
    """The ``TransformerBridge`` over ``hf`` (weights not folded), in eval mode.

    Raises:
        UnsupportedArchitectureError: TransformerLens has no adapter for the model.
    """
    from transformer_lens.model_bridge import TransformerBridge

    archs = list(getattr(hf.config, "architectures", None) or [type(hf).__name__])
    if not getattr(hf.config, "architectures", None):
        # a model built from a config has none; TransformerLens picks its adapter from them (the
        # model_type fallback misses e.g. Gemma-3's "gemma3_text")
        hf.config.architectures = archs
    # The bridge re-loads the tokenizer "with BOS" by name unless told it already adds one; it is
    # only used if strings are passed to the bridge itself, and me_interp tokenises with its own
    # copy (LoadedModel.tokenize), so hand the bridge a shallow copy that needs no re-load.
    boot_tok = copy.copy(tok)
    boot_tok.init_kwargs = {**tok.init_kwargs, "add_bos_token": True}
    boot_tok.init_kwargs.setdefault("name_or_path", name)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            bridge = TransformerBridge.boot_transformers(
                name, hf_model=hf, tokenizer=boot_tok, device=device, dtype=dtype
            )
    except (ValueError, NotImplementedError, KeyError) as e:
        raise UnsupportedArchitectureError(
            f"TransformerLens cannot wrap {name!r} (architecture {archs}): {e}"
        ) from e
    bridge.eval()
    return bridge


__all__ = ["TOKENIZER_FILES", "boot", "check_model_dir", "from_object", "load_cached", "load_dir"]
