"""Batched activation patching: many (layer, position) patches in one forward, one patch per batch row.

Activation patching (ROME; ARENA) runs a *corrupt* input, overwrites one activation with its value from
the *clean* run, and measures how much of the clean behaviour comes back. Here the behaviour is the
massive activation and the sink it causes, so the metrics read activations, not logits:

* :class:`NormRatio` — ``R = ‖h_p‖ / mean_{t≠p} ‖h_t‖`` at ``blocks.L.hook_resid_post`` (the massive
  token ``p`` against the other real tokens of its prompt);
* :class:`SinkMass` — ``S = mean_{l∈layers} mean_{h} mean_{q>p} A^{(l,h)}[q, p]``, the attention mass on
  ``p`` (queries after ``p`` only: earlier queries cannot see it);
* :class:`Projection` — ``P = ⟨h_p, u⟩`` at ``blocks.L.hook_resid_post`` for a fixed unit direction
  ``u`` (e.g. the clean massive direction): *signed*, so a write against ``u`` (one that erases the
  massive activation) lowers it, where a norm would rise.

The normalised score of a patch is ARENA's ``(m_patched − m_corrupt) / (m_clean − m_corrupt)`` on the
prompt-mean metric: 1 = the patch restores the clean value, 0 = it does nothing.

**Batching.** For one site (``resid_pre``, ``attn_out``, ``mlp_out``/``ffn_out``, ``ffn_in``, ...) every
cell ``(layer, pos)`` becomes ``B`` rows of one big batch (``B`` = number of prompts): row
``c·B + b`` is prompt ``b`` of the corrupt input with cell ``c`` patched. One hook per layer copies the
clean activation of prompt ``b`` at ``pos_c`` into exactly the rows whose cell has that layer, so a
chunk of ``batch_size`` rows is one forward instead of ``batch_size / B`` forwards. The results equal
``transformer_lens.patching.generic_activation_patch`` on the same inputs (tests/test_patching.py).

Corruption hooks (``corrupt_hooks``) run in the corrupt and in every patched forward, before the patch
hooks, so patching the corrupted site itself from the clean run undoes the corruption. They see
batches of ``n·B`` rows (``n`` copies of the ``B`` corrupt prompts), so they must be row-wise or tile
per-prompt values that way: the hooks of :mod:`me_interp.interventions.causal` do both
(``per_prompt=False`` / ``True``).
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float

from me_interp import names, terminal
from me_interp.models import Batch, LoadedModel
from me_interp.probes.norms import ratio_to_others

#: Environment variable: when set (not ``""``/``"0"``), a ``skip_shared`` sweep that cannot run the
#: block suffix raises instead of warning and falling back to full forwards (tests set it).
STRICT_ENV = "ME_INTERP_STRICT"

#: Sites a sweep can patch; ``mlp_out`` is TransformerLens' name for ``ffn_out``.
PATCH_SITES: tuple[str, ...] = (*names.SITES, "mlp_out")


def site_hook(site: str, layer: int) -> str:
    """Hook name of a patchable ``site`` of block ``layer`` (``mlp_out`` = ``ffn_out``)."""
    if site not in PATCH_SITES:
        raise ValueError(f"unknown patching site {site!r}; choose from {', '.join(PATCH_SITES)}")
    return names.site("ffn_out" if site == "mlp_out" else site, layer)


# ------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------


@runtime_checkable
class PatchMetric(Protocol):
    """A row-wise metric read from recorded activations.

    ``hook_names()`` are the activations it needs; ``__call__(acts, mask)`` returns one value per row.
    """

    def hook_names(self) -> tuple[str, ...]: ...

    def __call__(
        self, acts: Mapping[str, torch.Tensor], mask: Bool[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, " batch"]: ...


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


def _record(x: torch.Tensor, hook, *, store: dict, key: str):
    store[key] = x.detach()
    return x


def evaluate_metrics(
    model: LoadedModel,
    batch: Batch,
    metrics: Mapping[str, PatchMetric],
    fwd_hooks: Sequence = (),
    stop_at_layer: int | None = None,
) -> dict[str, Float[torch.Tensor, " batch"]]:
    """One forward of ``batch`` with ``fwd_hooks``; every metric per prompt.

    ``stop_at_layer``: run only blocks ``0 .. stop_at_layer − 1`` (no unembedding); it must cover
    every block a metric (and any recording hook in ``fwd_hooks``) reads.
    """
    store: dict[str, torch.Tensor] = {}
    rec = [(n, partial(_record, store=store, key=n)) for n in _metric_hooks(metrics)]
    kwargs = {} if stop_at_layer is None else {"stop_at_layer": int(stop_at_layer)}
    model.run_with_hooks(batch, [*fwd_hooks, *rec], **kwargs)
    mask = batch.attention_mask.bool()
    return {k: m(store, mask).float() for k, m in metrics.items()}


def _metric_hooks(metrics: Mapping[str, PatchMetric]) -> list[str]:
    return list(dict.fromkeys(n for m in metrics.values() for n in m.hook_names()))


def _hook_layer(name: str) -> int:
    """Block index of a ``blocks.L....`` hook name."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
        raise ValueError(f"metric hook {name!r} is not inside a block")
    return int(parts[1])


