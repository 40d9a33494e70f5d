"""The down_proj spikes at the massive token, for super-weight detection (Yu et al. 2024).

Per layer and prompt, in one forward: ``down_proj``'s input ``x`` (the FFN's hidden activation,
``mlp.hook_post``) and output ``y`` (``mlp.hook_out``) at the prompt's massive position, their
largest ``|value|`` over the other real tokens, and the residual stream the FFN adds to; and from
them each ``W_down`` entry's write into the residual stream there (:class:`Spikes`), the top writes
(:func:`top_writes`), a weight-only score (:func:`weight_only_scores`) and the shares of the ME
layer's neurons (:func:`me_neuron_shares`).

From those, the detection itself (``me_interp.experiments.super_weight`` states the formulas and
the claims): the super-weight candidates, every weight whose *building* write ``s`` at the massive
token reaches the ``super_weight_spike`` threshold on some prompt, ranked by how often each is a
prompt's top write (:func:`candidates`, :class:`Candidate`, :func:`candidate_at` for a given
weight); Yu et al.'s spike layers, where the median ``max|x|`` and ``max|y|`` both exceed it
(:func:`yu_spike_layers`); and per layer the largest weight-only score and ``|W_down|`` entries
(:func:`weight_only_tops`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from jaxtyping import Float

from me_interp import claims, names
from me_interp.architecture import norm_eps
from me_interp.models import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.batching import Chunk, Prefix, record
from me_interp.probes.norms import top_ratio


class SpikeRecorder:
    """Records, per layer and prompt, ``down_proj``'s input ``x`` (``mlp.hook_post``) and output ``y``
    (``mlp.hook_out``) at the prompt's massive position, and their largest ``|value|`` over the other
    real tokens, and the residual stream ``h`` the FFN adds to (``hook_resid_mid``) at the massive
    position (``probes.batching`` recorder: chunk by chunk, no logits)."""

    def __init__(self, model: LoadedModel, batch: Batch, positions: Sequence[int]) -> None:
        if len(positions) != len(batch):
            raise ValueError(f"{len(positions)} positions for {len(batch)} prompts")
        for b, p in enumerate(positions):
            if not 0 <= int(p) < batch.lengths[b]:
                raise ValueError(f"position {p} is outside prompt {b} ({batch.lengths[b]} tokens)")
        L, B = model.n_layers, len(batch)
        self.model = model
        self.positions = torch.as_tensor([int(p) for p in positions], dtype=torch.long)
        self.x = torch.zeros(L, B, model.d_mlp)
        self.y = torch.zeros(L, B, model.d_model)
        self.h = torch.zeros(L, B, model.d_model)
        self.others_x = torch.zeros(L, B)
        self.others_y = torch.zeros(L, B)

    def hooks(self, chunk: Chunk) -> list:
        pos = self.positions[chunk.rows]
        mask = chunk.batch.attention_mask.bool().clone().cpu()
        mask[torch.arange(len(chunk)), pos] = False  # the other real tokens
        out = []
        for L in range(self.model.n_layers):
            for site, at, others in (
                ("ffn_act", self.x, self.others_x),
                ("ffn_own", self.y, self.others_y),
            ):
                fn = partial(
                    self._record, layer=L, rows=chunk.rows, pos=pos, mask=mask, at=at, others=others
                )
                out.append((names.site(site, L), fn))
            fn = partial(self._record, layer=L, rows=chunk.rows, pos=pos, mask=None, at=self.h)
            out.append((names.resid_mid(L), fn))
        return out

    @staticmethod
    def _record(act, hook, *, layer, rows, pos, mask, at, others=None):
        a = act.detach().float().cpu()  # [n pos d]
        at[layer, rows] = a[torch.arange(len(rows)), pos]
        if others is None:
            return act
        peak = a.abs().amax(-1).masked_fill(~mask[:, : a.shape[1]], 0.0)  # [n pos]
        others[layer, rows] = peak.amax(-1)
        return act


@dataclass(frozen=True)
class Spikes:
    """What :func:`down_proj_spikes` measured (``[layer, prompt, ...]`` tensors, float32, CPU).

    Attributes:
        x: ``down_proj``'s input at each prompt's massive position ``[layer batch d_mlp]``.
        y: its output there ``[layer batch d_model]`` (before any post-FFN norm).
        h: the residual stream the FFN adds to there (``resid_mid``) ``[layer batch d_model]``.
        scale: the signed ``f`` of the module docstring (``g / rms``; 1 without a post-FFN norm)
            ``[layer batch d_model]``.
        others_x, others_y: the largest ``|x|``, ``|y|`` over the other real tokens ``[layer batch]``.
        positions: the massive position of each prompt.
    """

    x: Float[torch.Tensor, "layer batch d_mlp"]
    y: Float[torch.Tensor, "layer batch d_model"]
    h: Float[torch.Tensor, "layer batch d_model"]
    scale: Float[torch.Tensor, "layer batch d_model"]
    others_x: Float[torch.Tensor, "layer batch"]
    others_y: Float[torch.Tensor, "layer batch"]
    positions: tuple[int, ...]

    @property
    def n_layers(self) -> int:
        return int(self.x.shape[0])

    def in_max(self) -> torch.Tensor:
        """``max_c |x_c|`` ``[layer batch]``."""
        return self.x.abs().amax(-1)

    def out_max(self) -> torch.Tensor:
        """``max_r |y_r|`` ``[layer batch]``."""
        return self.y.abs().amax(-1)

    def signed_write(self, model: LoadedModel, layer: int, row: int, col: int) -> torch.Tensor:
        """``w_b = x_{b,col} · W_down[row, col] · f_{b,row}``: what one weight adds to the residual
        stream's dim ``row`` at the massive token, per prompt ``[batch]`` (``s = |w|``)."""
        w = float(model.ffn_weights(layer).down.detach()[row, col])
        return self.x[layer, :, col] * w * self.scale[layer, :, row]

    def write(self, model: LoadedModel, layer: int, row: int, col: int) -> torch.Tensor:
        """``s_b = |x_{b,col} · W_down[row, col] · f_{b,row}|`` of one weight, per prompt ``[batch]``."""
        return self.signed_write(model, layer, row, col).abs()

    def builds(self, model: LoadedModel, layer: int, row: int, col: int) -> torch.Tensor:
        """Per prompt, whether the weight's write makes ``|h_row|`` larger (``|h + w| > |h|``, ``h`` the
        residual stream it is added to): it builds the activation rather than erasing it."""
        w = self.signed_write(model, layer, row, col)
        return w * (2 * self.h[layer, :, row] + w) > 0

    def share(self, model: LoadedModel, layer: int, row: int, col: int) -> torch.Tensor:
        """``x_col · W_down[row, col] / y_row`` per prompt: the weight's share of its output dim."""
        w = float(model.ffn_weights(layer).down.detach()[row, col])
        return self.x[layer, :, col] * w / self.y[layer, :, row]


