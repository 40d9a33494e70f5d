"""Evaluation under interventions (TransformerLens hooks), for the mask-rate study and beyond.

* ``perplexity = exp( Σ −log p(x_{t+1} | x_{≤t}) / N )`` over every real next-token prediction of every
  text (padding excluded), the same token count with and without hooks;
* next-token agreement with the unmodified model: ``mean_t KL(p_ref,t ‖ p_int,t)`` and top-1 agreement;
* multiple-choice scoring by log-likelihood, ``Σ_{t∈choice} log p(x_t | x_{<t})`` (the lm-eval-harness
  ``acc`` rule, and a per-token-normalised variant), on the shipped item set
  (``me_interp/data/mc_items.json``) or any file of the same shape. Real benchmarks: ``docs/wemask.md``.

Claims about these numbers need intervals over *texts* and *items*, so every metric is also available
per unit: :func:`text_nll` and :func:`text_agreement` give per-text sums (perplexity and KL pool them
as ``exp(Σ_b nll_b / Σ_b n_b)`` and ``Σ_b kl_b / Σ_b n_b``), :attr:`MCResult.correct` per-item
outcomes. :func:`text_metrics` measures one forward of a batch of texts per text (NLL, KL and top-1
against a :class:`Reference`, attention to position 0 and its entropy, effective rank) and
:func:`pooled_metrics` pools them. :class:`Reference` keeps the unmodified model's distributions, so
the KL of each intervened run costs one product (:func:`agreement_to`). :func:`length_batches` splits
texts into batches of similar length, so that a long text does not pad every other one.
:func:`sweep` measures the unmodified model and a list of interventions over the same texts (the
WeMask study), on TransformerLens hooks (:class:`Sweep`) or in another backend's traces;
:class:`MaskRows` reads its rows back by condition, and :func:`we_mask_effect` is one WeMask on a
string, the unmasked model beside it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, astuple, dataclass
from importlib import resources
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int

from me_interp import claims, names
from me_interp.interventions.core import PositionsArg, tl_hooks
from me_interp.interventions.soft import MaskCondition
from me_interp.interventions.wemask import WeMask, mask_layers
from me_interp.loading.inputs import as_batch
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.batching import Prefix, capture_prefix, record
from me_interp.probes.geometry import effective_rank
from me_interp.probes.to_position import logits_nll


def token_nll(
    model: LoadedModel, batch: Batch, fwd_hooks: Sequence = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position next-token NLL ``[batch, pos-1]`` and its validity mask."""
    logits = model.run_with_hooks(batch, fwd_hooks)
    return logits_nll(logits, batch.tokens, batch.attention_mask)


def perplexity(model: LoadedModel, texts: Sequence[str] | Batch, fwd_hooks: Sequence = ()) -> float:
    """Perplexity of ``texts`` (strings or a Batch) under ``fwd_hooks``."""
    batch = texts if isinstance(texts, Batch) else model.tokenize(list(texts))
    nll, valid = token_nll(model, batch, fwd_hooks)
    if not valid.any():
        raise ValueError("perplexity needs texts with at least 2 tokens")
    return math.exp(float(nll[valid].mean()))


def _pooled_ppl_ratio(m: np.ndarray) -> np.ndarray | float:
    """Pooled ``ppl(column 2) / ppl(column 1)`` of per-text rows ``[n_pred, nll_ref, nll_x]`` from
    their column means ``m`` (a ratio of sums is a ratio of means; vectorised over leading axes)."""
    return np.exp((m[..., 2] - m[..., 1]) / m[..., 0])


PPL_RATIO = claims.of_means(_pooled_ppl_ratio)
"""The ``claims.Sample`` statistic of rows ``[n_pred, nll_ref, nll_x]``: the pooled perplexity ratio."""
PPL_CHANGE = claims.of_means(lambda m: _pooled_ppl_ratio(m) - 1.0)
"""The same ratio − 1 (signed: an equivalence claim bootstraps it unfolded)."""


@claims.of_means
def sink_drop(m: np.ndarray) -> np.ndarray | float:
    """``1 − mean(column 1) / mean(column 0)`` (the relative drop of a mean, e.g. of the attention
    to the sink), NaN when the base is not positive."""
    return 1.0 - claims.divide(m[..., 1], m[..., 0], m[..., 0] > 0)


@claims.of_means
def ratio_change(m: np.ndarray) -> np.ndarray | float:
    """``mean(column 1) / mean(column 0) − 1`` (e.g. of an MC accuracy), NaN when the base is not
    positive."""
    return claims.divide(m[..., 1], m[..., 0], m[..., 0] > 0) - 1.0