def normalized(patched: torch.Tensor, clean: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """ARENA normalisation ``(patched − corrupt) / (clean − corrupt)`` (clean → 1, corrupt → 0).

    ``clean`` and ``corrupt`` are scalars (prompt means); NaN where they coincide.
    """
    denom = float(clean) - float(corrupt)
    if denom == 0 or not math.isfinite(denom):
        return torch.full_like(patched, float("nan"))
    return (patched - float(corrupt)) / denom


# ------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------


@dataclass
class SweepResult:
    """Per-prompt metric values of a patching sweep over one site.

    ``values[metric]`` is ``[layer, pos, batch]`` in the order of ``layers`` and ``positions``;
    ``clean`` / ``corrupt`` are the unpatched runs' ``[batch]`` values. ``to_dict()`` keeps them all
    (``per_prompt``), so intervals can be bootstrapped over prompts from a saved result.
    ``prefix_fallback`` says why a ``skip_shared`` sweep fell back to full forwards (``None`` when it
    did not, or did not try).
    """

    site: str
    layers: list[int]
    positions: list[int]
    values: dict[str, torch.Tensor]
    clean: dict[str, torch.Tensor]
    corrupt: dict[str, torch.Tensor]
    n_forwards: int = 0
    batch_size: int = 0
    metric_names: list[str] = field(default_factory=list)
    prefix_skipped: bool = False
    prefix_fallback: str | None = None

    def mean(self, metric: str) -> Float[torch.Tensor, "layer pos"]:
        return self.values[metric].mean(-1)

    def normalized(self, metric: str) -> Float[torch.Tensor, "layer pos"]:
        """``(mean patched − mean corrupt) / (mean clean − mean corrupt)`` per cell."""
        return normalized(self.mean(metric), self.clean[metric].mean(), self.corrupt[metric].mean())

    def cell(self, metric: str, layer: int, pos: int, normalise: bool = True) -> float:
        li, pi = self.layers.index(layer), self.positions.index(pos)
        grid = self.normalized(metric) if normalise else self.mean(metric)
        return float(grid[li, pi])

    def cell_values(self, metric: str, layer: int, pos: int) -> Float[torch.Tensor, " batch"]:
        """Per-prompt metric values of the run with cell ``(layer, pos)`` patched."""
        return self.values[metric][self.layers.index(layer), self.positions.index(pos)]

    def to_dict(self) -> dict:
        return {
            "site": self.site,
            "layers": self.layers,
            "positions": self.positions,
            "clean_mean": {k: float(v.mean()) for k, v in self.clean.items()},
            "corrupt_mean": {k: float(v.mean()) for k, v in self.corrupt.items()},
            "normalized": {k: self.normalized(k).tolist() for k in self.values},
            "mean": {k: self.mean(k).tolist() for k in self.values},
            "n_forwards": self.n_forwards,
            "batch_size": self.batch_size,
            "prefix_skipped": self.prefix_skipped,
            "prefix_fallback": self.prefix_fallback,
            "per_prompt": {
                "clean": {k: v.tolist() for k, v in self.clean.items()},
                "corrupt": {k: v.tolist() for k, v in self.corrupt.items()},
                "patched": {k: v.tolist() for k, v in self.values.items()},
            },
        }


def _capture_block_inputs(model: LoadedModel, batch: Batch, hooks: Sequence, layers: Sequence[int]):
    """One forward of ``batch``: the keyword arguments each block receives (masks, rotary
    embeddings), per block — Gemma 2/3 give sliding-window and global layers their own mask and
    rotary embedding — and the residual stream entering each of ``layers``."""
    got: dict[int, dict] = {}

    def pre(module, args, kwargs, *, i):
        got.setdefault(i, kwargs)

    store: dict[str, torch.Tensor] = {}
    rec = [(names.resid_pre(x), partial(_record, store=store, key=str(x))) for x in set(layers)]
    handles = [
        block.register_forward_pre_hook(partial(pre, i=i), with_kwargs=True)
        for i, block in enumerate(model.bridge.blocks)
    ]
    try:
        model.run_with_hooks(batch, [*hooks, *rec])
    finally:
        for h in handles:
            h.remove()
    drop = ("cache", "past_key_value", "past_key_values", "use_cache", "cache_position")
    kwargs = {i: {k: v for k, v in kw.items() if k not in drop} for i, kw in got.items()}
    return kwargs, {int(k): v for k, v in store.items()}


def _tile(v, n: int, B: int):
    """Repeat the batch dimension of block kwargs ``n`` times (row ``c·B + b`` = prompt ``b``)."""
    if torch.is_tensor(v):
        return v.repeat(n, *([1] * (v.dim() - 1))) if v.dim() and v.shape[0] == B else v
    if isinstance(v, tuple):
        return tuple(_tile(x, n, B) for x in v)
    return v


def _tile_kwargs(kwargs: Mapping[int, Mapping], n: int, B: int) -> dict[int, dict]:
    """:func:`_tile` every block's kwargs; a value shared by several blocks is tiled once."""
    memo: dict[int, Any] = {}
    out = {}
    for i, kw in kwargs.items():
        out[i] = {}
        for k, v in kw.items():
            if id(v) not in memo:
                memo[id(v)] = (v, _tile(v, n, B))  # keep v alive so its id stays unique
            out[i][k] = memo[id(v)][1]
    return out


def _run_blocks(
    model: LoadedModel, resid: torch.Tensor, start: int, stop: int, kwargs: Mapping, hooks
):
    """Run blocks ``start..stop`` (inclusive) on ``resid`` with ``hooks`` and each block's own
    captured ``kwargs[i]``; earlier blocks skipped."""
    with torch.no_grad(), model.bridge.hooks(fwd_hooks=list(hooks)):
        h = resid
        for i in range(start, stop + 1):
            out = model.bridge.blocks[i](h, **kwargs[i])
            h = out[0] if isinstance(out, tuple) else out
    return h


def strict() -> bool:
    """Whether a fallback to full forwards raises (:data:`STRICT_ENV` set to anything but ``""`` or
    ``"0"``; the test suite sets it) instead of warning."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def _check_suffix(
    model: LoadedModel,
    resid_in: Mapping[int, torch.Tensor],
    first: int,
    last: int,
    kwargs: Mapping,
    corrupt_hooks: Sequence,
    want: Mapping[str, torch.Tensor],
) -> str | None:
    """Run blocks ``first..last`` from the corrupt run's residual stream and compare the metric
    activations with the full corrupt forward's (``want``). ``None`` when they agree, else why not:
    a warning, or (:func:`strict`) a ``RuntimeError``."""
    got: dict[str, torch.Tensor] = {}
    rec = [(n, partial(_record, store=got, key=n)) for n in want if _hook_layer(n) >= first]
    why = None
    try:
        _run_blocks(model, resid_in[first], first, last, kwargs, [*corrupt_hooks, *rec])
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        why = f"running blocks {first}..{last} directly failed: {type(e).__name__}: {e}"
        err: BaseException | None = e
    else:
        err = None
        for n, _ in rec:
            a, b = got[n].float(), want[n].float()
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                why = (
                    f"running blocks {first}..{last} directly gave {n} up to "
                    f"{float((a - b).abs().max()):.3g} away from the full corrupt forward"
                )
                break
    if why is None:
        return None
    msg = f"patch_sweep falls back to full forwards (slower, same values): {why}"
    if strict():
        raise RuntimeError(f"{msg} [{STRICT_ENV} is set]") from err
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return why


def _patch(x: torch.Tensor, hook, *, rows, pos, src):
    x = x.clone()
    x[rows, pos] = src.to(device=x.device, dtype=x.dtype)
    return x


def _check_pair(clean: Batch, corrupt: Batch) -> None:
    if clean.tokens.shape != corrupt.tokens.shape:
        raise ValueError(
            f"clean and corrupt batches must have the same shape, got {tuple(clean.tokens.shape)} "
            f"and {tuple(corrupt.tokens.shape)}: corrupt prompts must have the clean token length"
        )
    if not torch.equal(clean.attention_mask, corrupt.attention_mask):
        raise ValueError("clean and corrupt batches must have the same attention mask (lengths)")


def patch_sweep(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    site: str,
    metrics: Mapping[str, PatchMetric],
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    batch_size: int = 64,
    corrupt_hooks: Sequence = (),
    clean_hooks: Sequence = (),
    progress: bool | None = None,
    skip_shared: bool = True,
) -> SweepResult:
    """Patch ``site`` from the clean run into the corrupt run at every ``(layer, pos)``, batched.

    Args:
        model: the loaded model.
        clean: clean prompts.
        corrupt: corrupt prompts, same shape and attention mask as ``clean``.
        site: one of :data:`PATCH_SITES`.
        metrics: name → :class:`PatchMetric` (e.g. :class:`NormRatio`, :class:`SinkMass`).
        layers: layers to patch (default all).
        positions: positions to patch (default all).
        batch_size: at most this many rows (patched prompts) per forward (at least one cell).
        corrupt_hooks: row-wise hooks that define the corruption (run before the patch hooks).
        clean_hooks: hooks of the clean run.
        progress: ``False``: no progress bar; else a tqdm bar on stderr when it is a terminal (off
            in quiet mode, :func:`me_interp.terminal.bar`).
        skip_shared: run only what a patch can change. A cell whose clean activation equals the
            corrupt one for every prompt (bit for bit: e.g. every layer upstream of a hook-based
            corruption, or the unchanged tokens at layer 0) and a cell after the last layer a metric
            reads cannot change the corrupt run, so its value is the corrupt value and it is not run.
            Each chunk (cells sorted by layer) runs only the blocks from its first patched layer to
            the last layer a metric reads, starting from the corrupt run's residual stream (the
            blocks are called directly with the masks and rotary embeddings captured from the
            corrupt run; checked once against the full corrupt forward, else full forwards are
            used with a ``RuntimeWarning`` — ``SweepResult.prefix_skipped`` says which and
            ``prefix_fallback`` why; with :data:`STRICT_ENV` set the fallback raises). Metric activations before the first
            patched layer are the corrupt run's. (TransformerBridge's own ``start_at_layer`` runs
            the earlier blocks anyway in TL 4.3, so it is not used.) ``False``: every cell, full
            forwards (the plain reference).

    Raises:
        ValueError: unknown site, layer/position out of range, mismatched batches, no metric.
        RuntimeError: the block suffix cannot be run while :data:`STRICT_ENV` is set.
    """
    _check_pair(clean, corrupt)
    if not metrics:
        raise ValueError("give at least one metric")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    B, T = clean.tokens.shape
    layers = list(range(model.n_layers)) if layers is None else [int(x) for x in layers]
    positions = list(range(T)) if positions is None else [int(p) for p in positions]
    if not layers or not positions:
        raise ValueError("nothing to patch: layers and positions must not be empty")
    for layer in layers:
        model.check_layer(layer)
    for p in positions:
        if not 0 <= p < T:
            raise ValueError(f"position {p} out of range for prompts of {T} tokens")
    hook_of = {layer: site_hook(site, layer) for layer in layers}

    mhooks = _metric_hooks(metrics)
    last_needed = max(_hook_layer(n) for n in mhooks)
    stop = max(last_needed, *layers) + 1  # the unpatched runs need no unembedding
    # clean run: the site's activations at every patched layer, and the clean metrics
    store: dict[str, torch.Tensor] = {}
    rec = [(n, partial(_record, store=store, key=n)) for n in dict.fromkeys(hook_of.values())]
    clean_vals = evaluate_metrics(model, clean, metrics, [*clean_hooks, *rec], stop)
    clean_acts = {layer: store[hook_of[layer]].clone() for layer in layers}  # [B T ...]
    # corrupt run: the metrics, and the site's activations (to find cells where clean == corrupt)
    cstore: dict[str, torch.Tensor] = {}
    cstore_m: dict[str, torch.Tensor] = {}
    rec = [(n, partial(_record, store=cstore, key=n)) for n in dict.fromkeys(hook_of.values())]
    rec += [(n, partial(_record, store=cstore_m, key=n)) for n in mhooks]
    corrupt_vals = evaluate_metrics(model, corrupt, metrics, [*corrupt_hooks, *rec], stop)

    out = {k: v[None, None].repeat(len(layers), len(positions), 1) for k, v in corrupt_vals.items()}

    def changes(li: int, pi: int) -> bool:
        layer, p = layers[li], positions[pi]
        same = torch.equal(clean_acts[layer][:, p], cstore[hook_of[layer]][:, p])
        return layer <= last_needed and not same

    cells = [
        c
        for c in itertools.product(range(len(layers)), range(len(positions)))
        if not skip_shared or changes(*c)
    ]
    cells.sort(key=lambda c: layers[c[0]])  # layer-major: each chunk starts as late as possible
    per_fwd = max(1, batch_size // B)
    n_fwd = 0
    suffix = None
    fallback: str | None = None
    if skip_shared and cells:
        # run only blocks first_patched..last_needed, from the corrupt run's residual stream; checked
        # once against the full corrupt forward, else fall back to full forwards
        kwargs, resid_in = _capture_block_inputs(
            model, corrupt, corrupt_hooks, sorted({layers[li] for li, _ in cells})
        )
        fallback = _check_suffix(
            model, resid_in, layers[cells[0][0]], last_needed, kwargs, corrupt_hooks, cstore_m
        )
        suffix = (kwargs, resid_in) if fallback is None else None
    chunks = range(0, len(cells), per_fwd)
    bar = terminal.bar(chunks, desc=f"patching {site}") if progress is not False else chunks
    for start in bar:
        chunk = cells[start : start + per_fwd]
        n = len(chunk)
        rows_batch = Batch(corrupt.tokens.repeat(n, 1), corrupt.attention_mask.repeat(n, 1), None)
        patch_hooks = []
        for li in sorted({li for li, _ in chunk}):
            idx = [c for c, (cl, _) in enumerate(chunk) if cl == li]
            rows = torch.tensor([c * B + b for c in idx for b in range(B)])
            pos = torch.tensor([positions[chunk[c][1]] for c in idx for _ in range(B)])
            prompt = torch.arange(B).repeat(len(idx))
            src = clean_acts[layers[li]][
                prompt.to(clean.tokens.device), pos.to(clean.tokens.device)
            ]
            patch_hooks.append((hook_of[layers[li]], partial(_patch, rows=rows, pos=pos, src=src)))
        acts: dict[str, torch.Tensor] = {}
        first = min(layers[li] for li, _ in chunk) if suffix is not None else 0
        for n_ in mhooks:  # read before the first patched layer: the corrupt run's, exactly
            if _hook_layer(n_) < first:
                acts[n_] = cstore_m[n_].repeat(n, *([1] * (cstore_m[n_].dim() - 1)))
        rec = [
            (n_, partial(_record, store=acts, key=n_)) for n_ in mhooks if _hook_layer(n_) >= first
        ]
        hooks = [*corrupt_hooks, *patch_hooks, *rec]
        if suffix is not None:
            kwargs, resid_in = suffix
            _run_blocks(
                model,
                _tile(resid_in[first], n, B),
                first,
                last_needed,
                _tile_kwargs(kwargs, n, B),
                hooks,
            )
        else:
            with torch.no_grad():
                model.bridge.run_with_hooks(
                    rows_batch.tokens,
                    attention_mask=rows_batch.attention_mask,
                    stop_at_layer=last_needed + 1 if skip_shared else None,
                    fwd_hooks=hooks,
                )
        n_fwd += 1
        mask = rows_batch.attention_mask.bool()
        for k, m in metrics.items():
            v = m(acts, mask).float().view(n, B)
            for c, (li, pi) in enumerate(chunk):
                out[k][li, pi] = v[c]
    return SweepResult(
        site=site,
        layers=layers,
        positions=positions,
        values=out,
        clean=clean_vals,
        corrupt=corrupt_vals,
        n_forwards=n_fwd,
        batch_size=per_fwd * B,
        metric_names=list(metrics),
        prefix_skipped=suffix is not None,
        prefix_fallback=fallback,
    )


def patch_loop(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    site: str,
    metrics: Mapping[str, PatchMetric],
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    corrupt_hooks: Sequence = (),
) -> SweepResult:
    """The unbatched reference: one forward per ``(layer, pos)`` cell (for tests and benchmarks)."""
    return patch_sweep(
        model,
        clean,
        corrupt,
        site,
        metrics,
        layers,
        positions,
        batch_size=1,
        corrupt_hooks=corrupt_hooks,
        progress=False,
        skip_shared=False,
    )


__all__ = [
    "PATCH_SITES",
    "STRICT_ENV",
    "NormRatio",
    "PatchMetric",
    "Projection",
    "SinkMass",
    "SweepResult",
    "evaluate_metrics",
    "normalized",
    "patch_loop",
    "patch_sweep",
    "site_hook",
    "strict",
]
