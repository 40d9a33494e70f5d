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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Bool, Float, Int

from me_interp import names
from me_interp.models import Batch, LoadedModel
from me_interp.probes.batching import Chunk, record


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
    """Records what :class:`NormScan` holds, chunk by chunk (see ``probes.batching``)."""

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
        n_layers, (B, T), d = model.n_layers, batch.tokens.shape, model.d_model
        self.model, self.batch, self.sites = model, batch, sites
        self.k = min(top_k, d)
        self.keep_prompt = keep_prompt
        self._shapes = (len(sites), n_layers, B, T, d)
        self._buf: dict[str, torch.Tensor] | None = None  # on the first activation's device

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
        out = []
        keep = (chunk.rows == self.keep_prompt).nonzero().flatten().tolist()
        # chunk.rows on the buffers' device, copied before the forward (a copy inside a hook syncs)
        on_model = chunk.rows.to(self.model.device)
        rows: dict[torch.device, torch.Tensor] = {on_model.device: on_model}
        for layer in range(self.model.n_layers):
            for si, s in enumerate(self.sites):
                fn = partial(self._norm, si=si, layer=layer, chunk=chunk, rows=rows)
                out.append((names.site(s, layer), fn))
            fn = partial(self._resid, layer=layer, chunk=chunk, keep=keep, rows=rows)
            out.append((names.resid_post(layer), fn))
        return out

    def _rows(self, x: torch.Tensor, chunk: Chunk, rows: dict) -> tuple[dict, torch.Tensor]:
        buf = self._buffers(x.device)
        dev = buf["norms"].device
        if dev not in rows:
            rows[dev] = chunk.rows.to(dev)
        return buf, rows[dev]

    def _norm(self, x: torch.Tensor, hook, *, si: int, layer: int, chunk: Chunk, rows: dict):
        buf, r = self._rows(x, chunk, rows)
        norms = buf["norms"]
        norms[si, layer, r, : chunk.width] = x.detach().float().norm(dim=-1).to(norms.device)
        return x

    def _resid(
        self, x: torch.Tensor, hook, *, layer: int, chunk: Chunk, keep: list[int], rows: dict
    ):
        buf, r = self._rows(x, chunk, rows)
        dev = buf["norms"].device
        a = x.detach().float().abs()  # [n pos d_model]
        vals, dims = a.topk(self.k, dim=-1)
        w = chunk.width
        buf["top_abs"][layer, r, :w] = vals.to(dev)
        buf["top_dims"][layer, r, :w] = dims.to(dev)
        buf["median_abs"][layer, r] = _row_medians(a, chunk.lengths).to(dev)
        if keep:
            buf["kept"][layer, :w] = x.detach()[keep[0]].float().to(dev)
        return x

    def result(self) -> NormScan:
        """The measurements, moved to the CPU (one copy per output, after the forward)."""
        buf = {k: v.cpu() for k, v in self._buffers(self.model.device).items()}
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


def _row_medians(
    a: Float[torch.Tensor, "n pos d"], lengths: list[int]
) -> Float[torch.Tensor, " n"]:
    """Per row, the (lower) median of ``a`` over its real tokens and all dims, as ``torch.median``
    (a selection, ``kthvalue``, instead of the sort of ``nanmedian``)."""
    out = torch.empty(a.shape[0], dtype=a.dtype, device=a.device)
    for i, n in enumerate(lengths):
        flat = a[i, :n].flatten()
        out[i] = flat.kthvalue((flat.numel() + 1) // 2).values
    return out


def scan_norms(
    model: LoadedModel,
    batch: Batch,
    sites: tuple[str, ...] = names.SITES,
    top_k: int = 16,
    keep_prompt: int = 0,
    extra_hooks: list | None = None,
) -> NormScan:
    """Run ``batch`` once and record per-token norms at ``sites`` of every layer.

    Runs in length-sorted chunks without the unembedding (``probes.batching``) unless
    ``extra_hooks`` are given (they were built for the whole batch).

    Args:
        model: the loaded model.
        batch: right-padded prompts (``model.tokenize``).
        sites: any of :data:`me_interp.names.SITES`; ``resid_post`` is always included.
        top_k: how many of the largest ``|a|`` per token of the layer output to keep.
        keep_prompt: which prompt's full layer outputs to keep.
        extra_hooks: more ``(name, fn)`` hooks to run in the same forward (e.g. an intervention).
    """
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