@dataclass(frozen=True)
class TextNLL:
    """Per-text next-token NLL sums: text ``b`` contributes ``nll[b] = Σ_t −log p(x_{t+1} | x_{≤t})``
    over its ``n[b]`` real predictions."""

    nll: list[float]
    n: list[int]

    @property
    def perplexity(self) -> float:
        """The pooled perplexity ``exp(Σ_b nll_b / Σ_b n_b)`` (what :func:`perplexity` computes)."""
        return pooled_perplexity(self.nll, self.n)


def text_nll(
    logits: Float[torch.Tensor, "batch pos vocab"],
    tokens: Int[torch.Tensor, "batch pos"],
    mask: Int[torch.Tensor, "batch pos"] | Bool[torch.Tensor, "batch pos"],
    *,
    normalized: bool = False,
) -> TextNLL:
    """Per-text NLL sums and prediction counts of ``tokens`` under ``logits`` (padding excluded).

    ``normalized=True``: ``logits`` are already log-probabilities (``log_softmax``), so one
    normalisation serves both this and :func:`agreement_to`.
    """
    if normalized:
        target = tokens[:, 1:].to(logits.device)
        nll = -logits[:, :-1].gather(-1, target[..., None])[..., 0].cpu()
        m = mask.bool().cpu()
        valid = m[:, 1:] & m[:, :-1]
    else:
        nll, valid = logits_nll(logits, tokens, mask)
    nll = torch.where(valid, nll.double(), torch.zeros((), dtype=torch.float64))
    return TextNLL(nll=nll.sum(-1).tolist(), n=[int(v) for v in valid.sum(-1)])


def forward_nll(model: LoadedModel, batch: Batch, hooks: Sequence = (), **prefix) -> TextNLL:
    """:func:`text_nll` of one forward of ``batch`` under ``hooks`` (``prefix``, ``start``: blocks
    ``start..`` only, from a captured prefix: :func:`me_interp.probes.batching.record`)."""
    logits = record(model, batch, [], fwd_hooks=hooks, logits=True, **prefix)
    return text_nll(logits, batch.tokens, batch.attention_mask)


def pooled_perplexity(nll: Sequence[int | float], n: Sequence[int | float]) -> float:
    """``exp(Σ_b nll_b / Σ_b n_b)``: the perplexity of a set of texts from per-text sums.

    Raises:
        ValueError: no prediction at all (``Σ n = 0``).
    """
    total = sum(n)
    if total <= 0:
        raise ValueError("perplexity needs texts with at least 2 tokens")
    return math.exp(sum(nll) / total)


def length_batches(
    model: LoadedModel, texts: Sequence[str], max_tokens: int = 1024
) -> list[tuple[list[int], Batch]]:
    """``texts`` tokenised (with the model's BOS choice) and grouped by length into batches of at most
    ``max_tokens`` padded tokens (a longer text gets a batch of its own).

    Returns:
        ``[(indices, batch), ...]``: ``batch`` row ``i`` is ``texts[indices[i]]``; every text appears
        once. Rows of similar length share a batch, so little compute goes to padding.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    full = model.tokenize(list(texts))
    lengths = full.lengths
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    out = []
    for g in groups:
        rows = [full.tokens[i, : lengths[i]].tolist() for i in g]
        prompts = None if full.prompts is None else tuple(full.prompts[i] for i in g)
        out.append((g, model.batch_from_ids(rows, prompts=prompts)))
    return out


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


@dataclass(frozen=True)
class TextAgreement:
    """Per-text sums behind :class:`Agreement`: text ``b`` has ``n[b]`` real positions, ``kl[b] =
    Σ_t KL(p_ref,t ‖ p_int,t)`` and ``top1[b]`` positions whose argmax agrees."""

    kl: list[float]
    top1: list[int]
    n: list[int]

    def pooled(self) -> tuple[float, float]:
        """``(Σ kl / Σ n, Σ top1 / Σ n)``: the mean KL and top-1 agreement over every position."""
        total = sum(self.n)
        if total <= 0:
            raise ValueError("no real positions to compare")
        return sum(self.kl) / total, sum(self.top1) / total


@dataclass(frozen=True)
class Reference:
    """The unmodified model's next-token distributions on one batch, kept to compare intervened runs
    with: ``probs = p_ref`` ``[batch pos vocab]``, ``neg_entropy = Σ_v p_ref log p_ref`` and the
    ``argmax`` ``[batch pos]``. Then ``KL(p_ref ‖ q) = neg_entropy − Σ_v p_ref log q`` costs one
    product per run (:func:`agreement_to`)."""

    probs: Float[torch.Tensor, "batch pos vocab"]
    neg_entropy: Float[torch.Tensor, "batch pos"]
    argmax: Int[torch.Tensor, "batch pos"]

    @classmethod
    def of(cls, logits: Float[torch.Tensor, "batch pos vocab"], *, normalized: bool = False):
        """From logits (``normalized=True``: from log-probabilities)."""
        lp = logits.float() if normalized else torch.log_softmax(logits.float(), -1)
        p = lp.exp()
        return cls(probs=p, neg_entropy=(p * lp).sum(-1), argmax=lp.argmax(-1))


def agreement_to(
    ref: Reference,
    logp: Float[torch.Tensor, "batch pos vocab"],
    mask: Int[torch.Tensor, "batch pos"] | Bool[torch.Tensor, "batch pos"],
) -> TextAgreement:
    """Per-text KL(p_ref ‖ q) sums and top-1 agreement counts of the log-probabilities ``logp`` (of
    the intervened run) against ``ref``, over each text's real positions."""
    if ref.probs.shape != logp.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref.probs.shape)} vs {tuple(logp.shape)}")
    lq = logp.float().to(ref.probs.device)
    valid = mask.bool().to(lq.device)
    kl = (ref.neg_entropy - (ref.probs * lq).sum(-1)).double()  # [batch pos]
    same = ref.argmax == lq.argmax(-1)
    zero = torch.zeros((), dtype=torch.float64, device=kl.device)
    return TextAgreement(
        kl=torch.where(valid, kl, zero).sum(-1).cpu().tolist(),
        top1=[int(v) for v in (same & valid).sum(-1).cpu()],
        n=[int(v) for v in valid.sum(-1).cpu()],
    )


