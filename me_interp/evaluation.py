"""Evaluation under interventions (TransformerLens hooks), for the mask-rate study and beyond.

* ``perplexity = exp( Σ −log p(x_{t+1} | x_{≤t}) / N )`` over every real next-token prediction of every
  text (padding excluded), the same token count with and without hooks;
* next-token agreement with the unmodified model: ``mean_t KL(p_ref,t ‖ p_int,t)`` and top-1 agreement;
* multiple-choice scoring by log-likelihood, ``Σ_{t∈choice} log p(x_t | x_{<t})`` (the lm-eval-harness
  ``acc`` rule, and a per-token-normalised variant), on a small shipped item set
  (``me_interp/data/mc_items.json``) or any file of the same shape. Real benchmarks: ``docs/wemask.md``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources

import torch
from jaxtyping import Bool, Float, Int

from me_interp.models import Batch, LoadedModel


def token_nll(
    model: LoadedModel, batch: Batch, fwd_hooks: Sequence = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position next-token NLL ``[batch, pos-1]`` and its validity mask."""
    logits = model.run_with_hooks(batch, fwd_hooks).float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target = batch.tokens[:, 1:]
    nll = -logp.gather(-1, target[..., None])[..., 0]
    valid = batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    return nll.cpu(), valid.cpu()


def perplexity(model: LoadedModel, texts: Sequence[str] | Batch, fwd_hooks: Sequence = ()) -> float:
    """Perplexity of ``texts`` (strings or a Batch) under ``fwd_hooks``."""
    batch = texts if isinstance(texts, Batch) else model.tokenize(list(texts))
    nll, valid = token_nll(model, batch, fwd_hooks)
    if not valid.any():
        raise ValueError("perplexity needs texts with at least 2 tokens")
    return math.exp(float(nll[valid].mean()))


# ------------------------------------------------------------------------------------------
# agreement with the unmodified model
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    """Next-token agreement of an intervened model with the unmodified one.

    ``kl = mean_t KL(p_ref,t ‖ p_int,t)`` (nats) and ``top1 = mean_t [argmax p_ref,t = argmax p_int,t]``
    over every real position ``t`` (padding excluded); ``max_kl`` is the largest per-position KL.
    """

    kl: float
    max_kl: float
    top1: float
    n_positions: int

    def to_dict(self) -> dict:
        return asdict(self)


def agreement(
    ref_logits: Float[torch.Tensor, "batch pos vocab"],
    logits: Float[torch.Tensor, "batch pos vocab"],
    mask: Int[torch.Tensor, "batch pos"] | Bool[torch.Tensor, "batch pos"],
) -> Agreement:
    """KL(p_ref ‖ p) and top-1 agreement between two sets of logits over the real positions.

    ``KL(p‖q) = Σ_v p_v (log p_v − log q_v)`` with ``p = softmax(ref_logits)``, ``q = softmax(logits)``.
    """
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    valid = mask.bool().to(ref_logits.device)
    if not valid.any():
        raise ValueError("no real positions to compare")
    lp = torch.log_softmax(ref_logits.float(), -1)
    lq = torch.log_softmax(logits.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)[valid]
    same = (ref_logits.argmax(-1) == logits.argmax(-1))[valid].float()
    return Agreement(
        kl=float(kl.mean()),
        max_kl=float(kl.max()),
        top1=float(same.mean()),
        n_positions=int(valid.sum()),
    )


def next_token_agreement(
    model: LoadedModel,
    texts: Sequence[str] | Batch,
    fwd_hooks: Sequence = (),
    ref_logits: torch.Tensor | None = None,
) -> Agreement:
    """Next-token KL and top-1 agreement of the model under ``fwd_hooks`` against the unmodified model.

    ``ref_logits`` (the unmodified logits of the same batch) saves one forward when given.
    """
    batch = texts if isinstance(texts, Batch) else model.tokenize(list(texts))
    ref = model.run_with_hooks(batch) if ref_logits is None else ref_logits
    return agreement(ref, model.run_with_hooks(batch, fwd_hooks), batch.attention_mask)


# ------------------------------------------------------------------------------------------
# multiple-choice scoring by log-likelihood
# ------------------------------------------------------------------------------------------

