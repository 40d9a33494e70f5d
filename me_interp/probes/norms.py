"""Token-wise L2 norms at every site of every layer, in one forward pass.

``scan_norms`` hooks only the sites it needs (no full cache; in length-sorted chunks, see
``probes.batching``; :class:`NormRecorder` shares a forward with other probes) and keeps, per layer:

* ``norms[site, layer, b, t] = ‖h_{l,t}‖₂`` at each site of :data:`me_interp.names.SITES`
  (NaN at padding);
* for the layer output (``resid_post``): the ``top_k`` largest ``|a|`` of each token with their dims,
  and the per-prompt median ``|a|`` over all real tokens and dims (Sun et al.'s reference value);
* the full layer output of one prompt (``keep_prompt``), for token × dimension views.

Everything is computed in fp32 from the activations and stays on the activations' device during the
forward: the hooks write into buffers on that device (no device-to-host copy, so no synchronisation,
inside a hook), and :meth:`NormRecorder.result` moves the buffers to the CPU once, after the forward.

What the scan costs on top of the forward (``benchmarks/bench_me_layer.py``, ``docs/performance.md``):
one hook per hook point and layer (aliases read once; the layer output's norms and statistics in one
hook), no tensor allocated inside a hook (``out=`` into per-chunk buffers and one ``|a|`` scratch;
the CPU median's selection uses numpy temporaries of a few bytes per value), norms
as ``vector_norm(x, dtype=float32)`` (no fp32 copy of a low-precision activation), and the median
selected on the CPU by one histogram of the values' top bits and a partition of the one bucket that
holds it (:func:`_kth_smallest`). What remains is mostly ``torch.topk``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from jaxtyping import Bool, Float, Int

from me_interp import names
from me_interp.loading.inputs import Prompts, as_batch
from me_interp.models import Batch, LoadedModel
from me_interp.probes.batching import Chunk, own_backend, record


@dataclass(frozen=True)
class NormScan:
    """What :func:`scan_norms` measured. Indices are 0-based layers."""

    sites: tuple[str, ...]
    norms: Float[torch.Tensor, "site layer batch pos"]
    top_abs: Float[torch.Tensor, "layer batch pos k"]
    top_dims: Int[torch.Tensor, "layer batch pos k"]
    median_abs: Float[torch.Tensor, "layer batch"]
    mask: Bool[torch.Tensor, "batch pos"]
    kept_prompt: int
    kept_resid: Float[torch.Tensor, "layer kept_pos d_model"]

    def site_norms(self, site: str) -> Float[torch.Tensor, "layer batch pos"]:
        if site not in self.sites:
            raise ValueError(f"site {site!r} was not scanned; scanned: {self.sites}")
        return self.norms[self.sites.index(site)]

    @property
    def n_layers(self) -> int:
        return int(self.norms.shape[1])


class NormRecorder:
    """Records what :class:`NormScan` holds, chunk by chunk (see ``probes.batching``).

    One hook per hook point and layer: sites that are one hook point (``attn_own`` and ``attn_out``
    outside sandwich blocks) are read once, and one hook at the layer output records its norms,
    top-k, median and the kept prompt. The hooks write into buffers allocated once per chunk
    (``out=``, no allocation per hook), copied into the full-batch outputs after the chunk's forward.
    """

    def __init__(
        self,
        model: LoadedModel,
        batch: Batch,
        sites: tuple[str, ...] = names.SITES,
        top_k: int = 16,
        keep_prompt: int = 0,
    ) -> None:
        sites = tuple(dict.fromkeys((*sites, "resid_post")))
        for s in sites:
            if s not in names.NORM_SITES:
                raise ValueError(f"unknown site {s!r}; choose from {names.NORM_SITES}")
        if not 0 <= keep_prompt < len(batch):
            raise ValueError(f"keep_prompt={keep_prompt} out of range for {len(batch)} prompts")
        batch = batch.right_aligned()  # a left-padded batch is recorded right-aligned (record)
        n_layers, (B, T), d = model.n_layers, batch.tokens.shape, model.d_model
        self.model, self.batch, self.sites = model, batch, sites
        self.k = min(top_k, d)
        self.keep_prompt = keep_prompt
        self._shapes = (len(sites), n_layers, B, T, d)
        self._buf: dict[str, torch.Tensor] | None = None  # on the first activation's device
        self._chunk: _ChunkBuffers | None = None  # the last chunk, not yet copied into _buf

    def _buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The full-batch outputs, allocated on ``device`` when the first hook runs."""
        if self._buf is None:
            S, L, B, T, d = self._shapes
            self._buf = {
                "norms": torch.full((S, L, B, T), float("nan"), device=device),
                "top_abs": torch.zeros(L, B, T, self.k, device=device),
                "top_dims": torch.zeros(L, B, T, self.k, dtype=torch.long, device=device),
                "median_abs": torch.zeros(L, B, device=device),
                "kept": torch.zeros(L, T, d, device=device),
            }
        return self._buf

    def hooks(self, chunk: Chunk) -> list:
        self._flush()  # the previous chunk's forward is over
        self._chunk = c = _ChunkBuffers(self, chunk)
        hook_dict = self.model.bridge.hook_dict
        out = []
        for layer in range(self.model.n_layers):
            points: dict[int, tuple[str, list[int]]] = {}  # hook point -> (name, site indices)
            for si, s in enumerate(self.sites):
                name = names.site(s, layer)
                key = id(hook_dict.get(name, name))  # aliases of one hook point: one read
                points.setdefault(key, (name, []))[1].append(si)
            for name, sis in points.values():
                fn = c.resid if "resid_post" in (self.sites[i] for i in sis) else c.norms
                out.append((name, partial(fn, sis=sis, layer=layer)))
        return out

    def _flush(self) -> None:
        """Copy the last chunk's buffers into the full-batch outputs (one copy per output and chunk,
        after the chunk's forward, on the outputs' device)."""
        c, self._chunk = self._chunk, None
        if c is None or c.buf is None:
            return
        buf = c.outputs
        rows, w = c.rows.to(buf["norms"].device), c.width
        buf["norms"][:, :, rows, :w] = c.buf["norms"]
        buf["top_abs"][:, rows, :w] = c.buf["top_abs"]
        buf["top_dims"][:, rows, :w] = c.buf["top_dims"]
        buf["median_abs"][:, rows] = c.buf["median_abs"]

    def result(self, below: NormScan | None = None, start: int = 0) -> NormScan:
        """The measurements, moved to the CPU (one copy per output, after the forward).

        ``below``: the scan of the same batch on the unedited model, whose layers ``< start`` stand
        for this run's when the forward ran blocks ``start..`` only (``probes.batching``)."""
        self._flush()
        buf = {k: v.cpu() for k, v in self._buffers(self.model.device).items()}
        if below is not None and start:
            if below.sites != self.sites or below.norms.shape[1:] != buf["norms"].shape[1:]:
                raise ValueError("the unedited scan has other sites or another batch shape")
            buf["norms"][:, :start] = below.norms[:, :start]
            buf["top_abs"][:start] = below.top_abs[:start]
            buf["top_dims"][:start] = below.top_dims[:start]
            buf["median_abs"][:start] = below.median_abs[:start]
            buf["kept"][:start, : below.kept_resid.shape[1]] = below.kept_resid[:start]
        mask = self.batch.attention_mask.bool().cpu()
        norms = buf["norms"].masked_fill(~mask, float("nan"))
        if not torch.isfinite(norms[:, :, mask]).all():
            raise FloatingPointError(
                "non-finite activations (inf/NaN) in the forward pass: the dtype overflowed "
                f"({self.model.dtype}); use float32 or bfloat16 (fp16 overflows above 65504)"
            )
        return NormScan(
            sites=self.sites,
            norms=norms,
            top_abs=buf["top_abs"],
            top_dims=buf["top_dims"],
            median_abs=buf["median_abs"],
            mask=mask,
            kept_prompt=self.keep_prompt,
            kept_resid=buf["kept"][:, : int(mask[self.keep_prompt].sum())],
        )