def text_agreement(
    ref_logits: Float[torch.Tensor, "batch pos vocab"],
    logits: Float[torch.Tensor, "batch pos vocab"],
    mask: Int[torch.Tensor, "batch pos"] | Bool[torch.Tensor, "batch pos"],
) -> TextAgreement:
    """Per-text KL(p_ref ‖ p) sums and top-1 agreement counts over each text's real positions (the
    per-unit form of :func:`agreement`; pooled, they give the same numbers)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    lq = torch.log_softmax(logits.float().to(ref_logits.device), -1)
    return agreement_to(Reference.of(ref_logits), lq, mask)


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
# per-text metrics of one forward (the mask-rate study)
# ------------------------------------------------------------------------------------------

TEXT_STATS = ("nll", "n_pred", "kl", "top1", "n_pos", "sink", "entropy", "eff_rank")
"""Per-text statistics of :func:`text_metrics` (sums for nll / kl / top1 with their counts, means
otherwise)."""
POOLED_METRICS = ("perplexity", "kl", "top1", "sink", "entropy", "eff_rank")
"""What :func:`pooled_metrics` makes of them."""
METRIC_TITLES: dict[str, str] = {
    "perplexity": "perplexity (shipped texts)",
    "kl": "next-token KL to the unmodified model (nats)",
    "top1": "top-1 agreement with the unmodified model",
    "sink": "attention to position 0 (masked layers)",
    "entropy": "attention entropy (nats, masked layers)",
    "eff_rank": "effective rank of token states",
    "mc_accuracy": "MC accuracy (shipped items)",
}
"""A title for each pooled metric and the MC accuracy (figure panels)."""


@dataclass(frozen=True)
class TextStats:
    """Per text, in the order of the texts, the statistics :data:`TEXT_STATS` of one condition."""

    nll: list[float]
    n_pred: list[float]
    kl: list[float]
    top1: list[float]
    n_pos: list[float]
    sink: list[float]
    entropy: list[float]
    eff_rank: list[float]

    def perplexity(self) -> np.ndarray:
        """``[text]``: each text's own perplexity ``exp(nll_b / n_b)`` (NaN for a text without a
        prediction)."""
        nll = np.asarray(self.nll, dtype=np.float64)
        n = np.asarray(self.n_pred, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(n > 0, np.exp(nll / np.where(n > 0, n, 1.0)), np.nan)


@dataclass(frozen=True)
class ItemOutcomes:
    """Per MC item: whether the summed (``correct``) and the per-token mean (``correct_norm``)
    log-likelihood pick the right choice."""

    correct: list[bool]
    correct_norm: list[bool]


@dataclass(frozen=True)
class Metrics:
    """The pooled metrics (:data:`POOLED_METRICS`) of one condition, their per-text statistics and,
    when MC items were scored, the accuracy with its per-item outcomes."""

    perplexity: float
    kl: float
    top1: float
    sink: float
    entropy: float
    eff_rank: float
    per_text: TextStats
    mc_accuracy: float | None = None
    per_item: ItemOutcomes | None = None

    @classmethod
    def of(cls, m: dict[str, Any]) -> Metrics:
        """The typed form of one row of :func:`sweep` (pooled metrics, ``per_text``, ``per_item``)."""
        items = m.get("per_item")
        return cls(
            **{k: float(m[k]) for k in POOLED_METRICS},
            per_text=TextStats(**{k: [float(v) for v in m["per_text"][k]] for k in TEXT_STATS}),
            mc_accuracy=None if m.get("mc_accuracy") is None else float(m["mc_accuracy"]),
            per_item=None if items is None else ItemOutcomes(
                [bool(v) for v in items["correct"]], [bool(v) for v in items["correct_norm"]]
            ),
        )  # fmt: skip


def nll_columns(*rows: Metrics) -> np.ndarray:
    """``[text, 1 + len(rows)]``: the prediction count, then the NLL sum of each row, per text (what
    :data:`PPL_RATIO` and :data:`PPL_CHANGE` read)."""
    n = np.asarray(rows[0].per_text.n_pred, dtype=np.float64)
    return np.column_stack([n, *(np.asarray(r.per_text.nll, dtype=np.float64) for r in rows)])


def text_gap(row: Metrics, weight: Metrics, base: Metrics) -> np.ndarray:
    """``[text]``: ``(ppl_x − ppl_weight) / ppl_unmasked`` of each text (its own perplexities): how much
    more the condition of ``row`` hurts than the one of ``weight``, in units of ``base``."""
    ppl = lambda m: m.per_text.perplexity()  # noqa: E731
    return (ppl(row) - ppl(weight)) / ppl(base)


def check_rank_layer(layer: int, n_layers: int) -> int:
    """``layer`` as a 0-based layer (negative: from the end), or ``ValueError``."""
    if not -n_layers <= layer < n_layers:
        raise ValueError(
            f"rank_layer {layer} is out of range: this model has {n_layers} layers "
            f"(0..{n_layers - 1}, or -{n_layers}..-1 from the end)"
        )
    return layer % n_layers


def _eff_rank(x: torch.Tensor) -> float:
    try:
        return effective_rank(x)
    except ValueError:  # an all-zero block of states
        return math.nan


def text_metrics(
    model: LoadedModel,
    batch: Batch,
    hooks: Sequence,
    layers: Sequence[int],
    rank_layer: int,
    ref: Reference | None,
    prefix: Prefix | None = None,
    start: int = 0,
) -> tuple[dict[str, list[float]], Reference | None]:
    """Per-text statistics (:data:`TEXT_STATS`) of one forward of ``batch`` under ``hooks``.

    Per text ``b``: the next-token NLL sum ``nll`` over its ``n_pred`` predictions; the KL sum ``kl``
    and agreeing-argmax count ``top1`` over its ``n_pos`` positions against ``ref``; ``sink`` and
    ``entropy``: per head the mean over real queries ``q ≥ 1`` of the attention to position 0 and of
    ``−Σ_k A log A``, then the mean over heads and ``layers``; ``eff_rank``: the effective rank of its
    token states ``t ≥ 1`` at ``rank_layer`` (NaN with fewer than 2 of them).

    ``ref`` (the unmodified model's distributions on the same batch) gives KL and top-1 agreement;
    without it (the baseline) KL is 0, top-1 agreement complete, and the batch's own
    :class:`Reference` is returned for the later runs.

    ``prefix``: the unmodified model's block inputs for this batch as it is
    (``probes.batching.capture_prefix(..., max_tokens=None)``), when ``hooks`` change nothing before
    block ``start`` and ``layers`` and ``rank_layer`` are not before it either: only blocks
    ``start..`` run (``probes.batching.record(prefix=, start=)``).
    """
    acts = Activations(model, batch, [*map(names.pattern, layers), names.resid_post(rank_layer)])
    if prefix is not None and min([*layers, rank_layer]) < start:
        raise ValueError(f"a run from block {start} records nothing of layers {min(layers)}..")
    logits = record(model, batch, [acts], fwd_hooks=hooks, logits=True, prefix=prefix, start=start)
    logp = torch.log_softmax(logits.float(), -1).cpu()
    del logits
    mask = batch.attention_mask.cpu()
    nll = text_nll(logp, batch.tokens.cpu(), mask, normalized=True)
    own = None
    if ref is not None:
        ag = agreement_to(ref, logp, mask)
    else:
        n_pos = [int(v) for v in mask.sum(-1)]
        ag = TextAgreement(kl=[0.0] * len(n_pos), top1=n_pos, n=n_pos)
        own = Reference.of(logp, normalized=True)
    del logp
    q = mask.bool().clone()
    q[:, 0] = False  # queries t >= 1
    qm = q[:, None, :].float()  # [batch 1 q]
    n_q = qm.sum(-1).clamp_min(1.0)  # [batch 1]
    sink = torch.zeros(len(batch), dtype=torch.float64)
    ent = torch.zeros(len(batch), dtype=torch.float64)
    for L in layers:
        a = acts[names.pattern(L)].float().cpu()  # [batch head q k]
        to0 = a[..., 0]
        h = -(a * a.clamp_min(1e-30).log()).sum(-1)
        sink += ((to0 * qm).sum(-1) / n_q).mean(-1).double()  # per text: mean over queries, heads
        ent += ((h * qm).sum(-1) / n_q).mean(-1).double()
    resid = acts[names.resid_post(rank_layer)].float().cpu()
    ranks = [_eff_rank(resid[b, 1:n]) if n > 2 else math.nan for b, n in enumerate(batch.lengths)]
    stats = {
        "nll": nll.nll,
        "n_pred": [float(n) for n in nll.n],
        "kl": ag.kl,
        "top1": [float(t) for t in ag.top1],
        "n_pos": [float(n) for n in ag.n],
        "sink": (sink / len(layers)).tolist(),
        "entropy": (ent / len(layers)).tolist(),
        "eff_rank": ranks,
    }
    return stats, own


def pooled_metrics(per_text: dict[str, Sequence[float]]) -> dict[str, float]:
    """Pooled metrics (:data:`POOLED_METRICS`) from per-text statistics: perplexity
    ``exp(Σ nll / Σ n)``, KL and top-1 over every position, the other metrics averaged over texts
    (effective rank over the texts where it is defined)."""
    n_pos = sum(per_text["n_pos"])
    ranks = [r for r in per_text["eff_rank"] if r == r]
    return {
        "perplexity": pooled_perplexity(per_text["nll"], per_text["n_pred"]),
        "kl": sum(per_text["kl"]) / n_pos,
        "top1": sum(per_text["top1"]) / n_pos,
        "sink": float(np.mean(per_text["sink"])),
        "entropy": float(np.mean(per_text["entropy"])),
        "eff_rank": float(np.mean(ranks)) if ranks else math.nan,
    }


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
    per-token mean (lm-eval-harness's ``acc`` and a length-normalised variant). ``correct`` and
    ``correct_norm`` are the per-item outcomes behind them (for intervals over items).
    """

    accuracy: float
    accuracy_norm: float
    loglik: list[list[float]]
    n_tokens: list[list[int]]
    predictions: list[int]
    answers: list[int]
    predictions_norm: list[int]

    @property
    def correct(self) -> list[bool]:
        """Per item: whether the summed log-likelihood picks the right choice."""
        return [p == a for p, a in zip(self.predictions, self.answers)]

    @property
    def correct_norm(self) -> list[bool]:
        """Per item: whether the per-token mean log-likelihood picks the right choice."""
        return [p == a for p, a in zip(self.predictions_norm, self.answers)]

    def to_dict(self) -> dict:
        return {**asdict(self), "correct": self.correct, "correct_norm": self.correct_norm}


def load_mc_items(path: str | None = None) -> list[MCItem]:
    """MC items from a JSON list of ``{"context", "choices", "answer"}`` (default: the shipped set)."""
    if path is None:
        text = resources.files("me_interp.data").joinpath(MC_FILE).read_text(encoding="utf-8")
    else:
        from me_interp.prompts import read_text_file

        text = read_text_file(path, "MC item file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"MC item file {path} is not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"MC item file {path} must hold a non-empty JSON list of items")
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
    scores = [0.0] * len(rows)
    order = sorted(range(len(rows)), key=lambda r: (len(rows[r]), r))  # similar lengths per batch
    for s in range(0, len(order), batch_size):
        chunk = order[s : s + batch_size]
        batch = model.batch_from_ids([rows[r] for r in chunk])
        logits = model.run_with_hooks(batch, fwd_hooks)
        for j, r in enumerate(chunk):
            a, b = spans[r]
            logp = torch.log_softmax(logits[j, a - 1 : b - 1].float(), -1).cpu()  # [choice vocab]
            tgt = torch.as_tensor(rows[r][a:b])
            scores[r] = float(logp.gather(-1, tgt[:, None]).sum())
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
        predictions_norm=preds_norm,
    )


