"""Token-wise L2 norms at every site of every layer, in one forward pass.

``scan_norms`` hooks only the sites it needs (a names filter, not a full cache) and keeps, per layer:

* ``norms[site, layer, b, t] = ‖h_{l,t}‖₂`` at each site of :data:`me_interp.names.SITES`
  (NaN at padding);
* for the layer output (``resid_post``): the ``top_k`` largest ``|a|`` of each token with their dims,
  and the per-prompt median ``|a|`` over all real tokens and dims (Sun et al.'s reference value);
* the full layer output of one prompt (``keep_prompt``), for token × dimension views.

Everything is computed in fp32 from the activations, on the activations' device, then moved to CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Bool, Float, Int

from me_interp import names
from me_interp.models import Batch, LoadedModel


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


def _record_norm(x: torch.Tensor, hook, *, out: torch.Tensor, si: int, layer: int):
    out[si, layer] = x.detach().float().norm(dim=-1).cpu()
    return x


def _record_resid(
    x: torch.Tensor,
    hook,
    *,
    scan: dict,
    layer: int,
    mask: torch.Tensor,
    k: int,
    keep: int,
):
    a = x.detach().float().abs()  # [batch pos d_model]
    vals, dims = a.topk(k, dim=-1)
    scan["top_abs"][layer] = vals.cpu()
    scan["top_dims"][layer] = dims.cpu()
    flat = a.masked_fill(~mask[..., None], float("nan")).flatten(1)  # [batch pos*d_model]
    scan["median_abs"][layer] = flat.nanmedian(dim=1).values.cpu()
    scan["kept"][layer] = x.detach()[keep].float().cpu()
    return x


def scan_norms(
    model: LoadedModel,
    batch: Batch,
    sites: tuple[str, ...] = names.SITES,
    top_k: int = 16,
    keep_prompt: int = 0,
    extra_hooks: list | None = None,
) -> NormScan:
    """Run ``batch`` once and record per-token norms at ``sites`` of every layer.

    Args:
        model: the loaded model.
        batch: right-padded prompts (``model.tokenize``).
        sites: any of :data:`me_interp.names.SITES`; ``resid_post`` is always included.
        top_k: how many of the largest ``|a|`` per token of the layer output to keep.
        keep_prompt: which prompt's full layer outputs to keep.
        extra_hooks: more ``(name, fn)`` hooks to run in the same forward (e.g. an intervention).
    """
    sites = tuple(dict.fromkeys((*sites, "resid_post")))
    for s in sites:
        if s not in names.SITES:
            raise ValueError(f"unknown site {s!r}; choose from {names.SITES}")
    if not 0 <= keep_prompt < len(batch):
        raise ValueError(f"keep_prompt={keep_prompt} out of range for {len(batch)} prompts")
    n_layers, (B, T), d = model.n_layers, batch.tokens.shape, model.d_model
    k = min(top_k, d)
    mask = batch.attention_mask.bool()
    norms = torch.full((len(sites), n_layers, B, T), float("nan"))
    scan = {
        "top_abs": torch.zeros(n_layers, B, T, k),
        "top_dims": torch.zeros(n_layers, B, T, k, dtype=torch.long),
        "median_abs": torch.zeros(n_layers, B),
        "kept": torch.zeros(n_layers, T, d),
    }
    hooks = []
    for layer in range(n_layers):
        for si, s in enumerate(sites):
            hooks.append(
                (names.site(s, layer), partial(_record_norm, out=norms, si=si, layer=layer))
            )
        hooks.append(
            (
                names.resid_post(layer),
                partial(
                    _record_resid,
                    scan=scan,
                    layer=layer,
                    mask=mask.to(model.device),
                    k=k,
                    keep=keep_prompt,
                ),
            )
        )
    model.run_with_hooks(batch, hooks + list(extra_hooks or []))
    cpu_mask = mask.cpu()
    norms = norms.masked_fill(~cpu_mask, float("nan"))
    if not torch.isfinite(norms[:, :, cpu_mask]).all():
        raise FloatingPointError(
            "non-finite activations (inf/NaN) in the forward pass: the dtype overflowed "
            f"({model.dtype}); use float32 or bfloat16 (fp16 overflows above 65504)"
        )
    return NormScan(
        sites=sites,
        norms=norms,
        top_abs=scan["top_abs"],
        top_dims=scan["top_dims"],
        median_abs=scan["median_abs"],
        mask=cpu_mask,
        kept_prompt=keep_prompt,
        kept_resid=scan["kept"][:, : int(cpu_mask[keep_prompt].sum())],
    )


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
