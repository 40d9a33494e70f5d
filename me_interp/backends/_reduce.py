"""The reductions the nnsight backend runs *inside* a trace, so that only small statistics leave it.

Pure torch, no other import: for a remote trace (NDIF) nnsight ships this module's source with the
request (``nnsight.register``), so it must not import me_interp. Each function is the in-trace
counterpart of one TransformerLens recorder and is tested against it (``tests/test_nnsight_backend.py``):

* :func:`token_norms` — ``‖h_t‖₂`` in fp32 per token (``probes.norms.NormRecorder``);
* :func:`top_abs` — the ``k`` largest ``|a|`` of each token with their dims (same recorder);
* :func:`median_abs` — per prompt, the lower median of ``|a|`` over its real tokens and every dim
  (``torch.median``'s element: the ``ceil(N/2)``-th smallest of ``N``), Sun et al.'s reference;
* :func:`gram` — per prompt, ``G = H Hᵀ`` (float64) of its real token states: the geometry metrics
  (``probes.geometry.gram_metrics``) of any subset of tokens follow from it after the trace;
* :func:`attention_to_keys` — per head, ``mean_{q>k} A[q, k]`` for every key, the entropy over the
  real queries ``q ≥ 1`` and the BOS metric (``probes.attention.AttentionRecorder``);
* :func:`mask_dims` — WeMask's edit of the massive tokens' attention input
  (``interventions.wemask.WeMask.edit``);
* :func:`next_token_nll` — per text, the next-token NLL sum and count (``evaluation.text_nll``).
"""

from __future__ import annotations

import torch


def token_norms(x: torch.Tensor) -> torch.Tensor:
    """``[batch pos d] -> [batch pos]``: ``‖x_t‖₂`` in fp32."""
    return torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float32)


def top_abs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch pos d] -> ([batch pos k], [batch pos k])``: the ``k`` largest ``|a|`` (fp32), dims."""
    v, i = x.detach().float().abs().topk(k, dim=-1)
    return v, i


def median_abs(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """``[batch pos d] -> [batch]``: per row, the ``ceil(N/2)``-th smallest ``|a|`` of its
    ``N = n·d`` values over its ``n = lengths[b]`` real tokens (the lower median)."""
    a = x.detach().float().abs()
    d = a.shape[-1]
    out = []
    for b, n in enumerate(lengths):
        flat = a[b, :n].reshape(-1)
        out.append(flat.kthvalue((n * d + 1) // 2).values)
    return torch.stack(out)


def gram(x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Per row ``b``, ``H_b H_bᵀ`` (float64, ``[n_b n_b]``) of its ``n_b`` real token states."""
    out = []
    for b, n in enumerate(lengths):
        h = x[b, :n].detach().double()
        out.append(h @ h.T)
    return out


