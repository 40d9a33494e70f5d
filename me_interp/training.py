"""Training-aware WeMask in HF ``Trainer`` and TRL ``SFTTrainer`` / ``DPOTrainer`` / ``GRPOTrainer``.

The paper trains with the mask in place (``paper.md`` §2.5: SFT, DPO, GRPO). :func:`wemask_training`
puts the HF hooks of :mod:`me_interp.interventions.hf_hooks` on every model a trainer runs, for the
whole run, and takes them off afterwards (also after an exception)::

    spec = WeMask.build(trainer.model, layers, rate=0.1, variant="weight")
    with wemask_training(trainer, spec) as wm:
        trainer.train()
    wm.stats        # per model and layer: calls and edited tokens

What it guarantees, and how (each point is tested on tiny models with 2-step SFT, DPO and GRPO runs):

* **The first real token of every row.** The hooks run with ``positions_from="mask"``: positions are
  counted from each row's first real token, read from the 2-D attention mask. TRL's training forward
  passes only ``input_ids`` and ``attention_mask``, so in a left-padded row (GRPO prompts) the first
  real token is neither at index 0 nor at position 0; pad slots are never edited. Padding-free
  batches (``position_ids``, no mask) fall back to position 0 of each packed sequence.
* **The reference model too.** A reference the trainer holds (``trainer.ref_model``: one you passed, or
  the one TRL rebuilt from the checkpoint for full fine-tuning — without hooks of its own) gets the same
  hooks. With PEFT the reference is the policy with its adapter disabled, so the policy's hooks apply.
  DPO's ``precompute_ref_log_probs=True`` computes the reference log-probs inside the trainer's
  constructor, before any hook can be installed: that is refused with a clear error.
* **Generation.** GRPO rollouts through ``model.generate`` (KV cache) mask the prompt's first real
  token at prefill and never a generated token (a decode step's mask is longer than its one query).
  vLLM (``use_vllm=True``) and transformers' continuous batching never run these PyTorch hooks:
  refused with a clear error.
* **Gradients flow** through the edit (no ``no_grad``); with **gradient checkpointing** the recompute
  edits the same tokens (the hooks run twice per layer and step); **PEFT/LoRA** models work (the hooks
  sit on the base model's norms, the adapters on its projections).
* **Nothing is left behind**: every hook is removed on exit (``WeMaskTraining.active`` is then False).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from me_interp.interventions.hf_hooks import HFInterventions

#: Trainer arguments whose rollouts bypass PyTorch forward hooks.
_HOOKLESS_ROLLOUTS = {
    "use_vllm": "vLLM runs its own copy of the weights and never calls PyTorch forward hooks",
    "use_transformers_continuous_batching": (
        "transformers' continuous batching packs requests into paged batches with no per-row "
        "attention mask; the first real token of each rollout is not verified there"
    ),
}


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional (the `train` extra)
        return False
    return isinstance(model, PeftModel)


class WeMaskTraining:
    """The hooks of one training run: on the policy and, when the trainer holds one, the reference.

    Args:
        trainer: an HF ``Trainer`` or a TRL trainer (anything with ``.model`` and ``.args``).
        specs: intervention specs built on the policy (``WeMask.build(trainer.model, ...)``,
            ``dim_projection``, ``DirectionProjection.build``).

    Raises:
        ValueError: no spec; rollouts that bypass hooks (``use_vllm``, continuous batching); DPO
            reference log-probs precomputed before the hooks existed.
    """

    def __init__(self, trainer: Any, specs: Sequence[Any]) -> None:
        if not specs:
            raise ValueError("give at least one intervention spec (e.g. WeMask.build(...))")
        args = getattr(trainer, "args", None)
        for flag, why in _HOOKLESS_ROLLOUTS.items():
            if getattr(args, flag, False):
                raise ValueError(
                    f"{type(trainer).__name__} has {flag}=True: {why}, so WeMask would be silently "
                    f"absent from the rollouts. Set {flag}=False (rollouts through model.generate "
                    "run the hooks) or implement the mask inside the engine"
                )
        if getattr(args, "precompute_ref_log_probs", False):
            raise ValueError(
                "precompute_ref_log_probs=True: the trainer computed the reference log-probs in its "
                "constructor, before the WeMask hooks were installed, so the reference would be "
                "unmasked. Set precompute_ref_log_probs=False"
            )
        self.trainer = trainer
        self.specs = tuple(specs)
        self.handles: dict[str, HFInterventions] = {
            "policy": HFInterventions(trainer.model, self.specs, positions_from="mask")
        }
        ref = getattr(trainer, "ref_model", None)
        if ref is not None and ref is not trainer.model:
            self.handles["ref_model"] = HFInterventions(ref, self.specs, positions_from="mask")

    @property
    def reference(self) -> str:
        """Where the reference forward runs masked: ``"ref_model"`` (its own hooks), ``"policy"``
        (PEFT: the policy with the adapter disabled) or ``"none"`` (the trainer uses no reference)."""
        if "ref_model" in self.handles:
            return "ref_model"
        return "policy" if _is_peft(self.trainer.model) else "none"

    def register(self) -> WeMaskTraining:
        try:
            for h in self.handles.values():
                h.register()
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Remove every hook of the run (safe to call twice)."""
        for h in self.handles.values():
            h.remove()

    @property
    def active(self) -> bool:
        return any(h.active for h in self.handles.values())

    @property
    def stats(self) -> dict[str, dict[int, dict[str, int]]]:
        """Per model (``policy``, ``ref_model``) and layer: hook calls and edited tokens."""
        return {k: {L: dict(v) for L, v in h.stats.items()} for k, h in self.handles.items()}

    def to_dict(self) -> dict:
        return {
            "specs": [s.to_dict() for s in self.specs if hasattr(s, "to_dict")],
            "positions_from": "mask",
            "reference": self.reference,
            "stats": {k: {str(L): v for L, v in d.items()} for k, d in self.stats.items()},
        }

    def __enter__(self) -> WeMaskTraining:
        return self.register()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def wemask_training(trainer: Any, *specs: Any) -> WeMaskTraining:
    """WeMask hooks for a whole training run of ``trainer`` (unregistered: use ``with``, or call
    ``.register()`` and ``.remove()``). See the module docstring."""
    return WeMaskTraining(trainer, specs)


def train_with_wemask(trainer: Any, *specs: Any, **train_kwargs: Any) -> tuple[Any, dict]:
    """``trainer.train(**train_kwargs)`` with the hooks in place; returns the train output and
    :meth:`WeMaskTraining.to_dict` (the specs and the edit counts)."""
    with wemask_training(trainer, *specs) as wm:
        out = trainer.train(**train_kwargs)
    return out, wm.to_dict()


__all__ = ["WeMaskTraining", "train_with_wemask", "wemask_training"]
