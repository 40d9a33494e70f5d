"""The same interventions on a plain HF model, as PyTorch forward hooks (training-aware WeMask).

``hf_interventions(model, spec, ...)`` registers, per intervened layer ``L``:

* a forward *pre*-hook (``with_kwargs=True``) on the decoder layer that records the absolute positions
  of the tokens in this call: its ``position_ids`` kwarg (what HF Llama/Qwen pass every layer, also
  at decode steps with a KV cache), else ``cache_position``, else the cache length + ``arange``; an
  edit that finds no positions recorded for its call (a norm run outside its decoder layer) raises
  instead of assuming ``arange(T)``;
* a forward hook on the pre-attention RMSNorm (site ``attn_in``; the module
  :func:`me_interp.interventions.core.attn_norm` names: ``model.attn_norm_module(L)`` for a
  ``LoadedModel``) or on the decoder layer itself (site ``resid_post``) that returns the edited output.

The edit is the spec's own :meth:`edit` — the very code the TransformerLens hooks run — so the two
backends agree (tested to 1e-5 on the bundled model). No ``torch.no_grad`` anywhere: gradients flow
through the edited activations, so the hooks can stay in place during SFT/DPO/GRPO with any HF/TRL
trainer (``docs/wemask.md``). The handle is a context manager that removes every hook in ``finally``;
``.remove()`` does the same for long-lived use. ``handle.stats`` counts, per layer, the calls and the
tokens edited, so a training loop can check that the mask was active in every step.

``positions_from="mask"`` counts positions from each row's *first real token*, read from the 2-D
``attention_mask`` the decoder receives (a forward pre-hook on the decoder module records it):
``pos = cumsum(mask) − 1`` over the cached and the current tokens, pad slots ``−1`` (never edited).
That is what a trainer or an evaluation harness needs: TRL's training forward passes only
``input_ids`` and ``attention_mask``, so under left padding the first real token sits neither at
index 0 nor at position 0, and HF ``generate`` gives pad slots position 0 or 1. A decode step with a
KV cache sees a mask longer than its one query token, so a generated token is never position 0.
Without an attention mask (a plain right-padded forward, or padding-free packing with
``position_ids``) it falls back to the ``absolute`` rule.

**Gradient checkpointing.** transformers checkpoints a decoder layer's ``forward``, so the layer's
own hooks do not run again in the backward recompute but the norm's hook does. Each layer keeps the
positions it recorded keyed by its input tensor (storage and shape), so the recompute edits exactly
the tokens the forward edited (tested: the hooks run twice, the gradients are those of a run without
checkpointing).

``positions_from="index"`` reproduces the released code's behaviour (the target is index 0 *of the
current call*), which masks every newly generated token at decode steps with a KV cache. It exists
to demonstrate that bug, not for use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from me_interp.interventions import core

POSITION_MODES = ("absolute", "index", "mask")
#: Positions kept per layer for gradient-checkpoint recomputes (one per forward still awaiting its
#: backward; a few suffice: a trainer runs forward, reference forward, backward).
_KEEP_FOR_RECOMPUTE = 8


class HFInterventions:
    """Forward hooks applying intervention specs to an HF model (see module docstring).

    Args:
        model: an HF causal LM (Llama/Qwen/Mistral-style) or a :class:`~me_interp.models.LoadedModel`.
        specs: one or more specs (``WeMask``, ``DirectionProjection``, ...).
        positions_from: ``"absolute"`` (from ``position_ids``), ``"mask"`` (from the first real token
            of each row of the attention mask; for trainers and harnesses) or ``"index"`` (the
            released code's bug).
    """

    def __init__(self, model: Any, specs: Sequence[Any], positions_from: str = "absolute") -> None:
        if positions_from not in POSITION_MODES:
            raise ValueError(
                f"positions_from must be one of {POSITION_MODES}, got {positions_from!r}"
            )
        if not specs:
            raise ValueError("give at least one intervention spec")
        self.model = model
        self.specs = tuple(specs)
        self.positions_from = positions_from
        self.layers = core.decoder_layers(model)
        for spec in self.specs:
            core.check_site(spec.site)
            core.check_layers(spec.layers, len(self.layers))
        self._handles: list[Any] = []
        self._positions: dict[int, torch.Tensor] = {}
        self._saved: dict[int, OrderedDict] = {}
        self._mask2d: torch.Tensor | None = None
        self.stats: dict[int, dict[str, int]] = {}

    # -- registration --------------------------------------------------------------------------
    def register(self) -> HFInterventions:
        if self._handles:
            raise RuntimeError("these hooks are already registered")
        try:
            touched = sorted({L for s in self.specs for L in s.layers})
            if self.positions_from == "mask":
                dec = _decoder_module(self.model)
                self._handles.append(
                    dec.register_forward_pre_hook(self._record_mask, with_kwargs=True)
                )
                self._handles.append(dec.register_forward_hook(self._forget_mask))
            for L in touched:
                layer = self.layers[L]
                self.stats[L] = {"calls": 0, "edited_tokens": 0}
                self._handles.append(
                    layer.register_forward_pre_hook(partial(self._record, L=L), with_kwargs=True)
                )
                for spec in self.specs:
                    if L not in spec.layers:
                        continue
                    fn = partial(self._edit, L=L, spec=spec)
                    mod = core.attn_norm(self.model, L) if spec.site == "attn_in" else layer
                    self._handles.append(mod.register_forward_hook(fn))
                self._handles.append(layer.register_forward_hook(partial(self._forget, L=L)))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Remove every hook (safe to call twice)."""
        while self._handles:
            self._handles.pop().remove()
        self._positions.clear()
        self._saved.clear()
        self._mask2d = None

    def __enter__(self) -> HFInterventions:
        return self.register()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    # -- hooks -----------------------------------------------------------------------------
    def _record(self, module: Any, args: tuple, kwargs: dict, *, L: int) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        T = hidden.shape[1]
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = kwargs.get("cache_position")
            if pos is not None:
                pos = pos[None, :]
        if pos is None:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = 0
            if cache is not None and hasattr(cache, "get_seq_length"):
                past = int(cache.get_seq_length(L))
            pos = (torch.arange(T, device=hidden.device) + past)[None, :]
        if pos.shape[-1] != T:
            raise RuntimeError(
                f"layer {L}: position_ids cover {pos.shape[-1]} tokens but the hidden states have {T}"
            )
        if self.positions_from == "mask" and self._mask2d is not None:
            pos = _positions_from_mask(self._mask2d, T, L)
        self._positions[L] = pos
        saved = self._saved.setdefault(L, OrderedDict())
        saved[_tensor_key(hidden)] = pos
        while len(saved) > _KEEP_FOR_RECOMPUTE:
            saved.popitem(last=False)

    def _record_mask(self, module: Any, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            if isinstance(mask, torch.Tensor):
                got = f"a {mask.dim()}-D tensor"
            elif isinstance(mask, dict):  # Gemma 2/3 decoders accept prebuilt masks per layer type
                got = f"a dict of prebuilt masks (keys {sorted(map(str, mask))})"
            else:
                got = f"a {type(mask).__name__}"
            raise ValueError(
                f"positions_from='mask' needs the 2-D [batch, pos] attention mask, got {got}; "
                "pass the padding mask (or position_ids and no mask)"
            )
        self._mask2d = mask

    def _forget_mask(self, module: Any, args: tuple, output: Any) -> None:
        self._mask2d = None

    def _forget(self, module: Any, args: tuple, output: Any, *, L: int) -> None:
        self._positions.pop(L, None)

    def _abs_pos(
        self, L: int, T: int, device: torch.device, x: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.positions_from == "index":
            return torch.arange(T, device=device)[None, :]
        pos = self._positions.get(L)
        if pos is None and x is not None:
            # outside the decoder layer's hooks: a gradient-checkpoint recompute of a forward whose
            # positions were kept under the same input tensor
            pos = self._saved.get(L, {}).get(_tensor_key(x))
        if pos is None or pos.shape[-1] != T:
            # e.g. the norm called outside its decoder layer: assuming arange(T) here would be the
            # released code's KV-cache bug (every decode step's token taken for position 0)
            got = "no positions" if pos is None else f"positions for {pos.shape[-1]} tokens"
            raise RuntimeError(
                f"layer {L}: the decoder layer recorded {got} for this call of {T} tokens, so the "
                "absolute positions to edit are unknown; run the hooked module inside its decoder "
                "layer's forward (which passes position_ids or cache_position)"
            )
        return pos.to(device)

    def _edit(self, module: Any, args: tuple, output: Any, *, L: int, spec: Any) -> Any:
        h = output[0] if isinstance(output, tuple) else output
        resid = args[0] if (spec.needs_resid and args) else None
        abs_pos = self._abs_pos(L, h.shape[1], h.device, args[0] if args else None)
        target = core.target_mask(abs_pos, spec.positions, h.shape[0])
        new = spec.edit(h, L, target, resid)
        st = self.stats[L]
        st["calls"] += 1
        st["edited_tokens"] += int(target.sum())
        return (new, *output[1:]) if isinstance(output, tuple) else new


def _tensor_key(x: torch.Tensor) -> tuple:
    """Identity of an activation across a checkpoint recompute (the recompute sees the saved input
    itself or a detached alias of it: the same storage, offset and shape)."""
    return (x.device, x.data_ptr(), tuple(x.shape))


def _positions_from_mask(mask: torch.Tensor, T: int, L: int) -> torch.Tensor:
    """Positions counted from each row's first real token for the last ``T`` tokens of ``mask``
    (``[batch, past + T]``); pad slots get ``−1``."""
    past = mask.shape[-1] - T
    if past < 0:
        raise RuntimeError(
            f"layer {L}: the attention mask covers {mask.shape[-1]} tokens, fewer than the {T} "
            "tokens of this call"
        )
    real = mask != 0
    pos = real.long().cumsum(-1) - 1  # [batch, past + T]
    return pos.masked_fill(~real, -1)[:, past:]


def _decoder_module(model: Any) -> torch.nn.Module:
    """The module that runs the decoder layers (and receives the 2-D attention mask)."""
    hf = core.hf_of(model)
    dec = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    if dec is None or getattr(dec, "layers", None) is not core.decoder_layers(model):
        raise TypeError(
            f"{type(hf).__name__}: cannot find the decoder module that owns the layers "
            "(positions_from='mask' reads the attention mask there)"
        )
    return dec


def hf_interventions(model: Any, *specs: Any, positions_from: str = "absolute") -> HFInterventions:
    """Hooks for ``specs`` on an HF model; use as ``with hf_interventions(hf, spec): ...`` or
    ``h = hf_interventions(hf, spec).register(); ...; h.remove()``."""
    return HFInterventions(model, specs, positions_from)


def hf_we_mask(
    model: Any,
    rate: float | int,
    variant: str = "weight",
    *,
    layers: Sequence[int],
    positions: core.PositionsArg = (0,),
    seed: int = 0,
) -> HFInterventions:
    """WeMask on a plain HF model (unregistered handle; enter it or call ``.register()``).

    ``layers`` is explicit here (measure the ME layer once with a LoadedModel and
    :func:`me_interp.interventions.wemask.mask_layers`, or read it from a ``me_layer`` result).
    """
    from me_interp.interventions.wemask import WeMask

    return HFInterventions(model, [WeMask.build(model, layers, rate, variant, positions, seed)])


def load_hf(model: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A *plain* HF model and its tokenizer, for the HF hooks, generation and training.

    ``me_interp.load_model`` wraps the HF model in a TransformerBridge, which replaces its submodules
    in place (``model.hf`` then holds bridge components whose attention ignores HF's KV cache). Use a
    plain copy for KV-cache generation and for training. ``model``: ``None``/``"bundled"`` (the cached
    fp32 SmolLM2-135M-Instruct), a packaged model's short name (``"gemma-3-270m"``),
    ``"synthetic:<kind>"``, a local directory or an HF name.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from me_interp import loading
    from me_interp.loading.sources import source_for

    source = source_for(model)  # a registered source (synthetic models)
    if source is not None:
        hf, tok = source.load(model)
        return hf.to(device=device, dtype=dtype).eval(), tok
    path = loading.local_path(model) or str(model)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return hf.to(device).eval(), tok


__all__ = ["HFInterventions", "hf_interventions", "hf_we_mask", "load_hf"]