# ------------------------------------------------------------------------------------------
# a sweep: the unmodified model and each intervention over the same texts
# ------------------------------------------------------------------------------------------

SpecFor = Callable[[Any], Any]
"""Builds an intervention spec (:class:`~me_interp.interventions.core.Edit`) for target positions:
one tuple for every text of a batch, or one list per text."""


@dataclass(frozen=True)
class SweepResult:
    """What :func:`sweep` measured: the unmodified model's pooled metrics with their ``per_text``
    statistics (and, when scored, ``mc_accuracy`` with ``per_item`` outcomes) in ``base``; the same
    for each spec in ``rows`` (``None``: a spec the model's backend does not apply); ``n_items`` MC
    items scored (0: none); ``not_measured``: what the backend left out, in words."""

    base: dict[str, Any]
    rows: list[dict[str, Any] | None]
    n_items: int = 0
    not_measured: str | None = None


@dataclass
class Sweep:
    """:func:`sweep` with TransformerLens hooks: one forward per spec and length group of texts, the
    KL and top-1 agreement against the unmodified model's distributions (its :class:`Reference`),
    and, with :attr:`prefixes`, each forward from the first block a spec edits."""

    model: LoadedModel
    layers: list[int]
    rank_layer: int
    chunks: list[tuple[list[int], Batch]]
    n_texts: int
    positions: Any = (0,)
    per_text: bool = False
    items: Sequence[MCItem] = ()
    prefixes: list[Prefix | None] | None = None
    """Per text batch, the unmodified model's block inputs (``probes.batching.capture_prefix``): a
    spec then runs from the first edited block (the blocks before are the unmodified model's)."""

    def _positions(self, idx: list[int]) -> Any:
        return [self.positions[i] for i in idx] if self.per_text else self.positions

    def measure(
        self, spec_for: SpecFor | None, refs: list[Reference] | None, score_mc: bool = False
    ) -> tuple[dict[str, Any], list[Reference | None]]:
        """The pooled metrics, ``per_text`` statistics and (``score_mc`` with items) MC outcomes
        under the spec ``spec_for`` builds (``None``: the unmodified model, whose references are
        returned for the others)."""
        from me_interp.interventions import core

        per_text: dict[str, list[float]] = {k: [math.nan] * self.n_texts for k in TEXT_STATS}
        own = []
        for c, (idx, batch) in enumerate(self.chunks):
            hooks = []
            if spec_for is not None:
                hooks = core.tl_hooks(spec_for(self._positions(idx)))
            ref = None if refs is None else refs[c]
            prefix = None if self.prefixes is None else self.prefixes[c]
            stats, r = text_metrics(
                self.model,
                batch,
                hooks,
                self.layers,
                self.rank_layer,
                ref,
                prefix,
                min(self.layers),
            )
            for k, vals in stats.items():
                for i, v in zip(idx, vals):
                    per_text[k][i] = v
            own.append(r)
        out: dict[str, Any] = {**pooled_metrics(per_text), "per_text": per_text}
        if self.items and score_mc:  # MC rows start at the first token: position 0
            hooks = [] if spec_for is None else core.tl_hooks(spec_for((0,)))
            mc = score_choices(self.model, self.items, hooks)
            out["mc_accuracy"] = mc.accuracy
            out["per_item"] = {"correct": mc.correct, "correct_norm": mc.correct_norm}
        return out, own


