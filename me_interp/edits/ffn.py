"""Edits of a gated FFN ``FFN(h) = W_down( σ(W_gate h) ⊙ W_up h )`` (paper.md §1, §3).

* :func:`svd_ablated` removes the top-``k`` singular directions of one matrix:
  with ``W = U diag(s) Vᵀ`` (``s`` descending), ``W ← W − Σ_{i<k} s_i u_i v_iᵀ`` — the best rank-``k``
  part is taken out, the remaining ``rank − k`` directions are untouched.
* :func:`directions_removed` removes any set ``S`` of singular directions, from an :class:`SVD`
  computed once per matrix: ``W ← W − Σ_{i∈S} s_i u_i v_iᵀ`` (for ``S = {0..k−1}`` the edit of
  :func:`svd_ablated`; other sets are the random controls of ``ffn_svd_ablation``), optionally
  scaled: ``W ← W − β Σ_{i∈S} s_i u_i v_iᵀ``, with :func:`energy_matched` giving the ``β`` whose
  removed energy ``β² Σ_{i∈S} s_i²`` equals that of the top ``k`` (``Σ_{i<k} s_i²``);
  :func:`direction_plan` lists the top-``k`` removals and such energy-matched random draws.
* :func:`neurons_ablated` removes whole neurons ``n``: ``W_gate[n,:] = W_up[n,:] = 0`` and
  ``W_down[:,n] = 0``, so the neuron's activation and its write to the residual stream are exactly 0.
* :func:`down_weights_zeroed` sets single entries ``W_down[r, c] = 0`` of any layers (Yu et al.'s
  super weight, ``super_weight``).

Matrices are named ``"gate"``, ``"up"``, ``"down"`` (HF ``(out, in)`` layout, via
:meth:`LoadedModel.ffn_weights`). Every edit restores the weights on exit, also after an exception.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class SVD:
    """``W = U diag(s) Vᵀ`` of one FFN matrix (float64, ``s`` descending), computed once and reused
    by every :func:`directions_removed` of that matrix."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor

    @classmethod
    def of(cls, W: torch.Tensor) -> SVD:
        U, S, Vh = torch.linalg.svd(W.detach().double(), full_matrices=False)
        return cls(U, S, Vh)

    @property
    def rank(self) -> int:
        return int(self.S.numel())

    def part(self, directions: Sequence[int], scale: float = 1.0) -> torch.Tensor:
        """``scale · Σ_{i∈directions} s_i u_i v_iᵀ`` (float64)."""
        idx = torch.as_tensor(list(directions), dtype=torch.long)
        return (self.U[:, idx] * (scale * self.S[idx])) @ self.Vh[idx]

    def energy(self, directions: Sequence[int]) -> float:
        """``Σ_{i∈directions} s_i²``: the squared Frobenius norm of their part."""
        return float(self.S[list(directions)].pow(2).sum())


def energy_matched(svd: SVD, k: int, directions: Sequence[int]) -> float:
    """``β = sqrt(Σ_{i<k} s_i² / Σ_{i∈directions} s_i²)``: the scale at which removing
    ``directions`` (:func:`directions_removed` with ``scale=β``) changes ``W`` by as much Frobenius
    energy as removing the top ``k`` (``‖ΔW‖_F² = Σ_{i<k} s_i²``). With ``s`` descending a set of
    ``k`` other directions carries less energy than the top ``k``, so ``β ≥ 1``: their components
    are subtracted ``β`` times, not only removed (NaN when they carry no energy)."""
    other = svd.energy(directions)
    return math.sqrt(svd.energy(range(k)) / other) if other > 0 else math.nan


@contextlib.contextmanager
def directions_removed(
    W: torch.nn.Parameter, svd: SVD, directions: Sequence[int], scale: float = 1.0
) -> Iterator[None]:
    """Within the block, ``W ← W − scale · Σ_{i∈directions} s_i u_i v_iᵀ`` (``svd`` of ``W``);
    restored on exit, also after an exception (:func:`~me_interp.edits.core.edited_parameters`).

    Raises:
        ValueError: a direction outside ``0..rank−1``, a repeated one, or a scale that is not finite.
    """
    d = list(directions)
    if not d or min(d) < 0 or max(d) >= svd.rank or len(set(d)) != len(d):
        raise ValueError(f"directions must be distinct ints in 0..{svd.rank - 1}, got {d}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    with edited_parameters({W: W.detach() - svd.part(d, scale).to(W.dtype)}):
        yield


def random_others(n_total: int, exclude: Sequence[int], k: int, seed: int) -> list[int]:
    """``k`` distinct indices of ``0..n_total−1`` outside ``exclude`` (directions, neurons), drawn
    with a seeded generator, sorted."""
    skip = set(exclude)
    pool = torch.tensor([i for i in range(n_total) if i not in skip])
    if k > len(pool):
        raise ValueError(f"cannot draw {k} of the {len(pool)} indices left")
    gen = torch.Generator().manual_seed(seed)
    return sorted(pool[torch.randperm(len(pool), generator=gen)[:k]].tolist())


@dataclass(frozen=True)
class Directions:
    """One removal of singular directions (:func:`directions_removed`): which, at what ``scale``
    ``β``, the energy it takes out of ``W`` (``‖ΔW‖_F² = β² Σ s_i²``) and a random draw's ``seed``
    (``None``: the top ``k``)."""

    directions: list[int]
    scale: float
    energy: float
    seed: int | None = None


def direction_plan(
    svd: SVD, ks: Sequence[int], k: int, n_random: int, seed: int
) -> list[Directions]:
    """The removals of ``ffn_svd_ablation``: the top ``j`` directions for every ``j`` of ``ks``, then
    ``n_random`` draws (seeds ``seed, seed+1, …``) of ``k`` other directions
    (:func:`random_others`) scaled to the top ``k``'s energy (:func:`energy_matched`)."""
    out = [Directions(list(range(j)), 1.0, svd.energy(range(j))) for j in ks]
    for s in range(seed, seed + n_random):
        d = random_others(svd.rank, range(k), k, s)
        beta = energy_matched(svd, k, d)
        out.append(Directions(d, beta, beta**2 * svd.energy(d), s))
    return out


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


@contextlib.contextmanager
def down_weights_zeroed(
    model: LoadedModel, entries: Sequence[tuple[int, int, int]]
) -> Iterator[None]:
    """Within the block, ``W_down[row, col]`` of ``layer`` is 0 for every ``(layer, row, col)`` of
    ``entries``; restored exactly on exit, also after an exception
    (:func:`~me_interp.edits.core.edited_parameters`).

    Raises:
        ValueError: an entry out of range, or no entry.
    """
    if not entries:
        raise ValueError("give at least one (layer, row, col) to zero")
    new: dict[torch.nn.Parameter, torch.Tensor] = {}
    for L, r, c in entries:
        W = model.ffn_weights(L).down
        if not (0 <= r < W.shape[0] and 0 <= c < W.shape[1]):
            raise ValueError(f"W_down[{r}, {c}] is outside layer {L}'s {tuple(W.shape)} matrix")
        value = new.setdefault(W, W.detach().clone())
        value[r, c] = 0.0
    with edited_parameters(new):
        yield