def attention_to_keys(
    pattern: torch.Tensor, qmask: torch.Tensor, bosq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pattern [batch head q k]`` with the real queries ``q ≥ 1`` (``qmask [batch q]``) and the BOS
    metric's queries (``bosq [batch q]``: the second half) to ``(to_key [batch head k], entropy
    [batch head], bos [batch head])``: ``to_key[k] = mean_{q>k, q real} A[q, k]`` (NaN where no real
    query follows ``k``), ``entropy = mean_q −Σ_k A log A`` (nats) and ``bos = mean_q A[q, 0]``."""
    a = pattern.detach().float()
    T = a.shape[-1]
    qmask, bosq = qmask.to(a.device), bosq.to(a.device)
    later = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)  # [q k]: q > k
    after = (qmask[:, :, None] & later).to(a.dtype)  # [batch q k]
    to_key = torch.einsum("bhqk,bqk->bhk", a, after) / after.sum(1)[:, None, :]
    qm = qmask[:, None, :].to(a.dtype)  # [batch 1 q]
    ent = -(a * torch.log(a.clamp_min(1e-30))).sum(-1)  # [batch head q]
    entropy = (ent * qm).sum(-1) / qm.sum(-1)
    bq = bosq[:, None, :].to(a.dtype)
    bos = (a[..., 0] * bq).sum(-1) / bq.sum(-1)
    return to_key, entropy, bos


def mask_dims(
    h: torch.Tensor,
    resid: torch.Tensor,
    target: torch.Tensor,
    variant: str,
    k: int,
    fixed: torch.Tensor | None,
) -> torch.Tensor:
    """WeMask on the target tokens (``target [batch pos]``) of the attention input ``h [batch pos
    d]``: zero ``fixed`` (``weight``/``random``: one dim set, given) or, from the activations, the top ``k``
    dims of the mean ``|h|`` over the targets (``activation``, one set for the batch), of each target's
    ``|h|`` (``activation_per_prompt``) or of its residual ``|resid|`` (``magnitude``). Returns a new
    tensor; ``h`` is not modified."""
    out = h.clone()
    if not bool(target.any()):
        return out
    sel = out[target]  # [n d]
    if fixed is not None:  # weight, random: one dim set for every target
        dims = fixed.to(sel.device).expand(sel.shape[0], fixed.shape[-1])
    elif variant == "activation":
        mean_abs = sel.detach().float().abs().mean(0)
        dims = mean_abs.topk(k).indices.sort().values.expand(sel.shape[0], k)
    elif variant == "magnitude":
        dims = resid[target].detach().float().abs().topk(k, dim=-1).indices
    else:  # activation_per_prompt
        dims = sel.detach().float().abs().topk(k, dim=-1).indices
    sel = sel.scatter(-1, dims, torch.zeros(dims.shape, dtype=sel.dtype, device=sel.device))
    out[target] = sel
    return out


def next_token_nll(
    logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum over its real next-token predictions (positions ``t`` with ``t+1`` real) of
    ``−log p(x_{t+1} | x_{≤t})`` (float64), and their count."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    tgt = tokens[:, 1:].to(logp.device)
    nll = -logp.gather(-1, tgt[..., None])[..., 0]  # [batch pos-1]
    m = mask.to(logp.device).bool()
    valid = m[:, 1:] & m[:, :-1]
    zero = torch.zeros((), dtype=torch.float64, device=logp.device)
    return torch.where(valid, nll.double(), zero).sum(-1), valid.sum(-1)


def scan_layers(
    layers,
    n_layers: int,
    k: int,
    lengths: list[int],
    layout: tuple[str, str, str, str],
    attention: tuple[torch.Tensor, torch.Tensor] | None = None,
    grams: bool = False,
    first: bool = False,
) -> list[dict]:
    """Inside a trace over a pre-norm decoder (``layers``: nnsight's envoys of the HF decoder layers;
    ``layout``: the HF names, within a layer, of its pre-attention norm, attention, pre-FFN norm and
    FFN, from the model's ``Architecture``): read every layer in forward order and keep, per layer,
    the token norms at the seven sites of ``me_interp.names.SITES`` (``norms [7 batch pos]``), the
    layer output's top-``k`` ``|a|`` and dims and per-prompt median ``|a|``; with ``attention =
    (qmask, bosq)`` the attention statistics of :func:`attention_to_keys` (``None`` where the model
    returns no attention weights); with ``grams`` the Gram matrix of each prompt's layer outputs;
    with ``first`` the sum over prompts of the attention input at position 0 (``[d]``). Nothing else
    leaves the trace."""
    attn_norm, attn_name, ffn_norm, ffn_name = layout
    out = []
    for i in range(n_layers):
        layer = layers[i]
        resid_pre = layer.input  # the block input
        attn_in = getattr(layer, attn_norm).output
        attn = getattr(layer, attn_name).output  # (attn_output, attn_weights)
        attn_out = attn[0]
        stats = {}
        if attention is not None:
            w = attn[1]
            stats["attention"] = None if w is None else attention_to_keys(w, *attention)
        if first:
            stats["first"] = attn_in[:, 0].detach().float().sum(0)
        ffn_in = getattr(layer, ffn_norm).output
        ffn_out = getattr(layer, ffn_name).output
        resid_post = layer.output
        if isinstance(resid_post, tuple):  # older transformers: (hidden_states, ...)
            resid_post = resid_post[0]
        resid_mid = resid_pre + attn_out  # hook_resid_mid: x' = x + Attn(RMSNorm_attn(x))
        sites = (resid_pre, attn_in, attn_out, resid_mid, ffn_in, ffn_out, resid_post)
        stats["norms"] = torch.stack([token_norms(s) for s in sites])
        stats["top_abs"], stats["top_dims"] = top_abs(resid_post, k)
        stats["median_abs"] = median_abs(resid_post, lengths)
        if grams:
            stats["grams"] = gram(resid_post, lengths)
        out.append(stats)
    return out
