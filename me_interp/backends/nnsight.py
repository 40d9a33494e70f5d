"""The nnsight backend: the ME-layer scan, the attention-sink statistics and the WeMask perplexity
study on a plain HF model wrapped by nnsight, on this machine or remotely on NDIF (``remote``).

Every trace reduces the activations to small statistics where they are computed
(:mod:`me_interp.backends._reduce`, shipped with a remote request by ``nnsight.register``) and saves
only those: per layer and prompt the token norms at the seven sites of :data:`me_interp.names.SITES`,
the layer output's top-``k`` ``|a|`` with their dims and its median ``|a|``; for the sink statistics
``mean_{q>k} A[q, k]`` per head and key, the entropy and the BOS metric, and the Gram matrix of each
prompt's layer outputs (``n × n``, from which the geometry of any token subset follows); for WeMask
each text's next-token NLL sum and count. Never a whole activation, logits or cache.

The statistics then go through the TransformerLens path's own code: a :class:`NormScan` for
:func:`me_interp.probes.massive.locate_me_layer` (one ME-layer definition), an
:class:`~me_interp.probes.attention.AttentionRecorder` for the sink probe,
:func:`me_interp.probes.geometry.gram_metrics`, :func:`me_interp.interventions.wemask.select_dims`
and :func:`me_interp.evaluation.pooled_metrics`. The prompts of one experiment run in one nnsight
*session* (one NDIF request), one trace per length-sorted chunk (:func:`probes.batching.chunks`).

The model's layout is read once, from its :class:`~me_interp.architecture.Architecture`
(:func:`~me_interp.architecture.describe_hf`: the decoder-layer list, each layer's pre-attention norm,
attention, pre-FFN norm and FFN, the gain convention), never from module names written here.
Supported: pre-norm decoders that feed the residual stream the attention's and the FFN's own outputs
and store the RMSNorm gain itself (Llama, Mistral, Qwen2/2.5/3, Phi-3, SmolLM); a model with ``1 + w``
gains or sandwich norms (Gemma) is refused in one line. The attention statistics need attention
weights (eager attention); a model whose attention returns none (sdpa / flash, as NDIF may serve it)
is refused with a one-line error naming it.

The probes the experiments call hand this backend's model their call (``probes.batching.own_backend``):
:meth:`NNsightModel.scan_norms` (``probes.norms.scan_norms``), :meth:`NNsightModel.sink_scan`
(``probes.sinks.sink_scan``), :meth:`NNsightModel.locate_with_directions`
(``interventions.wemask.locate_with_directions``) and :meth:`NNsightModel.sweep`
(``evaluation.sweep``), so no experiment branches on the backend.

Remote mode reads the key from ``NDIF_API_KEY`` (or nnsight's own config) and checks that the NDIF
host answers within :data:`CONNECT_TIMEOUT` seconds before anything is loaded; both failures are one
line (:class:`RemoteUnavailableError`, exit 2 from the command line).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from me_interp import names
from me_interp.architecture import Architecture, ArchitectureError, describe_hf
from me_interp.backends import _reduce
from me_interp.loading.errors import ModelLoadError, UnsupportedArchitectureError
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.batching import chunks as length_chunks
from me_interp.probes.norms import NormScan

CONNECT_TIMEOUT = 5.0
"""Seconds to wait for the NDIF host before saying there is no network."""
KEY_URL = "https://login.ndif.us"
#: The sites a scan records, in the order of ``_reduce.scan_layers``.
SCAN_SITES: tuple[str, ...] = names.SITES


class RemoteUnavailableError(ModelLoadError):
    """Remote mode cannot run: no NDIF key, or the NDIF host cannot be reached."""


class NoBridgeError(UnsupportedArchitectureError, AttributeError):
    """What needs the TransformerLens bridge was asked of an nnsight model (an ``AttributeError``
    too, so ``hasattr(model, "bridge")`` is ``False``)."""


def _nnsight():
    try:  # nnsight mounts ``.save`` on ``object`` at import, after which beartype (the tests'
        import beartype  # noqa: F401  run-time type checker) can no longer be imported
    except ImportError:
        pass
    try:
        import nnsight
    except ImportError:
        raise ModelLoadError(
            "the nnsight backend needs nnsight: pip install -e '.[remote]' (setup.sh installs it)"
        ) from None
    return nnsight


def api_key() -> str | None:
    """The NDIF key: ``NDIF_API_KEY``, else the one nnsight keeps in its config file."""
    key = os.environ.get("NDIF_API_KEY")
    if key:
        return key
    try:
        from nnsight import CONFIG
    except ImportError:
        return None
    return CONFIG.API.APIKEY or None


def ndif_host() -> str:
    """NDIF's API address (``NDIF_HOST`` or nnsight's default)."""
    host = os.environ.get("NDIF_HOST")
    if host:
        return host
    from nnsight import CONFIG

    return CONFIG.API.HOST


def check_remote(timeout: float = CONNECT_TIMEOUT) -> None:
    """Raise :class:`RemoteUnavailableError` (one line) without a key or when the NDIF host does not
    accept a connection within ``timeout`` seconds (name resolution included)."""
    _nnsight()
    if not api_key():
        raise RemoteUnavailableError(
            f"remote mode needs an NDIF API key: set NDIF_API_KEY (get one at {KEY_URL})"
        )
    host = ndif_host()
    url = urlparse(host if "://" in host else f"https://{host}")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.setdefaulttimeout(timeout)
        try:
            socket.create_connection((url.hostname, port), timeout=timeout).close()
        finally:
            socket.setdefaulttimeout(None)
    except OSError as e:
        raise RemoteUnavailableError(
            f"cannot reach NDIF at {host} ({type(e).__name__}: {e}): remote mode needs network "
            "access to it"
        ) from None


class NNsightModel(LoadedModel):
    """A plain HF causal LM under nnsight (``lm``), local or remote. It is a :class:`LoadedModel`
    for what does not need TransformerLens (the same tokenisation, BOS rule, short-prompt filter and
    right padding; layer and head counts), and has no bridge: what needs one says so in one line."""

    backend = "nnsight"

    def __init__(
        self,
        lm: Any,
        tokenizer: Any,
        name: str,
        bos: str,
        dtype: torch.dtype,
        device: torch.device,
        remote: bool,
    ) -> None:
        self.lm, self.tokenizer, self.name, self.bos = lm, tokenizer, name, bos
        self.dtype, self.device, self.remote = dtype, device, remote
        self.hf = lm._module  # the HF module (meta tensors when remote)
        self.arch = _architecture(self.hf, name)
        self.layers_path = self.arch.layers
        self.attention = "remote" if remote else (self.attn_implementation or "eager")

    @property
    def bridge(self) -> Any:  # type: ignore[override]
        raise NoBridgeError(
            f"{self.name} runs on the nnsight backend, which has no TransformerLens bridge: this "
            "needs --backend tl"
        )

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def d_model(self) -> int:
        return int(self.config.hidden_size)

    @property
    def n_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def attn_implementation(self) -> str | None:
        return getattr(self.config, "_attn_implementation", None)

    def block_module(self, layer: int) -> torch.nn.Module:
        """The HF decoder layer ``layer`` (``arch.layers``)."""
        return self.hf.get_submodule(self.layers_path)[self.check_layer(layer)]

    def attn_norm_module(self, layer: int) -> torch.nn.Module:
        """The HF pre-attention RMSNorm module of ``layer`` (``arch.attn_norm``)."""
        return getattr(self.block_module(layer), self.arch.attn_norm)

    def attn_norm_weight(self, layer: int) -> torch.nn.Parameter:
        """The stored weight of the pre-attention RMSNorm (on a remote model, once
        :func:`attn_gains` has read it)."""
        w = self.attn_norm_module(layer).weight
        if w.device.type == "meta":
            raise ValueError(
                f"the pre-attention norm gain of layer {layer} is on NDIF: read it with "
                "backends.nnsight.attn_gains first"
            )
        return w

    # -- the probes' calls (probes.batching.own_backend) --------------------------------------
    def scan_norms(
        self,
        batch: Batch,
        sites: Sequence[str] = SCAN_SITES,
        top_k: int = 16,
        keep_prompt: int = 0,
        extra_hooks: Sequence | None = None,
    ) -> NormScan:
        """:func:`me_interp.probes.norms.scan_norms` in nnsight traces (:func:`scan_norms`)."""
        return scan_norms(self, batch, sites, top_k, keep_prompt, extra_hooks)

    def sink_scan(self, batch: Batch) -> Any:
        """:func:`me_interp.probes.sinks.sink_scan` in nnsight traces (:func:`sink_scan`)."""
        return sink_scan(self, batch)

    def locate_with_directions(self, batch: Batch) -> tuple[Any, dict[int, torch.Tensor]]:
        """:func:`me_interp.interventions.wemask.locate_with_directions` in nnsight traces."""
        return locate_with_directions(self, batch)

    def sweep(self, chunks, layers, rank_layer, specs, **kwargs: Any) -> Any:
        """:func:`me_interp.evaluation.sweep` in nnsight traces (:func:`sweep`)."""
        return sweep(self, chunks, layers, rank_layer, specs, **kwargs)

    def layers(self) -> Any:
        """nnsight's envoy of the decoder-layer list (use inside a trace)."""
        env = self.lm
        for part in self.layers_path.split("."):
            env = getattr(env, part)
        return env

    def session(self) -> Any:
        """One nnsight session: its traces are one NDIF request when remote. nnsight runs the body
        of the ``with`` block it is written in, so callers write ``with model.session():`` inside
        ``with torch.no_grad():`` themselves."""
        if self.remote:
            _nnsight().register(_reduce)  # the in-trace reductions travel with the request
        return self.lm.session(remote=self.remote)

    def trace(self, batch: Batch):
        tokens, mask = batch.tokens, batch.attention_mask
        if not self.remote:
            tokens, mask = tokens.to(self.device), mask.to(self.device)
        return self.lm.trace({"input_ids": tokens, "attention_mask": mask})

    def info(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "backend": "nnsight",
            "remote": self.remote,
            "ndif_host": ndif_host() if self.remote else None,
            "architecture": type(self.hf).__name__,
            "arch": self.arch.to_dict(),
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "bos": self.bos,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": "ndif" if self.remote else str(self.device),
            "attn_implementation": self.attn_implementation,
            "layer_index": "0-based (layer L = HF model.layers[L]); 1-based given alongside",
            "prompt_filter": getattr(self, "prompt_filter", None),
            "saved": "per-layer statistics only (backends/_reduce.py), never activations",
        }

    def __repr__(self) -> str:
        where = "remote" if self.remote else str(self.device)
        return f"NNsightModel({self.name!r}, n_layers={self.n_layers}, {where})"


