"""Per-layer norms from the TransformerLens hooks against an independent HF computation."""

from __future__ import annotations

import pytest
import torch

from me_interp import names, synthetic
from me_interp.probes.batching import chunks, record
from me_interp.probes.norms import NormRecorder, ratio_to_others, scan_norms, top_ratio


def _hf_reference(model, batch):
    """Norms at every site from plain HF forward hooks and output_hidden_states (no TL involved)."""
    hf = model.hf
    layers = [model.block_module(i) for i in range(model.n_layers)]
    got: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep(key):
        def fn(mod, args, out):
            t = out[0] if isinstance(out, tuple) else out
            got[key] = t.detach().float()

        return fn

    for i, layer in enumerate(layers):
        handles.append(model.attn_norm_module(i).register_forward_hook(keep(("attn_in", i))))
        handles.append(model.ffn_norm_module(i).register_forward_hook(keep(("ffn_in", i))))
        handles.append(layer.mlp.register_forward_hook(keep(("ffn_out", i))))
        handles.append(layer.self_attn.register_forward_hook(keep(("attn_out", i))))
    try:
        with torch.no_grad():
            out = hf(
                input_ids=batch.tokens,
                attention_mask=batch.attention_mask,
                output_hidden_states=True,
            )
    finally:
        for h in handles:
            h.remove()
    hs = [h.float() for h in out.hidden_states]
    ref = {}
    for i in range(model.n_layers):
        ref[("resid_pre", i)] = hs[i]
        ref[("resid_mid", i)] = hs[i] + got[("attn_out", i)]
        for s in ("attn_in", "ffn_in", "ffn_out", "attn_out"):
            ref[(s, i)] = got[(s, i)]
        if i < model.n_layers - 1:  # HF's last hidden state is after the final norm
            ref[("resid_post", i)] = hs[i + 1]
    # the last layer's output, independently: mid + ffn_out
    last = model.n_layers - 1
    ref[("resid_post", last)] = ref[("resid_mid", last)] + got[("ffn_out", last)]
    return {k: v.norm(dim=-1) for k, v in ref.items()}


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "planted"])
def test_norms_match_hf(fixture, request, planted_prompts):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    batch = model.tokenize(planted_prompts)
    scan = scan_norms(model, batch)
    ref = _hf_reference(model, batch)
    mask = batch.attention_mask.bool()
    for (site, layer), r in ref.items():
        got = scan.site_norms(site)[layer]
        torch.testing.assert_close(got[mask], r[mask], rtol=1e-5, atol=1e-5, msg=f"{site} {layer}")
        assert torch.isnan(got[~mask]).all()


def test_norms_match_hf_on_bundled(bundled):
    batch = bundled.tokenize(["The capital of France is Paris.", "def f(x):\n    return x"])
    scan = scan_norms(bundled, batch)
    ref = _hf_reference(bundled, batch)
    mask = batch.attention_mask.bool()
    for (site, layer), r in ref.items():
        torch.testing.assert_close(
            scan.site_norms(site)[layer][mask], r[mask], rtol=1e-4, atol=1e-3, msg=f"{site} {layer}"
        )