class _ChunkBuffers:
    """One chunk's statistics, as its hooks write them: ``norms [site layer n width]``, ``top_abs`` /
    ``top_dims [layer n width k]``, ``median_abs [layer n]``, allocated when the first hook runs, on
    its device, with one fp32 scratch ``|a| [n width d_model]`` per device."""

    def __init__(self, rec: NormRecorder, chunk: Chunk) -> None:
        self.rec, self.rows, self.width = rec, chunk.rows, chunk.width
        self.runs = _equal_runs(chunk.lengths)
        keep = (chunk.rows == rec.keep_prompt).nonzero().flatten().tolist()
        self.keep = keep[0] if keep else None
        self.buf: dict[str, torch.Tensor] | None = None
        self.outputs: dict[str, torch.Tensor] = {}
        self._scratch: dict[torch.device, torch.Tensor] = {}

    def _buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self.buf is None:
            self.outputs = self.rec._buffers(device)
            dev = self.outputs["norms"].device
            S, L, _, _, _ = self.rec._shapes
            n, w, k = len(self.rows), self.width, self.rec.k
            self.buf = {
                "norms": torch.full((S, L, n, w), float("nan"), device=dev),
                "top_abs": torch.zeros(L, n, w, k, device=dev),
                "top_dims": torch.zeros(L, n, w, k, dtype=torch.long, device=dev),
                "median_abs": torch.zeros(L, n, device=dev),
            }
        return self.buf

    def norms(self, x: torch.Tensor, hook, *, sis: list[int], layer: int) -> torch.Tensor:
        buf = (self.buf if self.buf is not None else self._buffers(x.device))["norms"]
        out = buf[sis[0], layer]  # [n width], contiguous
        h = x.detach()
        if out.device == h.device:
            torch.linalg.vector_norm(h, dim=-1, dtype=torch.float32, out=out)
        else:
            out.copy_(torch.linalg.vector_norm(h, dim=-1, dtype=torch.float32))
        for si in sis[1:]:
            buf[si, layer].copy_(out)
        return x

    def resid(self, x: torch.Tensor, hook, *, sis: list[int], layer: int) -> torch.Tensor:
        self.norms(x, hook, sis=sis, layer=layer)
        buf, h = self.buf, x.detach()
        a = self._scratch.get(h.device)
        if a is None or a.shape != h.shape:
            a = self._scratch[h.device] = torch.empty(h.shape, device=h.device)
        if h.dtype == a.dtype:
            torch.abs(h, out=a)  # |a| [n width d_model] in fp32
        else:
            a.copy_(h).abs_()  # exact: the upcast to fp32 commutes with abs
        vals, dims = buf["top_abs"][layer], buf["top_dims"][layer]
        if a.device.type == "cpu" and vals.device == a.device:
            # |a| >= 0 orders as its IEEE-754 bits read as int32 (NaN above inf, as topk puts it):
            # the same top-k, ties in the same order, with cheaper comparisons (0.9 vs 1.3 ms)
            i32 = torch.int32
            torch.topk(a.view(i32), self.rec.k, dim=-1, out=(vals.view(i32), dims))
        elif vals.device == a.device:
            torch.topk(a, self.rec.k, dim=-1, out=(vals, dims))
        else:
            v, i = a.topk(self.rec.k, dim=-1)
            vals.copy_(v)
            dims.copy_(i)
        _medians_into(buf["median_abs"][layer], a, self.runs)
        if self.keep is not None:
            self.outputs["kept"][layer, : self.width].copy_(h[self.keep])
        return x