def _architecture(hf: Any, name: str) -> Architecture:
    """``hf``'s :class:`Architecture` (:func:`describe_hf`), or one line saying why this backend
    does not read it."""
    try:
        arch = describe_hf(hf)
    except ArchitectureError as e:
        raise UnsupportedArchitectureError(
            f"{name} ({type(hf).__name__}) is not supported by the nnsight backend ({e}): use "
            "--backend tl"
        ) from None
    if arch.norm_offset != 0.0 or arch.sandwich:
        # the scan reads the attention's and the FFN's own outputs as their residual contributions
        # and WeMask's remote gains as stored: sandwich norms and 1 + w gains need the TL path
        why = ", ".join(
            w
            for w, yes in (
                ("1 + w gains", arch.norm_offset != 0.0),
                ("sandwich norms", arch.sandwich),
            )
            if yes
        )
        raise UnsupportedArchitectureError(
            f"{name} ({type(hf).__name__}) is not supported by the nnsight backend ({why}); it "
            "reads pre-norm layers with the stored gain (Llama/Mistral/Qwen/Phi-3 style): use "
            "--backend tl"
        )
    return arch


def load(
    name: str | None = None,
    bos: str = "auto",
    dtype: str = "auto",
    device: str | None = None,
    remote: bool = False,
) -> NNsightModel:
    """``name`` under nnsight. Local: the plain HF model me_interp loads for every source (bundled,
    packaged, synthetic, HF name or directory; eager attention). Remote: nnsight's meta model of the
    HF name (config and tokenizer from the hub, no weights), run on NDIF.

    Raises:
        RemoteUnavailableError: remote without a key or network.
        ModelLoadError: nnsight missing, the model cannot be loaded, or an unsupported architecture.
    """
    nn = _nnsight()
    from me_interp.loading.devices import resolve_device, resolve_dtype

    if remote:
        if not name or name == "bundled" or str(name).startswith("synthetic:"):
            raise ValueError(
                "remote runs a model NDIF hosts: give its HF name (e.g. meta-llama/Llama-3.1-70B)"
            )
        check_remote()
        try:
            lm = nn.TransformersModel(name, task="text-generation")
        except Exception as e:
            raise ModelLoadError(
                f"cannot load the config and tokenizer of {name} from the HF hub "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); gated models "
                "need HF_TOKEN with access"
            ) from None
        return NNsightModel(
            lm,
            lm.tokenizer,
            name,
            bos,
            resolve_dtype(dtype, torch.device("cpu")),
            torch.device("cpu"),
            True,
        )
    from me_interp.interventions.hf_hooks import load_hf

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        hf, tok = load_hf(name, dtype=dt, device=str(dev))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {name}: {e}") from None
    lm = nn.TransformersModel(hf, tokenizer=tok)
    label = "bundled" if name in (None, "bundled") else str(name)
    return NNsightModel(lm, tok, label, bos, dt, dev, False)