def test_padded_rows_equal_unpadded_runs(planted):
    model, _ = planted
    prompts = ["w1 w2 w3 w4 w5 w6", "w9 w8", "w20 w21 w22 w23"]
    batched = scan_norms(model, model.tokenize(prompts))
    for i, p in enumerate(prompts):
        alone = scan_norms(model, model.tokenize([p]))
        n = alone.mask.shape[1]
        torch.testing.assert_close(
            batched.norms[:, :, i, :n], alone.norms[:, :, 0], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            batched.median_abs[:, i], alone.median_abs[:, 0], rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(
            batched.top_abs[:, i, :n], alone.top_abs[:, 0], rtol=1e-5, atol=1e-5
        )


def test_top_values_and_median_match_direct_computation(planted, planted_prompts):
    model, _ = planted
    batch = model.tokenize(planted_prompts)
    store = {}

    def keep(x, hook, layer):
        store[layer] = x.detach().clone()
        return x

    from functools import partial

    model.run_with_hooks(
        batch, [(names.resid_post(i), partial(keep, layer=i)) for i in range(model.n_layers)]
    )
    scan = scan_norms(model, batch, top_k=4, keep_prompt=1)
    for layer, x in store.items():
        a = x.abs()
        for b in range(len(batch)):
            n = batch.lengths[b]
            vals = a[b, :n].flatten()
            assert torch.isclose(
                scan.median_abs[layer, b], vals.median(), rtol=1e-6
            ) or torch.isclose(scan.median_abs[layer, b], vals.sort().values[(len(vals) - 1) // 2])
            torch.testing.assert_close(scan.top_abs[layer, b, :n, 0], a[b, :n].max(-1).values)
        torch.testing.assert_close(scan.kept_resid[layer], x[1, : batch.lengths[1]])


def test_ratio_helpers_against_hand_computation():
    norms = torch.tensor([[3.0, 1.0, 2.0, 7.0], [1.0, 9.0, 1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    r = ratio_to_others(norms, mask, torch.tensor([0, 1]))
    torch.testing.assert_close(r, torch.tensor([3.0 / (10.0 / 3), 9.0 / 1.0]))
    t = top_ratio(norms, mask)
    torch.testing.assert_close(t, torch.tensor([7.0 / 2.0, 9.0]))
    # a metric of a token against identical tokens is 1
    same = torch.ones(1, 5)
    assert float(top_ratio(same, same.bool())) == 1.0


def test_single_token_prompt_is_a_clear_error():
    norms = torch.tensor([[3.0, float("nan")]])
    mask = torch.tensor([[1, 0]]).bool()
    with pytest.raises(ValueError, match="single token"):
        ratio_to_others(norms, mask, torch.tensor([0]))
    with pytest.raises(ValueError, match="single token"):
        top_ratio(norms, mask)


def test_unknown_site_and_keep_prompt(planted):
    model, _ = planted
    batch = model.tokenize(["w1 w2"])
    with pytest.raises(ValueError, match="unknown site"):
        scan_norms(model, batch, sites=("nope",))
    with pytest.raises(ValueError, match="keep_prompt"):
        scan_norms(model, batch, keep_prompt=3)


def test_fp16_overflow_is_detected():
    from me_interp import load_model

    model = load_model("synthetic:planted", dtype="float16", device="cpu")
    # scale the planted neuron far past fp16's range
    with torch.no_grad():
        model.ffn_weights(2).down[7, 5] = 60000.0
    with pytest.raises(FloatingPointError, match="fp16"):
        scan_norms(model, model.tokenize(["w1 w2 w3"]))


# -- where the statistics live during the forward ------------------------------------------


def _row_medians(a, lengths):
    """Per row, the lower median of ``a`` over its real tokens and all dims, one ``kthvalue`` per
    row (the recorder's computation before it selected with numpy: the reference)."""
    out = torch.empty(a.shape[0], dtype=a.dtype, device=a.device)
    for i, n in enumerate(lengths):
        flat = a[i, :n].flatten()
        out[i] = flat.kthvalue((flat.numel() + 1) // 2).values
    return out


class _PerHookCPURecorder:
    """The recorder as it was before the statistics stayed on the device: every hook computes the
    same statistics and copies them to CPU buffers at once (the reference for bit-identity)."""

    def __init__(self, model, batch, sites=names.SITES, top_k=16, keep_prompt=0):
        self.median = _row_medians
        self.sites = tuple(dict.fromkeys((*sites, "resid_post")))
        L, (B, T), d = model.n_layers, batch.tokens.shape, model.d_model
        self.model, self.k, self.keep_prompt = model, min(top_k, d), keep_prompt
        self.norms = torch.full((len(self.sites), L, B, T), float("nan"))
        self.top_abs = torch.zeros(L, B, T, self.k)
        self.top_dims = torch.zeros(L, B, T, self.k, dtype=torch.long)
        self.median_abs = torch.zeros(L, B)
        self.kept = torch.zeros(L, T, d)

    def hooks(self, chunk):
        from functools import partial

        keep = (chunk.rows == self.keep_prompt).nonzero().flatten().tolist()
        out = []
        for layer in range(self.model.n_layers):
            for si, s in enumerate(self.sites):
                out.append((names.site(s, layer), partial(self._norm, si=si, l=layer, c=chunk)))
            out.append((names.resid_post(layer), partial(self._resid, l=layer, c=chunk, keep=keep)))
        return out

    def _norm(self, x, hook, *, si, l, c):  # noqa: E741
        self.norms[si, l, c.rows, : c.width] = x.detach().float().norm(dim=-1).cpu()
        return x

    def _resid(self, x, hook, *, l, c, keep):  # noqa: E741
        a = x.detach().float().abs()
        vals, dims = a.topk(self.k, dim=-1)
        self.top_abs[l, c.rows, : c.width] = vals.cpu()
        self.top_dims[l, c.rows, : c.width] = dims.cpu()
        self.median_abs[l, c.rows] = self.median(a, c.lengths).cpu()
        if keep:
            self.kept[l, : c.width] = x.detach()[keep[0]].float().cpu()
        return x


@pytest.mark.parametrize("max_tokens", [1024, 7])
def test_scan_is_bit_identical_to_per_hook_copies(planted, max_tokens):
    """Keeping the statistics on the device changes no value: the same bits as copying each to the
    CPU inside its hook (padded prompts; one chunk, and many chunks of 1–3 rows)."""
    from me_interp.probes.batching import record
    from me_interp.probes.norms import NormRecorder

    model, _ = planted
    batch = model.tokenize(["w1 w2 w3 w4 w5 w6", "w9 w8", "w20 w21 w22 w23", "w7"])
    new = NormRecorder(model, batch, top_k=4, keep_prompt=2)
    ref = _PerHookCPURecorder(model, batch, top_k=4, keep_prompt=2)
    record(model, batch, [new], max_tokens=max_tokens)
    record(model, batch, [ref], max_tokens=max_tokens)
    got = new.result()
    mask = batch.attention_mask.bool()
    want = ref.norms.masked_fill(~mask, float("nan"))
    assert torch.equal(got.norms.isnan(), want.isnan()) and torch.equal(
        got.norms[:, :, mask], want[:, :, mask]
    )
    assert torch.equal(got.top_abs, ref.top_abs) and torch.equal(got.top_dims, ref.top_dims)
    assert torch.equal(got.median_abs, ref.median_abs)
    assert torch.equal(got.kept_resid, ref.kept[:, : batch.lengths[2]])
    assert all(t.device.type == "cpu" for t in (got.norms, got.top_abs, got.kept_resid))


def _count_host_copies(monkeypatch, model, fn) -> int:
    """How many ``Tensor.cpu/item/tolist/numpy`` calls (each one a device sync on an accelerator)
    ``fn()`` makes inside ``model``'s forward passes (hooks included, hook set-up not). ``numpy()``
    of a CPU tensor is a view, no copy (the CPU median selects with numpy; on an accelerator
    ``numpy()`` raises instead), so only ``numpy()`` of other tensors counts."""
    calls, active = [0], [False]
    for meth in ("cpu", "item", "tolist", "numpy"):
        real = getattr(torch.Tensor, meth)

        def counted(self, *a, _real=real, _meth=meth, **k):
            calls[0] += active[0] and not (_meth == "numpy" and self.device.type == "cpu")
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, meth, counted)
    forward = model.run_with_hooks

    def counting_forward(*a, **k):
        active[0] = True
        try:
            return forward(*a, **k)
        finally:
            active[0] = False

    monkeypatch.setattr(model, "run_with_hooks", counting_forward)
    try:
        fn()
    finally:
        monkeypatch.undo()
    return calls[0]


def test_hooks_copy_nothing_to_the_host_during_the_forward(planted, monkeypatch):
    """The hooks add no device-to-host copy to the forward (before: 8 per layer); the result is
    moved to the CPU once, after the forward, by ``result()``."""
    from me_interp.probes.batching import record
    from me_interp.probes.norms import NormRecorder

    model, _ = planted
    batch = model.tokenize(["w1 w2 w3 w4 w5", "w9 w8 w7"])

    class Nothing:
        def hooks(self, chunk):
            return []

    rec = NormRecorder(model, batch)
    plain = _count_host_copies(monkeypatch, model, lambda: record(model, batch, [Nothing()]))
    scan = _count_host_copies(monkeypatch, model, lambda: record(model, batch, [rec]))
    assert scan == plain, f"the norm hooks made {scan - plain} host copies inside the forward"
    res = rec.result()
    assert res.norms.device.type == "cpu" and torch.isfinite(res.norms[:, :, res.mask]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_scan_adds_no_synchronisation_and_matches_cpu(planted, planted_prompts):
    """On a GPU: the hooks add no synchronising call to the forward (CUDA sync debug mode counts
    them), the outputs come back on the CPU, and they match the CPU scan."""
    import warnings

    from me_interp import load_model
    from me_interp.probes.batching import record
    from me_interp.probes.norms import NormRecorder

    cpu_model, _ = planted
    model = load_model(cpu_model, device="cuda", dtype="float32")
    batch = model.tokenize(planted_prompts)

    class Nothing:
        def hooks(self, chunk):
            return []

    def syncs(recorders) -> int:
        record(model, batch, recorders)  # warm-up (lazy CUDA init, cuBLAS handles)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                record(model, batch, recorders)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    plain = syncs([Nothing()])
    rec = NormRecorder(model, batch)
    assert syncs([rec]) == plain
    got = rec.result()
    want = scan_norms(cpu_model, cpu_model.tokenize(planted_prompts))
    assert got.norms.device.type == "cpu"
    torch.testing.assert_close(got.norms, want.norms, equal_nan=True, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.median_abs, want.median_abs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.top_abs, want.top_abs, rtol=1e-4, atol=1e-4)


# -- the recorder against run_with_cache and hand-computed statistics ------------------------


def _cache_reference(model, batch, sites, top_k, keep_prompt):
    """Every statistic of a scan from ``run_with_cache`` (one unchunked forward, full activations)
    and plain torch: norms by ``float().norm``, top-k by ``topk``, medians by a full sort."""
    with torch.no_grad():
        _, cache = model.bridge.run_with_cache(batch.tokens, attention_mask=batch.attention_mask)
    L, k = model.n_layers, min(top_k, model.d_model)
    norms = torch.stack(
        [
            torch.stack([cache[names.site(s, i)].float().norm(dim=-1) for i in range(L)])
            for s in sites
        ]
    )
    post = torch.stack([cache[names.resid_post(i)].float() for i in range(L)])  # [L B T d]
    top_abs, top_dims = post.abs().topk(k, dim=-1)
    median = torch.empty(L, len(batch))
    for b, n in enumerate(batch.lengths):
        vals = post[:, b, :n].abs().reshape(L, -1).sort(dim=-1).values
        median[:, b] = vals[:, (vals.shape[1] - 1) // 2]  # the lower median, as torch.median
    kept = post[:, keep_prompt, : batch.lengths[keep_prompt]]
    return norms, top_abs, top_dims, median, kept


def _assert_scan_equals_reference(got, ref, batch, exact: bool):
    norms, top_abs, top_dims, median, kept = ref
    mask = batch.attention_mask.bool()
    real = got.norms[:, :, mask]
    assert torch.isnan(got.norms[:, :, ~mask]).all()
    if exact:
        assert torch.equal(real, norms[:, :, mask])
        assert torch.equal(got.top_abs[:, mask], top_abs[:, mask])
        assert torch.equal(got.top_dims[:, mask], top_dims[:, mask])
        assert torch.equal(got.median_abs, median)
        assert torch.equal(got.kept_resid, kept)
    else:  # another chunking: other matmul shapes, the same values to rounding
        tol = {"rtol": 1e-6, "atol": 1e-6}
        torch.testing.assert_close(real, norms[:, :, mask], **tol)
        torch.testing.assert_close(got.top_abs[:, mask], top_abs[:, mask], **tol)
        torch.testing.assert_close(got.median_abs, median, **tol)
        torch.testing.assert_close(got.kept_resid, kept, **tol)


_PADDED = ["w1 w2 w3 w4 w5 w6", "w9 w8", "w20 w21 w22 w23", "w7", "w3 w5 w7 w9 w11 w13"]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "planted"])
def test_recorder_equals_run_with_cache_and_hand_statistics(fixture, request):
    """The recorder (one hook per hook point, ``out=`` buffers, numpy medians) against
    ``run_with_cache`` + hand-computed norms, top-k and medians: bit-identical on the same
    (unchunked) forward, within 1e-6 when chunked (padded prompts of 1-6 words)."""
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    batch = model.tokenize(_PADDED)
    sites = names.NORM_SITES
    ref = _cache_reference(model, batch, sites, top_k=4, keep_prompt=2)
    one = NormRecorder(model, batch, sites, top_k=4, keep_prompt=2)
    record(model, batch, [one], fwd_hooks=[(names.resid_pre(0), lambda x, hook: x)])  # unchunked
    _assert_scan_equals_reference(one.result(), ref, batch, exact=True)
    for max_tokens in (1024, 7):
        chunked = NormRecorder(model, batch, sites, top_k=4, keep_prompt=2)
        record(model, batch, [chunked], max_tokens=max_tokens)
        _assert_scan_equals_reference(chunked.result(), ref, batch, exact=False)


@pytest.mark.parametrize("arch", synthetic.ARCHS)
def test_recorder_equals_run_with_cache_on_every_architecture(arch):
    """Every architecture's planted model, all norm sites (the sub-layers' own outputs are the
    residual contributions' hook points outside sandwich blocks, and are read once there)."""
    from me_interp import load_model

    hf, tok, _ = synthetic.planted(arch)
    model = load_model(hf, tokenizer=tok, device="cpu")
    batch = model.tokenize(_PADDED)
    ref = _cache_reference(model, batch, names.NORM_SITES, top_k=16, keep_prompt=0)
    rec = NormRecorder(model, batch, names.NORM_SITES)
    record(model, batch, [rec], fwd_hooks=[(names.resid_pre(0), lambda x, hook: x)])
    _assert_scan_equals_reference(rec.result(), ref, batch, exact=True)
    got = scan_norms(model, batch, names.NORM_SITES)
    _assert_scan_equals_reference(got, ref, batch, exact=False)
    # one hook per hook point and layer (sandwich blocks: the own outputs are hook points of their own)
    own_apart = arch in ("gemma2", "gemma3")
    hooks = NormRecorder(model, batch, names.NORM_SITES).hooks(chunks(batch)[0])
    assert len(hooks) == model.n_layers * (9 if own_apart else 7)


def test_recorder_in_bfloat16_equals_the_fp32_upcast_reference():
    """bf16 activations: norms by ``vector_norm(dtype=float32)`` and ``|a|`` by an upcast copy give
    what ``x.float()`` then the fp32 statistics give (within 1e-6; bit-identical here)."""
    from me_interp import load_model

    model = load_model("synthetic:planted", dtype="bfloat16", device="cpu")
    batch = model.tokenize(_PADDED)
    ref = _cache_reference(model, batch, names.SITES, top_k=16, keep_prompt=1)
    rec = NormRecorder(model, batch, names.SITES, keep_prompt=1)
    record(model, batch, [rec], fwd_hooks=[(names.resid_pre(0), lambda x, hook: x)])
    got = rec.result()
    mask = batch.attention_mask.bool()
    torch.testing.assert_close(got.norms[:, :, mask], ref[0][:, :, mask], rtol=1e-6, atol=0)
    assert torch.equal(got.top_abs[:, mask], ref[1][:, mask])
    assert torch.equal(got.median_abs, ref[3]) and torch.equal(got.kept_resid, ref[4])


@pytest.mark.parametrize("use_numpy", [True, False])
def test_medians_numpy_and_torch_select_the_lower_median(use_numpy):
    """Both selections (numpy's on the CPU, ``kthvalue`` elsewhere) give the sort's lower median,
    with ties, an even count, padding beyond each row's length and runs of equal lengths."""
    from me_interp.probes.norms import _equal_runs, _medians_into

    g = torch.Generator().manual_seed(0)
    lengths = [1, 3, 3, 5, 5, 5, 2]
    a = torch.randint(0, 7, (len(lengths), 5, 4), generator=g).float()  # many ties
    a[0, 1:] = 1e9  # padding: never selected
    want = torch.stack(
        [a[i, :n].flatten().sort().values[(n * 4 - 1) // 2] for i, n in enumerate(lengths)]
    )
    assert want[0] == a[0, 0].sort().values[1]
    out = torch.full((len(lengths),), float("nan"))
    runs = _equal_runs(lengths)
    assert runs == [(0, 1, 1), (1, 3, 3), (3, 6, 5), (6, 7, 2)]
    _medians_into(out, a.clone(), runs, use_numpy=use_numpy)
    assert torch.equal(out, want)
    x = torch.randn(3, 8, 16, generator=g)  # distinct values, odd and even counts
    out3 = torch.empty(3)
    _medians_into(out3, x.abs(), _equal_runs([8, 7, 7]), use_numpy=use_numpy)
    for i, n in enumerate([8, 7, 7]):
        assert out3[i] == x[i, :n].abs().flatten().median()


def test_kth_smallest_equals_a_full_partition():
    """The histogram-then-bucket selection picks what ``np.partition`` of the whole row picks, for
    every rank: values spread over many binades (hidden states, one massive token), all in one
    bucket, ties, zeros, subnormals, ``inf`` and NaN (above ``inf`` as int32), one value a row."""
    import numpy as np

    from me_interp.probes.norms import _kth_smallest

    rng = np.random.default_rng(0)
    spread = np.abs(rng.standard_normal((5, 600)) * np.exp(2 * rng.standard_normal((5, 600))))
    spread[:, :20] *= 1e4  # the massive token's dims
    one_bucket = 1.0 + rng.random((3, 257)) / 64  # within 1/16 of a binade: one bucket
    ties = rng.integers(0, 4, (4, 99)).astype(float)
    odd = np.array([[0.0, 1e-45, 1e-40, np.inf, np.nan, 3.0, 3.0, 0.5, 2e38]] * 2)
    for rows in (spread, one_bucket, ties, odd, np.array([[2.5], [0.0]])):
        bits = np.abs(rows).astype(np.float32).view(np.int32)
        assert (bits >= 0).all()
        full = np.sort(bits, axis=-1)
        n = bits.shape[1]
        for kth in {0, min(1, n - 1), n // 2, n - 1}:
            np.testing.assert_array_equal(_kth_smallest(bits, kth), full[:, kth])


def test_top_k_and_median_on_ties_zeros_and_inf_equal_float_topk(planted):
    """The CPU hook ranks ``|a|`` by its bits as int32: with many ties, ``±0`` and ``inf`` it keeps
    ``torch.topk``'s values *and* dims (ties in the same order) and ``kthvalue``'s median."""
    model, _ = planted
    batch = model.tokenize(["w1 w2 w3 w4 w5", "w9 w8", "w2 w4 w6 w8 w10"])
    rec = NormRecorder(model, batch, ("resid_post",), top_k=16)
    chunk = chunks(batch)[0]
    (name, hook) = rec.hooks(chunk)[0]
    assert name == names.resid_post(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (len(chunk), chunk.width, model.d_model), generator=g).float()
    x[x == 0] = -0.0
    x[0, 1, 3] = float("inf")
    hook(x, None)
    rec._flush()
    want_vals, want_dims = x.abs().topk(rec.k, dim=-1)
    got = rec._buf
    rows = chunk.rows
    assert torch.equal(got["top_abs"][0, rows, : chunk.width], want_vals)
    assert torch.equal(got["top_dims"][0, rows, : chunk.width], want_dims)
    want_med = _row_medians(x.abs(), chunk.lengths)
    assert torch.equal(got["median_abs"][0, rows], want_med)
