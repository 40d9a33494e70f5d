"""What a patched run is scored by: row-wise metrics read from recorded activations or from logits.

A metric names the activations it reads (``hook_names()``) and maps them to one value per row
(``__call__(acts, mask)``). The sweep records exactly those activations; the special name
:data:`LOGITS` stands for the model's logits at each row's *last real token* (``[batch, vocab]``):
the sweep computes them only when a metric asks, and only at that position.

Massive-activation metrics (read from the residual stream and the attention patterns):

* :class:`NormRatio` — ``‖h_p‖ / mean_{t≠p} ‖h_t‖`` at ``blocks.L.hook_resid_post``;
* :class:`Projection` — the *signed* ``⟨h_p, u⟩`` onto a fixed unit direction ``u``;
* :class:`SinkMass` — the mean attention on ``p`` from the queries after it.

Logit metrics (user pairs, IOI style):

* :class:`LogitDiff` — ``logit(answer) − logit(wrong)``;
* :class:`AnswerProb` — ``softmax(logits)[answer]``;
* :class:`KLToClean` — ``KL(clean ‖ patched)`` of the next-token distributions;
* :class:`Custom` — any ``fn(logits, acts) -> [batch]``.

Logit metrics are computed in float64 (the massive-activation ones in float32).

Rows come in tiles: a sweep's batch is ``n`` copies of the ``B`` prompts (row ``c·B + b`` is prompt
``b``), so per-prompt constants (answer ids, clean distributions) are tiled by :func:`tile_rows`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float

from me_interp import names
from me_interp.probes.norms import ratio_to_others

LOGITS = "logits"
"""The metric input name of the logits at each row's last real token, ``[batch, vocab]``."""