MC_FILE = "mc_items.json"


@dataclass(frozen=True)
class MCItem:
    """A multiple-choice item: the context, the candidate continuations, the index of the right one."""

    context: str
    choices: tuple[str, ...]
    answer: int

    def __post_init__(self) -> None:
        if len(self.choices) < 2:
            raise ValueError(f"an MC item needs at least 2 choices: {self.context!r}")
        if not 0 <= self.answer < len(self.choices):
            raise ValueError(f"answer {self.answer} out of range for {len(self.choices)} choices")


@dataclass(frozen=True)
class MCResult:
    """Log-likelihood scores of each choice and the accuracies they give.

    ``accuracy``: argmax of ``Σ log p(choice tokens | context)``; ``accuracy_norm``: argmax of the
    per-token mean (lm-eval-harness's ``acc`` and a length-normalised variant).
    """

    accuracy: float
    accuracy_norm: float
    loglik: list[list[float]]
    n_tokens: list[list[int]]
    predictions: list[int]
    answers: list[int]

    def to_dict(self) -> dict:
        return asdict(self)


def load_mc_items(path: str | None = None) -> list[MCItem]:
    """MC items from a JSON list of ``{"context", "choices", "answer"}`` (default: the shipped set)."""
    if path is None:
        text = resources.files("me_interp.data").joinpath(MC_FILE).read_text(encoding="utf-8")
    else:
        text = open(path, encoding="utf-8").read()
    data = json.loads(text)
    if not isinstance(data, list) or not data:
        raise ValueError("an MC file must hold a non-empty JSON list of items")
    try:
        return [MCItem(d["context"], tuple(d["choices"]), int(d["answer"])) for d in data]
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed MC item (need context, choices, answer): {e}") from e


def score_choices(
    model: LoadedModel, items: Sequence[MCItem], fwd_hooks: Sequence = (), batch_size: int = 32
) -> MCResult:
    """Score each choice by ``Σ_{t ∈ choice} log p(x_t | x_{<t})`` after its context, under ``fwd_hooks``.

    The context is tokenised with the model's BOS choice; each choice is tokenised on its own (no
    special tokens) and appended, so the choice tokens are exactly those scored.
    """
    if not items:
        raise ValueError("no MC items to score")
    rows, spans, owner = [], [], []
    for i, it in enumerate(items):
        ctx = model.tokenize(it.context)
        ctx_ids = ctx.tokens[0, : ctx.lengths[0]].tolist()
        for c in it.choices:
            cont = list(model.tokenizer(c, add_special_tokens=False)["input_ids"])
            if not cont:
                raise ValueError(f"choice {c!r} of item {i} has no tokens")
            rows.append(ctx_ids + cont)
            spans.append((len(ctx_ids), len(ctx_ids) + len(cont)))
            owner.append(i)
    scores: list[float] = []
    for s in range(0, len(rows), batch_size):
        batch = model.batch_from_ids(rows[s : s + batch_size])
        logp = torch.log_softmax(model.run_with_hooks(batch, fwd_hooks).float(), -1).cpu()
        toks = batch.tokens.cpu()
        for j, (a, b) in enumerate(spans[s : s + batch_size]):
            tgt = toks[j, a:b]
            scores.append(float(logp[j, a - 1 : b - 1].gather(-1, tgt[:, None]).sum()))
    loglik: list[list[float]] = [[] for _ in items]
    ntok: list[list[int]] = [[] for _ in items]
    for sc, (a, b), i in zip(scores, spans, owner):
        loglik[i].append(sc)
        ntok[i].append(b - a)
    preds = [max(range(len(ll)), key=ll.__getitem__) for ll in loglik]
    preds_norm = [
        max(range(len(ll)), key=lambda k, ll=ll, n=n: ll[k] / n[k]) for ll, n in zip(loglik, ntok)
    ]
    answers = [it.answer for it in items]
    return MCResult(
        accuracy=sum(p == a for p, a in zip(preds, answers)) / len(items),
        accuracy_norm=sum(p == a for p, a in zip(preds_norm, answers)) / len(items),
        loglik=loglik,
        n_tokens=ntok,
        predictions=preds,
        answers=answers,
    )