def post_norm_scale(model: LoadedModel, layer: int, y: torch.Tensor) -> torch.Tensor:
    """``f`` of the module docstring for outputs ``y`` ``[..., d_model]`` of ``layer``'s ``down_proj``:
    ``g / sqrt(mean(y²) + ε)`` with ``g`` the post-FFN norm's effective gain (signed) on a sandwich
    block, else ones."""
    norm = model.post_ffn_norm_module(layer)
    if norm is None:
        return torch.ones_like(y)
    g = model.arch.gain(norm.weight).float().cpu()
    rms = (y.pow(2).mean(-1, keepdim=True) + norm_eps(norm)).sqrt()
    return g / rms


def down_proj_spikes(model: LoadedModel, batch: Batch, positions: Sequence[int]) -> Spikes:
    """``down_proj``'s input and output at ``positions[b]`` of every prompt, in every layer (one
    chunked forward, no logits; module docstring)."""
    rec = SpikeRecorder(model, batch, positions)
    record(model, batch, [rec])
    scale = torch.stack([post_norm_scale(model, L, rec.y[L]) for L in range(model.n_layers)])
    pos = tuple(int(p) for p in positions)
    return Spikes(rec.x, rec.y, rec.h, scale, rec.others_x, rec.others_y, pos)


def top_writes(
    model: LoadedModel, spikes: Spikes, layer: int, k: int
) -> tuple[list[list[tuple]], list[tuple]]:
    """Per prompt, the ``k`` largest *building* writes ``s[r, c]`` of ``layer`` (``|h_r + w| > |h_r|``)
    as ``[(row, col, s), ...]``, and its largest *erasing* write ``(row, col, s)``."""
    W = model.ffn_weights(layer).down.detach().float()
    builds, erases = [], []
    for b in range(spikes.x.shape[1]):
        x = spikes.x[layer, b].to(W.device)
        f = spikes.scale[layer, b].to(W.device)
        h = spikes.h[layer, b].to(W.device)
        w = W * x[None, :] * f[:, None]  # [d_model d_mlp]: signed residual writes
        up = w * (2 * h[:, None] + w) > 0
        s = w.abs()
        n = s.shape[1]
        v, i = s.masked_fill(~up, -1.0).flatten().topk(min(k, s.numel()))
        builds.append([(j // n, j % n, val) for j, val in zip(i.tolist(), v.tolist()) if val >= 0])
        down = s.masked_fill(up, -1.0).flatten()
        j = int(down.argmax())
        erases.append((j // n, j % n, max(float(down[j]), 0.0)))
    return builds, erases


def weight_only_scores(model: LoadedModel, layer: int) -> torch.Tensor:
    """``ω[r, c] = |W_down[r, c]| · ‖W_gate[c] ⊙ g‖ · ‖W_up[c] ⊙ g‖`` (module docstring), float32."""
    w = model.ffn_weights(layer)
    g = model.ffn_norm_gain(layer).float().to(w.down.device)
    gate = (w.gate.detach().float() * g).norm(dim=-1)  # [d_mlp]
    up = (w.up.detach().float() * g).norm(dim=-1)
    return w.down.detach().float().abs() * (gate * up)[None, :]


def me_neuron_shares(model: LoadedModel, spikes: Spikes, layer: int) -> torch.Tensor:
    """Mean over prompts of ``s_n = x_n ⟨W_down[:, n], y⟩ / ‖y‖²`` at ``layer`` ``[d_mlp]`` (shares of
    the massive token's FFN output; they sum to 1 per prompt)."""
    W = model.ffn_weights(layer).down.detach().float().cpu()
    x, y = spikes.x[layer].double(), spikes.y[layer].double()  # [batch d_mlp], [batch d_model]
    proj = y @ W.double()  # [batch d_mlp]: ⟨W[:, n], y⟩
    return (x * proj / y.pow(2).sum(-1, keepdim=True)).mean(0).float()


# ------------------------------------------------------------------------------------------
# super-weight candidates
# ------------------------------------------------------------------------------------------

N_ME_NEURONS = 3
"""How many of the ME layer's top neurons (by share of the massive token's FFN output) a
candidate's column is compared with (the "few neurons" of ``mechanism.few_neurons``)."""


@dataclass(frozen=True)
class Candidate:
    """One super-weight candidate ``W_down[row, col]`` of ``layer`` (0-based).

    Attributes:
        weight: its value.
        write: mean over prompts of its write ``s`` at the massive token.
        write_per_prompt: ``s`` on every prompt.
        share: mean over prompts of ``x_col W_down[row, col] / y_row`` (its share of the super
            activation).
        stability: fraction of prompts on which it is the top candidate.
        in_me_layer: ``layer`` is the ME layer.
        massive_dim: ``row`` is a massive dim of the ME layer.
        me_neuron: ``col`` is one of the ME layer's top neurons (only when ``layer`` is the ME layer).
        abs_rank: how many weights of its matrix are larger in magnitude (0: the largest).
        weight_only_rank: how many weights of its matrix have a larger weight-only score ``ω``.
    """

    layer: int
    row: int
    col: int
    weight: float
    write: float
    write_per_prompt: list[float]
    share: float
    stability: float
    in_me_layer: bool
    massive_dim: bool
    me_neuron: bool
    abs_rank: int
    weight_only_rank: int

    @property
    def coord(self) -> tuple[int, int, int]:
        return (self.layer, self.row, self.col)

    def label(self) -> str:
        return f"layer {self.layer} W_down[{self.row}, {self.col}]"

    def cells(self) -> tuple:
        """The summary-table cells (:data:`CANDIDATE_COLUMNS`)."""
        yes = ("no", "yes")
        return (
            *self.coord,
            self.weight,
            self.write,
            self.share,
            self.stability,
            yes[self.in_me_layer],
            yes[self.massive_dim],
            self.abs_rank,
            self.weight_only_rank,
        )


CANDIDATE_COLUMNS = (
    "layer",
    "row",
    "col",
    "W",
    "write",
    "share",
    "stable",
    "ME",
    "mdim",
    "|W| rk",
    "ω rk",
)
"""The columns of :meth:`Candidate.cells`."""


@dataclass(frozen=True)
class Entry:
    """One entry ``[row, col]`` of a layer's ``W_down`` and a number about it."""

    row: int
    col: int
    value: float


@dataclass(frozen=True)
class Eraser:
    """A layer's commonest largest *erasing* write: ``W_down[row, col]``, its mean ``s``."""

    layer: int
    row: int
    col: int
    write: float


@dataclass(frozen=True)
class YuSpike:
    """One of Yu et al.'s spike layers: its coordinate and the medians of ``max|x|``, ``max|y|``."""

    layer: int
    row: int
    col: int
    in_max: float
    out_max: float


@dataclass(frozen=True)
class WeightOnlyTop:
    """A layer's entry of largest weight-only score ``ω`` and of largest ``|W_down|``."""

    layer: int
    omega: Entry
    abs: Entry


@dataclass(frozen=True)
class MENeurons:
    """The ME layer's top neurons and their shares of the massive token's FFN output."""

    layer: int
    top_neurons: list[int]
    top_shares: list[float]


def _rank(scores: torch.Tensor, row: int, col: int) -> int:
    return int((scores > scores[row, col]).sum())


def candidate_at(
    model: LoadedModel,
    spikes: Spikes,
    coord: Sequence[int],
    me_layer: int,
    massive_dims: Sequence[int],
    me_top: Sequence[int],
    stability: float = 0.0,
) -> Candidate:
    """The :class:`Candidate` record of ``W_down[row, col]`` of ``layer`` (``coord``), measured on
    ``spikes``.

    Raises:
        ValueError: a layer or entry out of range.
    """
    L, r, c = (int(v) for v in coord)
    model.check_layer(L)
    W = model.ffn_weights(L).down.detach()
    if not (0 <= r < W.shape[0] and 0 <= c < W.shape[1]):
        raise ValueError(f"W_down[{r}, {c}] is outside layer {L}'s {tuple(W.shape)} matrix")
    s = spikes.write(model, L, r, c)
    return Candidate(
        layer=L,
        row=r,
        col=c,
        weight=float(W[r, c]),
        write=float(s.mean()),
        write_per_prompt=s.tolist(),
        share=float(spikes.share(model, L, r, c).nan_to_num(0.0).mean()),
        stability=float(stability),
        in_me_layer=L == me_layer,
        massive_dim=r in set(massive_dims),
        me_neuron=L == me_layer and c in set(me_top),
        abs_rank=_rank(W.abs(), r, c),
        weight_only_rank=_rank(weight_only_scores(model, L), r, c),
    )


def candidates(
    model: LoadedModel,
    spikes: Spikes,
    me_layer: int,
    massive_dims: Sequence[int],
    top_k: int = 5,
) -> tuple[list[Candidate], list[tuple[int, int, int] | None], MENeurons, list[Eraser]]:
    """The candidates (building writes ``s`` ≥ ``super_weight_spike`` on some prompt, sorted by
    stability then mean write), each prompt's top candidate (``None`` where no building write
    reaches the threshold), the ME layer's top neurons with their shares, and per layer the
    commonest largest *erasing* write (its mean ``s`` over prompts)."""
    thr = claims.threshold("super_weight_spike")
    B = spikes.x.shape[1]
    tops: list[tuple[float, tuple[int, int, int]] | None] = [None] * B
    coords: set[tuple[int, int, int]] = set()
    erasers = []
    for L in range(spikes.n_layers):
        builds, erases = top_writes(model, spikes, L, top_k)
        r, c = Counter((r, c) for r, c, _ in erases).most_common(1)[0][0]
        erasers.append(Eraser(L, r, c, float(spikes.write(model, L, r, c).mean())))
        for b, entries in enumerate(builds):
            for r, c, s in entries:
                if s < thr:
                    break
                coords.add((L, r, c))
                if tops[b] is None or s > tops[b][0]:
                    tops[b] = (s, (L, r, c))
    top = [None if t is None else t[1] for t in tops]
    shares = me_neuron_shares(model, spikes, me_layer)
    me_top = shares.argsort(descending=True)[:N_ME_NEURONS].tolist()
    counts = Counter(t for t in top if t is not None)
    out = [
        candidate_at(model, spikes, coord, me_layer, massive_dims, me_top, counts[coord] / B)
        for coord in coords
    ]
    out.sort(key=lambda k: (-k.stability, -k.write, k.coord))
    me = MENeurons(me_layer, me_top, [float(shares[n]) for n in me_top])
    return out, top, me, erasers


def yu_spike_layers(spikes: Spikes) -> list[YuSpike]:
    """Yu et al.'s rule: the layers whose median (over prompts) ``max|x|`` and ``max|y|`` at the
    massive token both exceed ``super_weight_spike``, with the coordinate ``(L, argmax|y|, argmax|x|)``
    (the commonest over prompts)."""
    thr = claims.threshold("super_weight_spike")
    ins, outs = spikes.in_max().median(-1).values, spikes.out_max().median(-1).values
    rows = []
    for L in range(spikes.n_layers):
        if ins[L] > thr and outs[L] > thr:
            r = Counter(spikes.y[L].abs().argmax(-1).tolist()).most_common(1)[0][0]
            c = Counter(spikes.x[L].abs().argmax(-1).tolist()).most_common(1)[0][0]
            rows.append(YuSpike(L, r, c, float(ins[L]), float(outs[L])))
    return rows


def largest_writes(model: LoadedModel, spikes: Spikes) -> list[tuple[int, int, int]]:
    """Per layer, the ``(layer, row, col)`` of its largest *building* write at the massive token: the
    entry whose ``s`` (0 on a prompt where it erases) has the largest mean over prompts."""
    out = []
    for L in range(spikes.n_layers):
        W = model.ffn_weights(L).down.detach().float()
        total = torch.zeros_like(W)
        for b in range(spikes.x.shape[1]):
            x, f = spikes.x[L, b].to(W.device), spikes.scale[L, b].to(W.device)
            w = W * x[None, :] * f[:, None]  # [d_model d_mlp]: signed residual writes
            h = spikes.h[L, b].to(W.device)
            total += w.abs().masked_fill(w * (2 * h[:, None] + w) <= 0, 0.0)
        i = int(total.argmax())
        out.append((L, i // W.shape[1], i % W.shape[1]))
    return out


@dataclass(frozen=True)
class LayerCandidate:
    """One layer's top candidate for the super weight, zeroed alone (``super_weight``).

    Attributes:
        layer, row, col: the entry ``W_down[row, col]`` of ``layer``; ``weight`` its value.
        why: ``"largest write"`` (the layer's largest building write at the massive token),
            ``"Yu spike"`` (Yu et al.'s coordinate of a spike layer) or both, joined by ``" + "``.
        check_layer: where its effect on the massive activation is measured, ``max(m, layer)``.
        ratio_zeroed: per prompt, ``R`` at ``check_layer`` with the weight zeroed.
        nll: per text, the NLL sum with the weight zeroed (``None``: not measured; ``super_weight``
            runs the texts for the few candidates that remove most, see its ``text_candidates``).
    """

    layer: int
    row: int
    col: int
    weight: float
    why: str
    check_layer: int
    ratio_zeroed: list[float] = field(default_factory=list)
    nll: list[float] | None = None

    @property
    def coord(self) -> tuple[int, int, int]:
        return (self.layer, self.row, self.col)

    def label(self) -> str:
        return f"layer {self.layer} W_down[{self.row}, {self.col}]"


def layer_candidates(
    model: LoadedModel, spikes: Spikes, yu: Sequence[YuSpike], me_layer: int
) -> list[LayerCandidate]:
    """Every layer's top candidates and why: its largest building write (:func:`largest_writes`)
    and, in a Yu spike layer, Yu et al.'s coordinate (one entry when they coincide); not yet
    zeroed (no ``ratio_zeroed``), checked at ``max(me_layer, layer)``."""
    why = {c: ["largest write"] for c in largest_writes(model, spikes)}
    for d in yu:
        why.setdefault((d.layer, d.row, d.col), []).append("Yu spike")
    return [
        LayerCandidate(
            L,
            r,
            c,
            float(model.ffn_weights(L).down.detach()[r, c]),
            " + ".join(w),
            max(me_layer, L),
        )
        for (L, r, c), w in sorted(why.items())
    ]


def weight_only_tops(model: LoadedModel) -> list[WeightOnlyTop]:
    """Per layer, the entry of largest weight-only score ``ω`` and of largest ``|W_down|``."""
    out = []
    for L in range(model.n_layers):
        omega = weight_only_scores(model, L)
        A = model.ffn_weights(L).down.detach().abs()
        i, j = int(omega.argmax()), int(A.argmax())
        n = omega.shape[1]
        out.append(
            WeightOnlyTop(
                L,
                Entry(i // n, i % n, float(omega.flatten()[i])),
                Entry(j // n, j % n, float(A.flatten()[j])),
            )
        )
    return out


# ------------------------------------------------------------------------------------------
# the random control's weights
# ------------------------------------------------------------------------------------------


def control_pool(
    model: LoadedModel, layer: int, row: int, col: int, size: int
) -> list[tuple[int, int, float]]:
    """The ``size`` largest-magnitude weights of ``layer``'s ``W_down`` other than ``[row, col]``, as
    ``[(row, col, value), ...]`` (every weight at least as large as it is among the first)."""
    W = model.ffn_weights(layer).down.detach()
    A = W.abs().flatten().clone()
    A[row * W.shape[1] + col] = -1.0
    idx = A.topk(min(size, A.numel() - 1)).indices.tolist()
    n = W.shape[1]
    return [(i // n, i % n, float(W.flatten()[i])) for i in idx]


@dataclass(frozen=True)
class Pool:
    """What the random draws came from: ``size`` of the largest other weights of the matrix,
    ``n_at_least`` of them at least as large as the super weight; their ``|W|`` range and the
    super weight's ``|W|``."""

    size: int
    n_at_least: int
    largest: float
    smallest: float
    super_weight: float

    @classmethod
    def of(cls, pool: Sequence[tuple[int, int, float]], weight: float) -> Pool:
        """The record of :func:`control_pool`'s ``pool`` beside the super weight's value."""
        return cls(
            size=len(pool),
            n_at_least=sum(abs(v) >= abs(weight) for _, _, v in pool),
            largest=abs(pool[0][2]) if pool else float("nan"),
            smallest=abs(pool[-1][2]) if pool else float("nan"),
            super_weight=abs(weight),
        )


@dataclass(frozen=True)
class SuperActivation:
    """Per text: its massive token (the largest-norm token at the output of the check layer), the
    position of the largest ``|y_row|`` (where Yu et al.'s restore hook writes) and ``y_row`` at the
    massive token (the value the restore writes back)."""

    positions: list[int]
    yu_positions: list[int]
    values: torch.Tensor


def super_activation(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    row: int,
    check: int,
    prefix: Prefix | None = None,
) -> tuple[SuperActivation, torch.Tensor]:
    """:class:`SuperActivation` of ``down_proj``'s output dim ``row`` in ``layer`` (``mlp.hook_out``)
    on ``batch``, and the unedited logits of the same forward (with ``prefix``, a
    :func:`~me_interp.probes.batching.capture_prefix` of the batch as it is: blocks ``layer..``
    only)."""
    acts = Activations(model, batch, [names.ffn_own(layer), names.resid_post(check)])
    start = 0 if prefix is None else layer
    logits = record(model, batch, [acts], logits=True, prefix=prefix, start=start)
    y = acts[names.ffn_own(layer)][..., row].float().cpu()  # [batch pos]
    norm = acts[names.resid_post(check)].float().norm(dim=-1).cpu()  # [batch pos]
    real = batch.attention_mask.bool().cpu()
    where = norm.masked_fill(~real, -1.0).argmax(-1)  # each text's massive token
    yu = y.abs().masked_fill(~real, -1.0).argmax(-1)  # Yu et al.'s: the largest |y_row|
    return SuperActivation(where.tolist(), yu.tolist(), y[torch.arange(len(batch)), where]), logits


def output_ratio(
    model: LoadedModel, batch: Batch, layer: int, prefix: Prefix | None = None, start: int = 0
) -> list[float]:
    """Per prompt, ``R = max_t ‖h_t‖ / mean_{t≠argmax} ‖h_t‖`` of ``layer``'s output (``resid_post``;
    ``probes.norms.top_ratio``), the forward stopped after ``layer`` (with ``prefix``: blocks
    ``start..layer`` only). What a zeroing leaves at its check layer, for a fraction of a forward."""
    acts = Activations(model, batch, [names.resid_post(layer)])
    record(model, batch, [acts], prefix=prefix, start=start, last_layer=layer)
    norms = acts[names.resid_post(layer)].float().norm(dim=-1).cpu()  # [batch pos]; NaN: padding
    return top_ratio(norms, batch.attention_mask.bool().cpu()).tolist()


def draw(pool: Sequence, k: int, seed: int) -> list:
    """``k`` entries of ``pool`` drawn without replacement with a seeded generator, sorted."""
    if k > len(pool):
        raise ValueError(f"cannot draw {k} of a pool of {len(pool)}")
    gen = torch.Generator().manual_seed(seed)
    return sorted(pool[i] for i in torch.randperm(len(pool), generator=gen)[:k].tolist())


# ------------------------------------------------------------------------------------------
# the survey's column
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SuperWeight:
    """The top super-weight candidate of a model (:class:`Candidate`'s fields)."""

    layer: int
    row: int
    col: int
    weight: float
    write: float
    stability: float
    in_me_layer: bool


@dataclass(frozen=True)
class SuperWeightCell:
    """The survey's super-weight column of one model (``error``: why it could not be measured)."""

    me_layer: int | None = None
    n_prompts: int = 0
    largest_output: float | None = None
    super_weight: SuperWeight | None = None
    error: str | None = None

    def text(self) -> str:
        """One table cell: ``11 [507, 1229] (ME layer; top on 100%)``."""
        if self.error is not None:
            return f"error: {self.error}"
        sw = self.super_weight
        if sw is None:
            return "none" if self.me_layer is not None else ""
        where = "ME layer" if sw.in_me_layer else f"not the ME layer {self.me_layer}"
        return f"{sw.layer} [{sw.row}, {sw.col}] ({where}; top on {sw.stability:.0%})"


def survey(model: LoadedModel, batch: Batch, criterion: Any = None) -> SuperWeightCell:
    """Detection only (no perplexity: two short forwards), for the survey's super-weight column:
    the ME layer and massive positions located on ``batch``, and the top candidate.
    ``super_weight`` is ``None`` when no weight's write reaches the threshold (or there is no
    massive activation)."""
    from me_interp.probes.massive import Criterion
    from me_interp.probes.site import locate

    loc = locate(model, batch, criterion=criterion or Criterion()).location
    if loc.me_layer is None:
        return SuperWeightCell(me_layer=None, n_prompts=len(batch))
    spikes = down_proj_spikes(model, batch, loc.reference_positions)
    cands, _, _, _ = candidates(model, spikes, loc.me_layer, loc.massive_dims)
    top = None
    if cands and cands[0].stability > 0:
        c = cands[0]
        top = SuperWeight(c.layer, c.row, c.col, c.weight, c.write, c.stability, c.in_me_layer)
    return SuperWeightCell(
        me_layer=loc.me_layer,
        n_prompts=len(batch),
        largest_output=float(spikes.out_max().amax()),
        super_weight=top,
    )


__all__ = [
    "CANDIDATE_COLUMNS",
    "N_ME_NEURONS",
    "Candidate",
    "Entry",
    "Eraser",
    "MENeurons",
    "WeightOnlyTop",
    "YuSpike",
    "control_pool",
    "draw",
    "survey",
    "Pool",
    "SpikeRecorder",
    "SuperActivation",
    "SuperWeight",
    "SuperWeightCell",
    "Spikes",
    "LayerCandidate",
    "candidate_at",
    "candidates",
    "largest_writes",
    "layer_candidates",
    "down_proj_spikes",
    "super_activation",
    "output_ratio",
    "me_neuron_shares",
    "post_norm_scale",
    "top_writes",
    "weight_only_scores",
    "weight_only_tops",
    "yu_spike_layers",
]