def sweep(
    model: Any,
    chunks: list[tuple[list[int], Batch]],
    layers: Sequence[int],
    rank_layer: int,
    specs: Sequence[SpecFor],
    *,
    positions: Any = (0,),
    per_text: bool = False,
    items: Sequence[MCItem] = (),
    score_mc: Sequence[bool] | None = None,
    progress: Callable[[list], Iterable] | None = None,
) -> SweepResult:
    """Per-text statistics (:data:`TEXT_STATS`, pooled by :func:`pooled_metrics`) of the unmodified
    model and of each intervention of ``specs`` over the texts of ``chunks``
    (:func:`length_batches`), with attention statistics over ``layers`` and the effective rank at
    ``rank_layer``; the MC ``items`` scored on the unmodified model and on the specs ``score_mc``
    marks. ``positions``: the target positions, one tuple for every text or (``per_text``) one
    list per text.

    A model of another backend (:mod:`me_interp.backends`) runs the sweep in its own traces; what
    it does not measure is ``None`` / NaN and said in :attr:`SweepResult.not_measured`.
    """
    from me_interp.probes.batching import own_backend

    score = [False] * len(specs) if score_mc is None else list(score_mc)
    if len(score) != len(specs):
        raise ValueError(f"score_mc has {len(score)} entries for {len(specs)} specs")
    if own_backend(model):
        return model.sweep(
            chunks, layers, rank_layer, specs, positions=positions, per_text=per_text,
            items=items, score_mc=score, progress=progress,
        )  # fmt: skip
    s = Sweep(
        model=model,
        layers=list(layers),
        rank_layer=rank_layer,
        chunks=chunks,
        n_texts=sum(len(idx) for idx, _ in chunks),
        positions=positions,
        per_text=per_text,
        items=list(items),
    )
    base, refs = s.measure(None, None, score_mc=True)
    start = min(s.layers)
    if 0 < start <= s.rank_layer:  # the specs change nothing before the first edited layer
        s.prefixes = [capture_prefix(model, b, [start], max_tokens=None) for _, b in s.chunks]
    todo = list(zip(specs, score))
    rows = [s.measure(f, refs, mc)[0] for f, mc in (progress or iter)(todo)]
    return SweepResult(base, rows, len(s.items))


