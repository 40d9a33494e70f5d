"""Edits of an RMSNorm gain ``w`` (``RMSNorm(h) = h / sqrt(mean(h²) + eps) ⊙ w``; paper.md §2, §3).

``w`` here is always the *effective* gain (``LoadedModel.ffn_norm_gain``: the stored weight, or
``1 + weight`` on Gemma); an edit computes a new effective gain and writes ``model.arch.weight(g)``
(``g − offset``) into the stored parameter, so "the largest-``|w|`` dims" and "a constant gain" mean the
same on every architecture.

* :func:`permuted_gain` — ``w ← w[π]`` for a permutation ``π`` of the ``d_model`` dims: the same gain
  values, on other dims (any alignment with the residual stream is broken, the value spectrum kept).
* :func:`flattened_gain` — ``w ← mean(w) + α (w − mean(w))``: ``α = 1`` is the identity, ``α = 0`` a
  constant gain, ``0 < α < 1`` shrinks the spread of the gains toward their mean.
* :func:`random_permutation` and :func:`top_dims_permutation` build the permutations: a seeded uniform
  one, and one that moves *only* the ``k`` largest-``|w|`` dims, each to a distinct, randomly chosen
  other dim (a product of ``k`` transpositions, so ``2k`` dims change and the rest keep their gain).

``norm="ffn"`` edits the pre-FFN RMSNorm (``ln2``), ``norm="attn"`` the pre-attention one (``ln1``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from jaxtyping import Float

from me_interp.edits.core import edited_parameters
from me_interp.loading.loaded import LoadedModel
from me_interp.selection import top_abs_dims

NORMS: tuple[str, ...] = ("ffn", "attn")


def _check_norm(norm: str) -> str:
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; choose 'ffn' (pre-FFN) or 'attn' (pre-attention)")
    return norm


def gain(model: LoadedModel, layer: int, norm: str = "ffn") -> torch.Tensor:
    """The effective RMSNorm gain of ``layer`` (detached): ``norm="ffn"`` (pre-FFN) or ``"attn"``."""
    _check_norm(norm)
    return model.ffn_norm_gain(layer) if norm == "ffn" else model.attn_norm_gain(layer)


def gain_parameter(model: LoadedModel, layer: int, norm: str = "ffn") -> torch.nn.Parameter:
    """The live stored weight behind :func:`gain` (``gain − model.arch.norm_offset``)."""
    _check_norm(norm)
    return model.ffn_norm_weight(layer) if norm == "ffn" else model.attn_norm_weight(layer)


@contextlib.contextmanager
def set_gain(
    model: LoadedModel, layer: int, value: torch.Tensor, norm: str = "ffn"
) -> Iterator[None]:
    """Within the block, the *effective* RMSNorm gain of ``layer`` is ``value``; restored on exit."""
    param = gain_parameter(model, layer, norm)
    with edited_parameters({param: model.arch.weight(value.to(param.device, param.dtype))}):
        yield


def check_permutation(perm: Sequence[int] | torch.Tensor, n: int) -> torch.Tensor:
    """``perm`` as a long tensor if it is a permutation of ``0..n-1``, else raise ``ValueError``."""
    p = torch.as_tensor(perm if isinstance(perm, torch.Tensor) else list(perm)).long().flatten()
    if p.numel() != n or not torch.equal(p.sort().values, torch.arange(n)):
        raise ValueError(
            f"perm must be a permutation of 0..{n - 1} (length {n}), got length {p.numel()}"
        )
    return p


def random_permutation(n: int, seed: int) -> torch.Tensor:
    """A uniform random permutation of ``0..n-1`` from a seeded generator (independent of global RNG)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def top_dims(w: Float[torch.Tensor, " d"], k: int) -> list[int]:
    """The ``k`` dims with the largest ``|w|`` (ties broken by the lower index), largest first."""
    if not 1 <= k <= w.numel():
        raise ValueError(f"k must be in 1..{w.numel()}, got {k}")
    return top_abs_dims(w.flatten(), k).tolist()


def top_dims_permutation(w: Float[torch.Tensor, " d"], k: int, seed: int) -> torch.Tensor:
    """A permutation that moves only the ``k`` largest-``|w|`` dims (see module docstring).

    Each top dim ``i`` is transposed with a distinct dim ``j`` drawn (seeded) from the non-top dims, so
    ``w[π]`` has the top gains on ``k`` former non-top dims and the displaced small gains on the top
    dims; every other dim is fixed.

    Raises:
        ValueError: ``k`` not in ``1..d//2`` (there must be as many non-top dims to swap with).
    """
    d = w.numel()
    if not 1 <= k <= d // 2:
        raise ValueError(f"k must be in 1..{d // 2} (half of d_model={d}), got {k}")
    top = top_dims(w, k)
    rest = torch.tensor([i for i in range(d) if i not in set(top)])
    gen = torch.Generator().manual_seed(seed)
    partners = rest[torch.randperm(len(rest), generator=gen)[:k]].tolist()
    perm = torch.arange(d)
    for i, j in zip(top, partners):
        perm[i], perm[j] = j, i
    return perm


@contextlib.contextmanager
def permuted_gain(
    model: LoadedModel, layer: int, perm: Sequence[int] | torch.Tensor, norm: str = "ffn"
) -> Iterator[None]:
    """Within the block, the effective RMSNorm gain of ``layer`` is ``w[perm]``; restored on exit.

    Raises:
        ValueError: an unknown norm, a layer out of range, or ``perm`` not a permutation of the dims.
    """
    w = gain(model, layer, norm)
    p = check_permutation(perm, w.numel()).to(w.device)
    with set_gain(model, layer, w[p], norm):
        yield


@contextlib.contextmanager
def flattened_gain(
    model: LoadedModel, layer: int, alpha: float, norm: str = "ffn"
) -> Iterator[None]:
    """Within the block, the RMSNorm gain of ``layer`` is ``mean(w) + alpha (w − mean(w))``.

    Raises:
        ValueError: an unknown norm, a layer out of range, or a non-finite ``alpha``.
    """
    alpha = float(alpha)
    if not torch.isfinite(torch.tensor(alpha)):
        raise ValueError(f"alpha must be finite, got {alpha}")
    w = gain(model, layer, norm)
    mean = w.mean()
    with set_gain(model, layer, mean + alpha * (w - mean), norm):
        yield


def other_dims_permutation(w: Float[torch.Tensor, " d"], k: int, seed: int) -> torch.Tensor:
    """The control of :func:`top_dims_permutation`: ``k`` transpositions among the
    dims *outside* the ``k`` largest-``|w|`` ones (``2k`` dims move, as there; no large gain does).

    Raises:
        ValueError: ``k`` not in ``1..d//3`` (``2k`` other dims must exist beside the top ``k``).
    """
    d = w.numel()
    if not 1 <= k <= d // 3:
        raise ValueError(f"top_k must be in 1..{d // 3} (a third of d_model={d}), got {k}")
    top = set(top_dims(w, k))
    rest = torch.tensor([i for i in range(d) if i not in top])
    gen = torch.Generator().manual_seed(seed)
    pick = rest[torch.randperm(len(rest), generator=gen)[: 2 * k]].tolist()
    perm = torch.arange(d)
    for i, j in zip(pick[0::2], pick[1::2]):
        perm[i], perm[j] = j, i
    return perm