def model_for(cfg: Any, model: Any = None) -> NNsightModel:
    """``model`` when it is an :class:`NNsightModel`, else ``cfg.model`` loaded under nnsight
    (``cfg.remote``)."""
    if isinstance(model, NNsightModel):
        return model
    if model is not None:
        raise TypeError("the nnsight backend takes an NNsightModel (backends.nnsight.load) or None")
    return load(cfg.model, cfg.bos, cfg.dtype, cfg.device, bool(getattr(cfg, "remote", False)))


# ------------------------------------------------------------------------------------------
# the scan: norms at every site (+ attention statistics, + Gram matrices), one session
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scan:
    """What one nnsight scan saved, assembled over chunks on the CPU.

    ``norms`` is the :class:`NormScan` (``kept_resid`` holds the kept prompt's top-``k`` ``|a|`` per
    token, zero elsewhere: the whole layer output never leaves the trace). ``to_key [layer batch head
    pos]``, ``entropy``/``bos [layer batch head]`` when attention was asked; ``grams[layer][b]`` the
    ``[n_b n_b]`` Gram matrix of prompt ``b``'s layer outputs when asked; ``first[layer]`` the mean
    over prompts of the attention input at position 0 (``[d_model]``) when asked."""

    norms: NormScan
    to_key: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    bos: torch.Tensor | None = None
    grams: list[list[torch.Tensor]] | None = None
    first: dict[int, torch.Tensor] | None = None