# ------------------------------------------------------------------------------------------
# the rows of a mask-rate study, and one WeMask on a string
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskRow:
    """One condition's measurements; a row that shares another's forward says which (``same_as``)."""

    condition: MaskCondition
    metrics: Metrics
    same_as: str | None = None


@dataclass(frozen=True)
class RandomGaps:
    """Per text and random seed: ``(ppl_random − ppl_weight) / ppl_unmasked`` of the text's own
    perplexities (:func:`text_gap`); ``per_text[text][seed]``."""

    seeds: list[int]
    per_text: list[list[float]]


class MaskRows:
    """Reading the ``rows`` (:class:`MaskRow`) of a mask-rate study back by condition; the class
    that mixes it in has ``rows``, ``baseline`` (:class:`Metrics`), ``claim_rate`` and a run header
    with ``seed``."""

    rows: list[MaskRow]
    baseline: Metrics
    claim_rate: float
    header: Any

    def metrics(
        self, kind: str, variant: str, rate: float, alpha: float = 1.0, seed: int | None = None
    ) -> Metrics | None:
        """The metrics of one condition (``seed=None``: the run's own seed), ``None`` when not run."""
        c = MaskCondition(kind, variant, rate, alpha, self.header.seed if seed is None else seed)  # type: ignore[arg-type]
        return next((r.metrics for r in self.rows if r.condition == c), None)

    def random_rows(self, rate: float) -> list[MaskRow]:
        """Every seed's ``random`` row at ``rate``."""
        return [r for r in self.rows if r.condition.is_wemask("random", rate)]

    def full_row(self) -> Metrics | None:
        """The ``r = 1`` forward (the one row every selection shares), or ``None`` when not run."""
        full = (r for r in self.rows if r.condition.is_wemask(rate=1.0) and r.same_as is None)
        return next((r.metrics for r in full), None)

    def random_gaps(self) -> RandomGaps:
        """The gaps of every random seed to the ``weight`` selection at ``claim_rate`` (empty when
        either was not run)."""
        w, rand = (
            self.metrics("wemask", "weight", self.claim_rate),
            self.random_rows(self.claim_rate),
        )
        if w is None or not rand:
            return RandomGaps([], [])
        gaps = np.column_stack([text_gap(r.metrics, w, self.baseline) for r in rand])  # [text seed]
        return RandomGaps([r.condition.seed for r in rand], gaps.tolist())

    def table(self) -> str:
        """The baseline and every row run (not those sharing another's forward), one line each."""
        from me_interp.terminal import fmt_table

        metrics = [*POOLED_METRICS, "mc_accuracy"]
        cell = lambda x, m: "-" if getattr(x, m) is None else getattr(x, m)  # noqa: E731
        rows = [("baseline", "-", "-", "-", "-", *(cell(self.baseline, m) for m in metrics))]
        rows += [(*astuple(r.condition), *(cell(r.metrics, m) for m in metrics))
                 for r in self.rows if r.same_as is None]  # fmt: skip
        return fmt_table(["kind", "variant", "rate", "alpha", "seed", *metrics], rows)

    def rate_curve(self, variant: str, metric: str) -> list[tuple[float, float]]:
        """``(rate, value)`` of one WeMask selection; several random seeds at a rate averaged."""
        by: dict[float, list[float]] = {}
        for r in self.rows:
            if r.condition.is_wemask(variant) and getattr(r.metrics, metric) is not None:
                by.setdefault(r.condition.rate, []).append(getattr(r.metrics, metric))
        return sorted((k, float(np.mean(v))) for k, v in by.items())

    def alpha_curve(self, kind: str, metric: str) -> list[tuple[float, float]]:
        """``(α, value)`` of one soft alternative, from the unmasked model at ``α = 0``."""
        pts = [(r.condition.alpha, getattr(r.metrics, metric)) for r in self.rows
               if r.condition.kind == kind and getattr(r.metrics, metric) is not None]  # fmt: skip
        return [(0.0, getattr(self.baseline, metric)), *sorted(pts)]