def _equal_runs(lengths: list[int]) -> list[tuple[int, int, int]]:
    """``(start, stop, length)`` of each run of consecutive rows with the same length."""
    runs: list[tuple[int, int, int]] = []
    for i, n in enumerate(lengths):
        if runs and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], i + 1, n)
        else:
            runs.append((i, i + 1, n))
    return runs


def _medians_into(
    out: Float[torch.Tensor, " n"],
    a: Float[torch.Tensor, "n pos d"],
    runs: list[tuple[int, int, int]],
    use_numpy: bool | None = None,
) -> None:
    """Per row, the (lower) median of ``a >= 0`` over its real tokens and all dims, as
    ``torch.median``, written into ``out``: the ``ceil(N/2)``-th smallest of the row's ``N`` values,
    a selection, so the same element whatever selects it. Rows of one length (``runs``) are selected
    together: on the CPU (``use_numpy`` by default) on the values' bits as int32 (the same order
    for ``a >= 0``) by :func:`_kth_smallest`, about 4x faster than ``torch.kthvalue`` (which copies
    each row and tracks indices); elsewhere by ``torch.kthvalue`` (no host copy)."""
    if use_numpy is None:
        use_numpy = a.device.type == "cpu"
    d = a.shape[-1]
    for i0, i1, n in runs:
        kth = (n * d + 1) // 2 - 1  # 0-based
        if use_numpy:
            bits = a.view(torch.int32).numpy()[i0:i1, :n].reshape(i1 - i0, n * d)  # a view or copy
            out[i0:i1].copy_(torch.from_numpy(_kth_smallest(bits, kth)).view(torch.float32))
        else:
            flat = a[i0:i1, :n].reshape(i1 - i0, n * d)
            out[i0:i1].copy_(flat.kthvalue(kth + 1, dim=-1).values)


_BUCKET_SHIFT = 19
""":func:`_kth_smallest` buckets a value by its bits above bit 19: the sign (0), the 8 exponent bits
and the top 4 mantissa bits, 4,096 buckets of 1/16 of a binade each."""