def _query_masks(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The real queries ``q ≥ 1`` and the BOS metric's queries (second half), as the TL recorder."""
    qmask = batch.attention_mask.bool().clone()
    qmask[:, 0] = False
    if not qmask.any(-1).all():
        raise ValueError("attention statistics need prompts with at least 2 tokens")
    bosq = qmask.clone()
    for i, n in enumerate(batch.lengths):
        bosq[i, : n // 2] = False
    return qmask, bosq


def scan(
    model: NNsightModel,
    batch: Batch,
    top_k: int = 16,
    keep_prompt: int = 0,
    attention: bool = False,
    grams: bool = False,
    first: bool = False,
) -> Scan:
    """Run ``batch`` in one session (one trace per length-sorted chunk) and keep the statistics
    :class:`Scan` holds.

    Raises:
        ValueError: ``attention`` on a model whose attention returns no weights.
    """
    if not 0 <= keep_prompt < len(batch):
        raise ValueError(f"keep_prompt={keep_prompt} out of range for {len(batch)} prompts")
    if attention and not model.remote and model.attn_implementation not in (None, "eager"):
        raise ValueError(_no_weights(model))
    L, (B, T), d = model.n_layers, batch.tokens.shape, model.d_model
    k = min(top_k, d)
    parts = length_chunks(batch.to("cpu"))
    env = (
        model.layers()
    )  # only envoys, tensors, strings and numbers enter a trace (a remote one too)
    a = model.arch
    layout = (a.attn_norm, a.attn, a.ffn_norm, a.ffn)
    with torch.no_grad(), model.session():
        saved = [].save()
        for c in parts:
            lengths = c.lengths
            masks = _query_masks(c.batch) if attention else None
            with model.trace(c.batch) as tracer:
                stats = _reduce.scan_layers(env, L, k, lengths, layout, masks, grams, first)
                saved.append(stats)
                tracer.stop()  # nothing after the last layer is needed
    S = len(SCAN_SITES)
    norms = torch.full((S, L, B, T), float("nan"))
    top_abs = torch.zeros(L, B, T, k)
    top_dims = torch.zeros(L, B, T, k, dtype=torch.long)
    median = torch.zeros(L, B)
    H = model.n_heads
    to_key = torch.full((L, B, H, T), float("nan")) if attention else None
    entropy = torch.zeros(L, B, H) if attention else None
    bos = torch.zeros(L, B, H) if attention else None
    gram_out: list[list[Any]] | None = [[None] * B for _ in range(L)] if grams else None
    first_sum = torch.zeros(L, d, dtype=torch.float64) if first else None
    for c, stats in zip(parts, saved):
        rows, w = c.rows, c.width
        for layer, s in enumerate(stats):
            norms[:, layer, rows, :w] = s["norms"].cpu()
            top_abs[layer, rows, :w] = s["top_abs"].cpu()
            top_dims[layer, rows, :w] = s["top_dims"].cpu()
            median[layer, rows] = s["median_abs"].cpu()
            if attention:
                if s["attention"] is None:
                    raise ValueError(_no_weights(model))
                tk, ent, b0 = (t.cpu() for t in s["attention"])
                to_key[layer, rows, :, :w] = tk
                entropy[layer, rows] = ent
                bos[layer, rows] = b0
            if grams:
                for i, r in enumerate(rows.tolist()):
                    gram_out[layer][r] = s["grams"][i].cpu()
            if first:
                first_sum[layer] += s["first"].cpu().double()
    mask = batch.attention_mask.bool().cpu()
    norms = norms.masked_fill(~mask, float("nan"))
    if not torch.isfinite(norms[:, :, mask]).all():
        raise FloatingPointError(
            f"non-finite activations (inf/NaN) in the forward pass: the dtype overflowed "
            f"({model.dtype}); use float32 or bfloat16"
        )
    n0 = int(mask[keep_prompt].sum())
    kept = torch.zeros(L, n0, d).scatter_(
        -1, top_dims[:, keep_prompt, :n0], top_abs[:, keep_prompt, :n0]
    )
    ns = NormScan(
        sites=SCAN_SITES,
        norms=norms,
        top_abs=top_abs,
        top_dims=top_dims,
        median_abs=median,
        mask=mask,
        kept_prompt=keep_prompt,
        kept_resid=kept,
    )
    directions = (
        None if first_sum is None else {i: (v / B).float() for i, v in enumerate(first_sum)}
    )
    return Scan(ns, to_key, entropy, bos, gram_out, directions)


def _no_weights(model: NNsightModel) -> str:
    return (
        f"{model.name} returns no attention weights (attention implementation "
        f"{model.attn_implementation or 'of the server'}): the sink statistics need eager "
        "attention; run attention_sinks with --backend tl, or on a model served with eager attention"
    )


def scan_norms(
    model: NNsightModel,
    batch: Batch,
    sites: Sequence[str] = SCAN_SITES,
    top_k: int = 16,
    keep_prompt: int = 0,
    extra_hooks: Sequence | None = None,
) -> NormScan:
    """The ME-layer scan's :class:`NormScan` (every site of :data:`SCAN_SITES`), one session: what
    :func:`me_interp.probes.norms.scan_norms` records.

    Raises:
        ValueError: ``extra_hooks`` (TransformerLens hooks) or a site the scan does not record.
    """
    if extra_hooks:
        raise ValueError(
            "the nnsight backend runs no TransformerLens hooks: this needs --backend tl"
        )
    other = [x for x in sites if x not in SCAN_SITES]
    if other:
        raise ValueError(f"the nnsight scan records {SCAN_SITES}, not {other}")
    return scan(model, batch, top_k, keep_prompt).norms


def sink_scan(model: NNsightModel, batch: Batch):
    """:func:`me_interp.probes.sinks.sink_scan` from one session: the norms, the attention
    statistics (:func:`attention_recorder`) and the geometry from the saved Gram matrices
    (:func:`geometry`: without any token, no second run)."""
    from functools import partial

    from me_interp.probes.sinks import SinkScan

    sc = scan(model, batch, attention=True, grams=True)
    return SinkScan(sc.norms, attention_recorder(model, batch, sc), partial(geometry, sc, batch))


def locate_with_directions(model: NNsightModel, batch: Batch):
    """:func:`me_interp.interventions.wemask.locate_with_directions` from one session: the ME
    location of the scan and the mean attention input at position 0 of every layer."""
    from me_interp.probes.massive import locate_me_layer

    sc = scan(model, batch, first=True)
    return locate_me_layer(sc.norms), dict(sc.first)


def attention_recorder(model: NNsightModel, batch: Batch, result: Scan):
    """An :class:`~me_interp.probes.attention.AttentionRecorder` holding ``result``'s attention
    statistics, so its ``probe`` (sink rate, attention to the massive tokens) is the TL path's."""
    from me_interp.probes.attention import AttentionRecorder

    if result.to_key is None:
        raise ValueError("the scan recorded no attention statistics (attention=True)")
    rec = AttentionRecorder(model, batch)
    rec.to_key, rec.entropy, rec.bos = result.to_key, result.entropy, result.bos
    return rec


def geometry(result: Scan, batch: Batch, reference: Sequence[int]):
    """A :class:`~me_interp.probes.geometry.GeometryScan` from the saved Gram matrices: every prompt's
    layer outputs (``all``) and without its reference token (``others``), by
    :func:`~me_interp.probes.geometry.gram_metrics`."""
    from me_interp.probes.geometry import METRICS, GeometryScan, gram_metrics

    if result.grams is None:
        raise ValueError("the scan recorded no Gram matrices (grams=True)")
    L, B = len(result.grams), len(batch)
    values = {m: {t: torch.full((L, B), float("nan")) for t in ("all", "others")} for m in METRICS}
    for layer in range(L):
        for b in range(B):
            g = result.grams[layer][b]
            keep = torch.ones(g.shape[0], dtype=torch.bool)
            keep[int(reference[b])] = False
            for tokens, gm in (("all", g), ("others", g[keep][:, keep])):
                for m, v in gram_metrics(gm).items():
                    values[m][tokens][layer, b] = v
    return GeometryScan(values=values, reference=torch.as_tensor(list(reference), dtype=torch.long))


# ------------------------------------------------------------------------------------------
# WeMask perplexity
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskSpec:
    """One WeMask condition as the trace applies it: the masked layers, the selection, its dim count
    ``k`` and, for the input-independent selections (``weight``, ``random``), the dims of each layer
    (``WeMask.fixed_dims``)."""

    layers: tuple[int, ...]
    variant: str
    k: int
    fixed: dict[int, torch.Tensor]


def attn_gains(model: NNsightModel, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The stored pre-attention RMSNorm weights of ``layers`` (``arch.attn_norm``): read from the
    local model, or saved from one remote trace (``d_model`` numbers per layer) and written into the
    meta model's norms, so :func:`~me_interp.interventions.wemask.select_dims` reads them either
    way (``model.attn_norm_gain``)."""
    todo = [L for L in layers if model.attn_norm_module(L).weight.device.type == "meta"]
    if todo:
        probe = model.batch_from_ids([[model.pad_token_id, model.pad_token_id]])
        env, norm = model.layers(), model.arch.attn_norm
        with torch.no_grad(), model.session():
            saved = {}.save()
            with model.trace(probe) as tracer:
                for L in todo:
                    saved[L] = getattr(env[L], norm).weight.detach().cpu()
                tracer.stop()
        for L, w in saved.items():
            model.attn_norm_module(L).weight = torch.nn.Parameter(w.float(), requires_grad=False)
    return {L: model.attn_norm_weight(L).detach() for L in layers}


def mask_spec(model: NNsightModel, spec: Any) -> MaskSpec | None:
    """The :class:`MaskSpec` of an intervention spec the trace applies: a WeMask hard mask
    (``keep = 0``) of the attention input at absolute position 0; ``None`` for any other (a soft
    projection, other positions or sites)."""
    from me_interp.interventions.wemask import WeMask, n_dims

    if not (
        isinstance(spec, WeMask)
        and spec.keep == 0.0
        and spec.site == "attn_in"
        and tuple(spec.positions) == (0,)
    ):
        return None
    k = n_dims(spec.variant, spec.rate, model.d_model)
    return MaskSpec(tuple(spec.layers), spec.variant, k, dict(spec.fixed_dims))


def sweep(
    model: NNsightModel,
    chunks: Sequence[tuple[list[int], Batch]],
    layers: Sequence[int],
    rank_layer: int,
    specs: Sequence[Any],
    *,
    positions: Any = (0,),
    per_text: bool = False,
    items: Sequence[Any] = (),
    score_mc: Sequence[bool] | None = None,
    progress: Any = None,
):
    """:func:`me_interp.evaluation.sweep` in one session (:func:`text_stats`): every WeMask hard
    mask of ``specs`` (built for position 0; :func:`mask_spec`) and the unmodified model; the other
    specs are not measured (``None``), nor KL and top-1 agreement (NaN: no reference distributions
    leave the trace) nor MC items. A remote model's gains are read first (:func:`attn_gains`).

    Raises:
        ValueError: ``positions`` other than ``(0,)`` for every text (the mask sits at position 0).
    """
    from me_interp.evaluation import SweepResult, pooled_metrics

    if per_text or tuple(positions) != (0,):
        raise ValueError(
            "the nnsight backend masks absolute position 0 only (positions must be 'first')"
        )
    if model.remote:
        attn_gains(model, layers)
    masks = [mask_spec(model, f((0,))) for f in specs]
    todo = [m for m in masks if m is not None]
    stats = text_stats(model, chunks, [None, *todo], layers, rank_layer)

    def measured(per_text: dict[str, list[float]]) -> dict[str, Any]:
        return {**pooled_metrics(per_text), "per_text": per_text}

    done = iter(stats[1:])
    rows = [None if m is None else measured(next(done)) for m in masks]
    left = ["kl, top1 (no reference distributions leave the trace)"]
    if items:
        left.append("MC items")
    if any(m is None for m in masks):
        left.append("soft alternatives")
    return SweepResult(measured(stats[0]), rows, 0, ", ".join(left))


def text_stats(
    model: NNsightModel,
    groups: Sequence[tuple[list[int], Batch]],
    specs: Sequence[MaskSpec | None],
    stat_layers: Sequence[int],
    rank_layer: int,
) -> list[dict[str, list[float]]]:
    """For each spec (``None``: unmasked), per text: next-token ``nll`` sum and ``n_pred``, ``n_pos``,
    and, where the model returns attention weights, ``sink`` / ``entropy`` (means over heads and
    ``stat_layers`` as ``evaluation.text_metrics``) and ``eff_rank`` (the token states ``t ≥ 1`` at
    ``rank_layer``); ``kl`` and ``top1`` against the unmasked model are not measured (NaN). Every
    spec and text group is one trace of one session (one NDIF request)."""
    from me_interp.probes.geometry import gram_metrics

    n_texts = sum(len(idx) for idx, _ in groups)
    env, lm, n_layers = model.layers(), model.lm, model.n_layers
    attn_norm, attn = model.arch.attn_norm, model.arch.attn
    with torch.no_grad(), model.session():
        saved = [].save()
        for spec in specs:
            masked = set() if spec is None else set(spec.layers)
            variant = None if spec is None else spec.variant
            k = 0 if spec is None else spec.k
            fixed = {} if spec is None else dict(spec.fixed)
            for _, batch in groups:
                lengths = batch.lengths
                target = torch.zeros(batch.tokens.shape, dtype=torch.bool)
                target[:, 0] = True  # the massive token: absolute position 0
                qmask, bosq = _query_masks(batch)
                tokens, mask = batch.tokens, batch.attention_mask
                with model.trace(batch):
                    att = {}
                    g = None
                    for L in range(n_layers):
                        if L in masked:
                            resid = env[L].input
                            ln = getattr(env[L], attn_norm)
                            ln.output = _reduce.mask_dims(
                                ln.output, resid, target, variant, k, fixed.get(L)
                            )
                        if L in stat_layers:
                            w = getattr(env[L], attn).output[1]
                            att[L] = (
                                None if w is None else _reduce.attention_to_keys(w, qmask, bosq)
                            )
                        if L == rank_layer:
                            out = env[L].output
                            out = out[0] if isinstance(out, tuple) else out
                            g = _reduce.gram(out, lengths)
                    nll, n = _reduce.next_token_nll(lm.output.logits, tokens, mask)
                    saved.append({"nll": nll, "n": n, "att": att, "grams": g})
    out = []
    it = iter(saved)
    for _spec in specs:
        per = {
            k: [math.nan] * n_texts
            for k in ("nll", "n_pred", "kl", "top1", "n_pos", "sink", "entropy", "eff_rank")
        }
        for idx, batch in groups:
            s = next(it)
            att = [v for v in s["att"].values()]
            for i, t in enumerate(idx):
                per["nll"][t] = float(s["nll"][i])
                per["n_pred"][t] = float(s["n"][i])
                per["n_pos"][t] = float(batch.lengths[i])
                if att and all(a is not None for a in att):
                    per["sink"][t] = float(
                        sum(a[0][i, :, 0].double().mean() for a in att) / len(att)
                    )
                    per["entropy"][t] = float(sum(a[1][i].double().mean() for a in att) / len(att))
                n = batch.lengths[i]
                if n > 2:
                    per["eff_rank"][t] = gram_metrics(s["grams"][i][1:, 1:])["effective_rank"]
        out.append(per)
    return out


__all__ = [
    "CONNECT_TIMEOUT",
    "MaskSpec",
    "NNsightModel",
    "NoBridgeError",
    "RemoteUnavailableError",
    "SCAN_SITES",
    "Scan",
    "api_key",
    "attention_recorder",
    "attn_gains",
    "check_remote",
    "geometry",
    "load",
    "locate_with_directions",
    "mask_spec",
    "model_for",
    "scan",
    "scan_norms",
    "sink_scan",
    "sweep",
    "text_stats",
]