@dataclass(frozen=True)
class WeMaskEffect:
    """What one WeMask did to some texts (:func:`we_mask_effect`): the unmasked and the masked
    model's pooled metrics (:class:`Metrics`, per-text statistics inside).

    Attributes:
        variant, rate, layers, positions: the mask (``layers`` 0-based, ``positions`` the masked
            token positions of every text).
        n_texts, n_tokens: the texts measured and their tokens.
        baseline: the unmasked model; ``kl`` 0 and ``top1`` 1 by definition.
        masked: the model under the mask, ``kl`` and ``top1`` against the unmasked model.
    """

    variant: str
    rate: float
    layers: tuple[int, ...]
    positions: tuple
    n_texts: int
    n_tokens: int
    baseline: Metrics
    masked: Metrics

    def __repr__(self) -> str:
        b, m = self.baseline, self.masked
        return (
            f"WeMaskEffect({self.variant} r={self.rate:g}, layers {self.layers[0]}..{self.layers[-1]}"
            f", positions {list(self.positions)}; {self.n_texts} text(s), {self.n_tokens} tokens: "
            f"perplexity {b.perplexity:.4g} -> {m.perplexity:.4g} (x{m.perplexity / b.perplexity:.4g})"
            f", KL {m.kl:.3g} nats, top-1 agreement {m.top1:.3f}, attention to position 0 "
            f"{b.sink:.3f} -> {m.sink:.3f})"
        )