@runtime_checkable
class PatchMetric(Protocol):
    """A row-wise metric read from recorded activations.

    ``hook_names()`` are the activations it needs (:data:`LOGITS` for the last-token logits);
    ``__call__(acts, mask)`` returns one value per row.
    """

    def hook_names(self) -> tuple[str, ...]: ...

    def __call__(
        self, acts: Mapping[str, torch.Tensor], mask: Bool[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, " batch"]: ...


def tile_rows(v: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-prompt values ``v`` (``[B, ...]``) for a batch of ``rows`` = ``n·B`` rows (row ``c·B + b``
    is prompt ``b``)."""
    B = int(v.shape[0])
    if rows % B:
        raise ValueError(f"a batch of {rows} rows is not whole copies of the {B} prompts")
    return v.repeat(rows // B, *([1] * (v.dim() - 1)))


@dataclass(frozen=True)
class NormRatio:
    """``‖h_p‖ / mean_{t≠p} ‖h_t‖`` at the output of ``layer`` (real tokens only)."""

    layer: int
    position: int = 0

    def hook_names(self) -> tuple[str, ...]:
        return (names.resid_post(self.layer),)

    def __call__(
        self, acts: Mapping[str, torch.Tensor], mask: Bool[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, " batch"]:
        norms = acts[names.resid_post(self.layer)].float().norm(dim=-1).cpu()  # [batch pos]
        ref = torch.full((norms.shape[0],), self.position, dtype=torch.long)
        return ratio_to_others(norms, mask.cpu(), ref)


@dataclass(frozen=True, eq=False)
class Projection:
    """``⟨h_p, u⟩`` at the output of ``layer``: the signed component of token ``p``'s state along the
    fixed direction ``direction`` (normalised to a unit vector here)."""

    layer: int
    direction: torch.Tensor
    position: int = 0

    def __post_init__(self) -> None:
        u = torch.as_tensor(self.direction, dtype=torch.float32).flatten().cpu()
        n = float(u.norm())
        if not math.isfinite(n) or n == 0:
            raise ValueError("Projection needs a finite, non-zero direction")
        object.__setattr__(self, "direction", u / n)

    def hook_names(self) -> tuple[str, ...]:
        return (names.resid_post(self.layer),)

    def __call__(
        self, acts: Mapping[str, torch.Tensor], mask: Bool[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, " batch"]:
        h = acts[names.resid_post(self.layer)][:, self.position].float().cpu()  # [batch d]
        return h @ self.direction


@dataclass(frozen=True)
class SinkMass:
    """Mean over ``layers``, heads and real queries ``q > p`` of the attention ``A[q, p]``."""

    layers: tuple[int, ...]
    position: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("SinkMass needs at least one layer")

    def hook_names(self) -> tuple[str, ...]:
        return tuple(names.pattern(layer) for layer in self.layers)

    def __call__(
        self, acts: Mapping[str, torch.Tensor], mask: Bool[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, " batch"]:
        p = self.position
        q = mask.cpu().clone()
        q[:, : p + 1] = False  # queries after p
        if not q.any(-1).all():
            raise ValueError(f"SinkMass needs every prompt to have a token after position {p}")
        qm = q.float()  # [batch q]
        per_layer = []
        for layer in self.layers:
            a = acts[names.pattern(layer)].float().cpu()[..., p]  # [batch head q]
            per_layer.append(((a * qm[:, None]).sum(-1) / qm.sum(-1)[:, None]).mean(-1))
        return torch.stack(per_layer).mean(0)


TokenIds = int | str | Sequence[int | str] | torch.Tensor
"""Answer tokens, one per prompt: a token id or a single-token string (or a list of them, or a
``[prompts]`` tensor of ids); one id or string stands for every prompt."""


def _ids(v: TokenIds, what: str, tokenizer: Any = None) -> torch.Tensor:
    items = [v] if isinstance(v, (int, str)) else v
    if not isinstance(items, torch.Tensor) and any(isinstance(x, str) for x in items):
        if tokenizer is None:
            raise ValueError(f"{what} is given as text: pass tokenizer= (model.tokenizer)")
        items = [x if isinstance(x, int) else _one_id(tokenizer, x, what) for x in items]
    t = torch.as_tensor(items, dtype=torch.long).flatten().cpu()
    if t.numel() == 0:
        raise ValueError(f"{what} needs at least one token id")
    return t


@dataclass(frozen=True, eq=False)
class LogitDiff:
    """``logit(answer_b) − logit(wrong_b)`` at the last real token of prompt ``b``.

    Args:
        answer, wrong: the two tokens of each prompt (:data:`TokenIds`): token ids or single-token
            strings (with ``tokenizer``), a ``[prompts]`` long tensor or a list with one per prompt;
            a single id or string is used for every prompt. Stored as ``[prompts]`` id tensors.
        tokenizer: the model's tokenizer (``model.tokenizer``), needed only for strings; each
            string must be one token without special tokens (often with its leading space).
    """

    answer: TokenIds
    wrong: TokenIds
    tokenizer: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        a = _ids(self.answer, "LogitDiff answer", self.tokenizer)
        w = _ids(self.wrong, "LogitDiff wrong", self.tokenizer)
        if a.numel() == 1 and w.numel() > 1:
            a = a.expand(w.numel()).clone()
        if w.numel() == 1 and a.numel() > 1:
            w = w.expand(a.numel()).clone()
        if a.shape != w.shape:
            raise ValueError(
                f"LogitDiff needs one wrong id per answer, got {a.numel()} and {w.numel()}"
            )
        object.__setattr__(self, "answer", a)
        object.__setattr__(self, "wrong", w)

    def hook_names(self) -> tuple[str, ...]:
        return (LOGITS,)

    def __call__(self, acts, mask) -> Float[torch.Tensor, " batch"]:
        logits = acts[LOGITS]  # [rows vocab]
        rows = torch.arange(logits.shape[0], device=logits.device)
        a = tile_rows(self.answer, len(rows)).to(logits.device)
        w = tile_rows(self.wrong, len(rows)).to(logits.device)
        return (logits[rows, a].double() - logits[rows, w].double()).cpu()


@dataclass(frozen=True, eq=False)
class AnswerProb:
    """``softmax(logits)[answer_b]`` at the last real token of prompt ``b``."""

    answer: torch.Tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "answer", _ids(self.answer, "AnswerProb answer"))

    def hook_names(self) -> tuple[str, ...]:
        return (LOGITS,)

    def __call__(self, acts, mask) -> Float[torch.Tensor, " batch"]:
        logp = acts[LOGITS].double().cpu().log_softmax(-1)  # [rows vocab]
        rows = torch.arange(logp.shape[0])
        return logp[rows, tile_rows(self.answer, len(rows))].exp()


@dataclass(frozen=True, eq=False)
class KLToClean:
    """``KL(clean ‖ patched) = Σ_v p_clean(v) (log p_clean(v) − log p_patched(v))`` at the last real
    token: 0 on the clean run. ``clean_logits`` are the clean run's last-token logits ``[B, vocab]``."""

    clean_logits: torch.Tensor

    def __post_init__(self) -> None:
        c = torch.as_tensor(self.clean_logits).detach().double().cpu()
        if c.dim() != 2:
            raise ValueError(
                f"KLToClean needs [prompts, vocab] clean logits, got shape {tuple(c.shape)}"
            )
        object.__setattr__(self, "clean_logits", c.log_softmax(-1))

    def hook_names(self) -> tuple[str, ...]:
        return (LOGITS,)

    def __call__(self, acts, mask) -> Float[torch.Tensor, " batch"]:
        logq = acts[LOGITS].double().cpu().log_softmax(-1)
        logp = tile_rows(self.clean_logits, logq.shape[0])
        return (logp.exp() * (logp - logq)).sum(-1)


@dataclass(frozen=True, eq=False)
class Custom:
    """Any metric from the API: ``fn(logits, acts) -> [batch]``, where ``logits`` are the last-token
    logits ``[rows, vocab]`` (``None`` unless ``logits=True``) and ``acts`` holds the activations
    named in ``reads`` (full tensors, rows tiled as above: use :func:`tile_rows` for per-prompt
    constants)."""

    fn: Callable[[torch.Tensor | None, Mapping[str, torch.Tensor]], torch.Tensor]
    reads: tuple[str, ...] = ()
    logits: bool = True

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError("Custom needs a callable fn(logits, acts)")
        if not self.reads and not self.logits:
            raise ValueError("Custom reads nothing: give reads=(hook names, ...) or logits=True")
        object.__setattr__(self, "reads", tuple(self.reads))

    def hook_names(self) -> tuple[str, ...]:
        return (*self.reads, *((LOGITS,) if self.logits else ()))

    def __call__(self, acts, mask) -> Float[torch.Tensor, " batch"]:
        out = torch.as_tensor(self.fn(acts.get(LOGITS), acts)).double().cpu().flatten()
        rows = int(mask.shape[0])
        if out.shape != (rows,):
            raise ValueError(
                f"a Custom metric must return one value per row ({rows}), got {tuple(out.shape)}"
            )
        return out


def _one_id(tokenizer: Any, text: str, what: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{what} {text!r} is {len(ids)} tokens, not one (try a leading space)")
    return int(ids[0])


def normalized(patched: torch.Tensor, clean: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """ARENA normalisation ``(patched − corrupt) / (clean − corrupt)`` (clean → 1, corrupt → 0).

    ``clean`` and ``corrupt`` are scalars (prompt means); NaN where they coincide.
    """
    denom = float(clean) - float(corrupt)
    if denom == 0 or not math.isfinite(denom):
        return torch.full_like(patched, float("nan"))
    return (patched - float(corrupt)) / denom


def metric_hooks(metrics: Mapping[str, PatchMetric]) -> list[str]:
    """Every input the metrics read, in first-use order."""
    return list(dict.fromkeys(n for m in metrics.values() for n in m.hook_names()))


def hook_layer(name: str, n_layers: int) -> int:
    """Block index of a ``blocks.L....`` hook name; :data:`LOGITS` counts as the last block."""
    if name == LOGITS:
        return n_layers - 1
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
        raise ValueError(f"metric hook {name!r} is not inside a block (nor {LOGITS!r})")
    return int(parts[1])
