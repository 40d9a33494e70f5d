"""A loaded model: the TransformerBridge plus the choices it was loaded with, and the accessors the
rest of me_interp uses (number of layers, d_model, norm gains, FFN weights, tokenisation) so that
probes, interventions and edits never poke at architecture-specific module names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int

from me_interp.architecture import Architecture, ArchitectureError, describe
from me_interp.loading.align import align
from me_interp.loading.errors import PlacementError, UnsupportedArchitectureError
from me_interp.loading.placement import Placement, offloaded_modules
from me_interp.prompts import MIN_PROMPT_TOKENS, Prompt

BosChoice = Literal["auto", "yes", "no"]
BOS_CHOICES: tuple[str, ...] = ("auto", "yes", "no")


@dataclass(frozen=True)
class Batch:
    """Tokenised prompts, right-padded so that position t is the t-th token of every row, or
    left-padded (``batch_from_ids(..., side="left")``, as batched inference pads): then a row's
    tokens start at :attr:`starts`, and positions are counted from each row's first real token
    (:meth:`right_aligned` is the same rows right-padded; the probes record through it).

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

    @property
    def starts(self) -> list[int]:
        """Per row, the index of its first real token (0 for every row of a right-padded batch)."""
        return [int(i) for i in (self.attention_mask != 0).long().argmax(-1)]

    @property
    def left_padded(self) -> bool:
        """Whether some row's first real token is not at index 0."""
        return any(self.starts)

    def right_aligned(self) -> Batch:
        """The same rows with every row's real tokens moved to index 0 (``self`` when already so):
        index ``j`` of row ``b`` is its ``j``-th real token."""
        if not self.left_padded:
            return self
        return Batch(
            align(self.tokens, self.starts), align(self.attention_mask, self.starts), self.prompts
        )

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
        self.placement: Placement | None = None  # set by load_model for a dispatched model
        self.attention: str = "eager"  # the attention that runs now (:meth:`attention_kernel`)
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
        return int(self.bridge.blocks[0].mlp.gate.original_component.weight.shape[0])

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
        return _resident(self.bridge.blocks[self.check_layer(layer)].ln1.w, "ln1", layer)

    def ffn_norm_weight(self, layer: int) -> torch.nn.Parameter:
        """The stored weight of the pre-FFN RMSNorm (``blocks.L.ln2.w``), the live parameter."""
        return _resident(self.bridge.blocks[self.check_layer(layer)].ln2.w, "ln2", layer)

    def ffn_weights(self, layer: int) -> FFNWeights:
        """The live gate / up / down weights of ``layer``. With a fused ``gate_up_proj`` (Phi-3,
        ``arch.fused_gate_up``) ``gate`` and ``up`` are the bridge's split parameters, views that
        share the fused HF parameter's storage (rows ``[:d_mlp]`` and ``[d_mlp:]``), so writing them in
        place writes the fused weight too."""
        mlp = self.bridge.blocks[self.check_layer(layer)].mlp
        return FFNWeights(
            gate=_resident(mlp.gate.original_component.weight, "FFN gate", layer),
            up=_resident(getattr(mlp, "in").original_component.weight, "FFN up", layer),
            down=_resident(mlp.out.original_component.weight, "FFN down", layer),
        )

    @property
    def offloaded(self) -> list[str]:
        """The HF modules whose weights are offloaded (``meta`` placeholders; the values in
        accelerate's offload map on the CPU or disk); ``[]`` when every weight is on a device."""
        return offloaded_modules(self.hf) if getattr(self.hf, "hf_device_map", None) else []

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

    @property
    def context_length(self) -> int | None:
        """The most tokens a prompt may have: the model's ``max_position_embeddings`` (``None``
        when its config does not say)."""
        n = getattr(self.hf.config, "max_position_embeddings", None)
        return int(n) if isinstance(n, int) and n > 0 else None

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
            ValueError: for an empty prompt list, an empty prompt, a prompt longer than the model's
                context (:attr:`context_length`), ``bos="yes"`` on a tokenizer without a BOS token,
                or experiment prompts that are all too short.
        """
        import warnings

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
        limit = self.context_length
        long = [i for i, r in enumerate(rows) if limit is not None and len(r) > limit]
        if long:
            i = long[0]
            raise ValueError(
                f"prompt {i} has {len(rows[i])} tokens, more than the {limit} positions of "
                f"{self.name} (max_position_embeddings): shorten it"
            )
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
        self,
        rows: Sequence[Sequence[int]],
        prompts: tuple[str, ...] | None = None,
        side: str = "right",
    ) -> Batch:
        """Pad token-id rows into a :class:`Batch` on the model's device (``side``: ``"right"``, or
        ``"left"`` as batched inference pads)."""
        if side not in ("right", "left"):
            raise ValueError(f"side must be 'right' or 'left', got {side!r}")
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
            at = slice(width - len(r), width) if side == "left" else slice(0, len(r))
            tokens[i, at] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, at] = 1
        return Batch(tokens.to(self.device), mask.to(self.device), prompts)

    def token_texts(self, batch: Batch, row: int = 0) -> list[str]:
        """The real tokens of prompt ``row`` of a right-padded ``batch``, each decoded alone."""
        return [self.tokenizer.decode([int(t)]) for t in batch.tokens[row, : batch.lengths[row]]]

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
            "placement": None if self.placement is None else self.placement.to_dict(),
            "hf_device_map": _device_map_info(self.hf),
            "attn_implementation": self.attention,
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


def _resident(param: torch.nn.Parameter, what: str, layer: int) -> torch.nn.Parameter:
    """``param``, or :class:`PlacementError` when it is an offloaded ``meta`` placeholder (reading or
    editing it in place would miss the weight the forward uses)."""
    if param.device.type == "meta":
        raise PlacementError(
            f"the {what} weight of layer {layer} is offloaded (a meta placeholder; accelerate loads "
            "it only inside the forward), so reading it or editing it in place would miss what the "
            "forward uses: load the model without --max-memory/--offload-folder, or with a "
            "--device-map whose every entry is a device"
        )
    return param


def _device_map_info(hf: Any) -> dict[str, str] | None:
    """``hf_device_map`` with its devices as strings, runs of equal devices kept (for env.json)."""
    dm = getattr(hf, "hf_device_map", None)
    return None if not dm else {k: str(v) for k, v in dm.items()}


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


__all__ = [
    "BOS_CHOICES",
    "Batch",
    "BosChoice",
    "FFNWeights",
    "LoadedModel",
]