def we_mask_effect(
    model: Any,
    texts: Any,
    rate: float | int = 0.1,
    variant: str = "weight",
    *,
    layers: Sequence[int] | None = None,
    start: str = "ge",
    me_layer: int | None = None,
    positions: PositionsArg = (0,),
    seed: int = 0,
) -> WeMaskEffect:
    """Run ``texts`` without and with WeMask and measure what the mask changes (two forwards).

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        texts: a text ``str``, a list of texts or a :class:`~me_interp.models.Batch`.
        rate: ``r ∈ [0, 1]``, the fraction of the ``d_model`` dims masked.
        variant: the dim selection (``interventions.wemask.ALL_VARIANTS``).
        layers: explicit 0-based layers; default ``interventions.wemask.mask_layers`` from the ME
            layer.
        start: ``"ge"`` (layers ≥ ME, the paper) or ``"gt"`` (layers > ME).
        me_layer: the ME layer; measured on ``texts`` when ``None``.
        positions: the masked token positions (all texts, or one list per text).
        seed: seed of the ``random`` variant.

    Returns:
        :class:`WeMaskEffect`: perplexity, KL and top-1 agreement to the unmasked model, attention
        to position 0 and entropy (mean over heads and the masked layers) and the effective rank of
        the last layer's token states, pooled over the texts.

    Raises:
        NotApplicable: neither ``layers`` nor ``me_layer`` given and no massive activation in
            ``texts``.
    """
    batch = as_batch(model, texts)
    if layers is None:
        layers = mask_layers(model, start=start, me_layer=me_layer, batch=batch)
    spec = WeMask.build(model, layers, rate, variant, positions, seed)
    rank_layer = model.n_layers - 1
    metrics = []
    ref = None
    for hooks in ([], tl_hooks(spec)):
        stats, own = text_metrics(model, batch, hooks, spec.layers, rank_layer, ref)
        ref = own if ref is None else ref
        metrics.append(Metrics.of({**pooled_metrics(stats), "per_text": stats}))
    return WeMaskEffect(
        variant=spec.variant,
        rate=spec.rate,
        layers=spec.layers,
        positions=spec.positions,
        n_texts=len(batch),
        n_tokens=int(batch.attention_mask.sum()),
        baseline=metrics[0],
        masked=metrics[1],
    )
