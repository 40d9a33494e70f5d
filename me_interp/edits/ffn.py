"""Edits of a gated FFN ``FFN(h) = W_down( σ(W_gate h) ⊙ W_up h )`` (paper.md §1, §3).

* :func:`svd_ablated` removes the top-``k`` singular directions of one matrix:
  with ``W = U diag(s) Vᵀ`` (``s`` descending), ``W ← W − Σ_{i<k} s_i u_i v_iᵀ`` — the best rank-``k``
  part is taken out, the remaining ``rank − k`` directions are untouched.
* :func:`neurons_ablated` removes whole neurons ``n``: ``W_gate[n,:] = W_up[n,:] = 0`` and
  ``W_down[:,n] = 0``, so the neuron's activation and its write to the residual stream are exactly 0.

Matrices are named ``"gate"``, ``"up"``, ``"down"`` (HF ``(out, in)`` layout, via
:meth:`LoadedModel.ffn_weights`). Both edits restore the weights on exit, also after an exception.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from jaxtyping import Float

from me_interp.edits.core import edited_parameters
from me_interp.loading.loaded import LoadedModel

MATRICES: tuple[str, ...] = ("gate", "up", "down")


def ffn_matrix(model: LoadedModel, layer: int, matrix: str) -> torch.nn.Parameter:
    """The live ``W_gate`` / ``W_up`` / ``W_down`` of ``layer``."""
    if matrix not in MATRICES:
        raise ValueError(f"unknown FFN matrix {matrix!r}; choose one of {', '.join(MATRICES)}")
    return getattr(model.ffn_weights(layer), matrix)


def top_singular_part(W: Float[torch.Tensor, "out inp"], k: int) -> Float[torch.Tensor, "out inp"]:
    """``Σ_{i<k} s_i u_i v_iᵀ``, the top-``k`` singular part of ``W`` (computed in float64).

    Raises:
        ValueError: ``k`` not in ``1..min(W.shape)`` (the number of singular directions).
    """
    rank = min(W.shape)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= rank:
        raise ValueError(
            f"k must be an int in 1..{rank} (the matrix has {rank} singular directions), got {k}"
        )
    U, S, Vh = torch.linalg.svd(W.detach().double(), full_matrices=False)
    return ((U[:, :k] * S[:k]) @ Vh[:k]).to(W.dtype)


def ffn_singular_values(model: LoadedModel, layer: int, matrix: str) -> list[float]:
    """Singular values (descending) of the FFN weight ``W_matrix`` of ``layer`` (for those of an
    activation matrix see :func:`me_interp.probes.geometry.singular_values`)."""
    return torch.linalg.svdvals(ffn_matrix(model, layer, matrix).detach().double()).tolist()


@contextlib.contextmanager
def svd_ablated(model: LoadedModel, layer: int, matrix: str, k: int) -> Iterator[None]:
    """Within the block, ``W_matrix`` of ``layer`` has its top-``k`` singular directions removed.

    Raises:
        ValueError: an unknown matrix, a layer out of range, or ``k`` outside ``1..rank``.
    """
    W = ffn_matrix(model, layer, matrix)
    with edited_parameters({W: W.detach() - top_singular_part(W, k)}):
        yield


def check_neurons(neurons: Sequence[int], d_mlp: int) -> list[int]:
    """``neurons`` as a list of distinct ints in ``0..d_mlp-1``, else raise ``ValueError``."""
    out = []
    for n in neurons:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"neuron indices must be ints, got {n!r}")
        if not 0 <= n < d_mlp:
            raise ValueError(
                f"neuron {n} is out of range: the FFN has {d_mlp} neurons (0..{d_mlp - 1})"
            )
        out.append(n)
    if not out:
        raise ValueError("give at least one neuron to ablate")
    if len(set(out)) != len(out):
        raise ValueError(f"neuron indices repeat: {out}")
    return out


@contextlib.contextmanager
def neurons_ablated(model: LoadedModel, layer: int, neurons: Sequence[int]) -> Iterator[None]:
    """Within the block, the FFN ``neurons`` of ``layer`` are removed (see module docstring).

    Raises:
        ValueError: a layer or neuron out of range, an empty or repeating neuron list.
    """
    w = model.ffn_weights(layer)
    idx = check_neurons(list(neurons), int(w.gate.shape[0]))
    gate, up, down = w.gate.detach().clone(), w.up.detach().clone(), w.down.detach().clone()
    gate[idx, :] = 0.0
    up[idx, :] = 0.0
    down[:, idx] = 0.0
    with edited_parameters({w.gate: gate, w.up: up, w.down: down}):
        yield