def _kth_smallest(bits: np.ndarray, kth: int) -> np.ndarray:
    """Per row of the non-negative int32 ``bits [rows n]``, its ``kth`` smallest value (0-based),
    exactly what ``np.partition(bits, kth)[:, kth]`` gives: a histogram of each row's top bits
    (:data:`_BUCKET_SHIFT`) finds the bucket that holds the ``kth`` value and how many values lie in
    the buckets below it; a partition of that one bucket's values (about 1 % of a row of hidden
    states) selects it. On the bundled model's layer outputs (12 prompts of 16 tokens, 9,216 values
    a row) 0.30 ms a layer, against 0.50 ms for partitioning the whole rows in place and 1.4 ms for
    ``torch.kthvalue``: 6 ms less per scan of 30 layers (``benchmarks/bench_me_layer.py``)."""
    rows = bits.shape[0]
    n_buckets = 1 << (31 - _BUCKET_SHIFT)
    bucket = bits >> _BUCKET_SHIFT
    offsets = (np.arange(rows, dtype=np.int32) * n_buckets)[:, None]
    counts = np.bincount((bucket + offsets).ravel(), minlength=rows * n_buckets)
    cum = counts.reshape(rows, n_buckets).cumsum(axis=1)
    which = (cum <= kth).sum(axis=1)  # the first bucket with more than kth values up to it
    out = np.empty(rows, dtype=np.int32)
    for i in range(rows):
        rank = kth - (int(cum[i, which[i] - 1]) if which[i] else 0)
        held = bits[i][bucket[i] == which[i]]
        out[i] = np.partition(held, rank)[rank]
    return out


def scan_norms(
    model: LoadedModel,
    batch: Prompts,
    sites: tuple[str, ...] = names.SITES,
    top_k: int = 16,
    keep_prompt: int = 0,
    extra_hooks: list | None = None,
) -> NormScan:
    """Run ``batch`` once and record per-token norms at ``sites`` of every layer.

    Runs in length-sorted chunks without the unembedding (``probes.batching``) unless
    ``extra_hooks`` are given (they were built for the whole batch).

    A model of another backend (:func:`~me_interp.probes.batching.own_backend`) scans in its own
    traces (``model.scan_norms``: the same :class:`NormScan`).

    Args:
        model: the loaded model.
        batch: a prompt ``str``, a list of prompts or a right-padded
            :class:`~me_interp.models.Batch` (``model.tokenize``).
        sites: any of :data:`me_interp.names.SITES`; ``resid_post`` is always included.
        top_k: how many of the largest ``|a|`` per token of the layer output to keep.
        keep_prompt: which prompt's full layer outputs to keep.
        extra_hooks: more ``(name, fn)`` hooks to run in the same forward (e.g. an intervention).
    """
    batch = as_batch(model, batch)
    if own_backend(model):
        return model.scan_norms(batch, sites, top_k, keep_prompt, extra_hooks)
    rec = NormRecorder(model, batch, sites, top_k, keep_prompt)
    record(model, batch, [rec], fwd_hooks=list(extra_hooks or []))
    return rec.result()


def ratio_to_others(
    norms: Float[torch.Tensor, "... batch pos"],
    mask: Bool[torch.Tensor, "batch pos"],
    ref: Int[torch.Tensor, " batch"],
) -> Float[torch.Tensor, "... batch"]:
    """``‖h_ref‖ / mean_{t≠ref} ‖h_t‖`` per prompt (real tokens only)."""
    B = mask.shape[0]
    idx = torch.arange(B)
    ref_norm = norms[..., idx, ref]
    others = mask.clone()
    others[idx, ref] = False
    n_others = others.sum(-1)
    if (n_others == 0).any():
        bad = int(torch.nonzero(n_others == 0)[0, 0])
        raise ValueError(
            f"prompt {bad} has a single token: norm ratios compare a token with the *other* tokens, "
            "so every prompt needs at least 2 tokens"
        )
    other_mean = torch.where(others, norms, torch.zeros(())).sum(-1) / n_others
    return ref_norm / other_mean


def top_ratio(
    norms: Float[torch.Tensor, "... batch pos"], mask: Bool[torch.Tensor, "batch pos"]
) -> Float[torch.Tensor, "... batch"]:
    """Position-agnostic ratio ``max_t ‖h_t‖ / mean_{t≠argmax} ‖h_t‖`` per prompt."""
    ref_norm = torch.where(mask, norms, torch.full((), -1.0)).max(-1).values
    n_others = mask.sum(-1) - 1
    if (n_others == 0).any():
        raise ValueError(
            "a prompt has a single token: norm ratios need at least 2 tokens per prompt"
        )
    total = torch.where(mask, norms, torch.zeros(())).sum(-1)
    return ref_norm / ((total - ref_norm) / n_others)


def reference_medians(
    scan: NormScan, reference: Sequence[int]
) -> dict[str, tuple[list[float], list[float]]]:
    """Per site of ``scan``, per layer: the median over prompts of the reference token's norm and
    of the other tokens' mean norm (real tokens only)."""
    ref = torch.as_tensor(list(reference))
    idx = torch.arange(len(ref))
    others = scan.mask.clone()
    others[idx, ref] = False
    out = {}
    for s in scan.sites:
        n = scan.site_norms(s)  # [layer batch pos]
        mass = n[:, idx, ref]
        other = torch.where(others, n, torch.zeros(())).sum(-1) / others.sum(-1).clamp(min=1)
        out[s] = (mass.median(-1).values.tolist(), other.median(-1).values.tolist())
    return out
