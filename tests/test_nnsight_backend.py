"""The nnsight backend (``me_interp.backends``) against the TransformerLens path.

Each statistic reduced inside an nnsight trace is compared with the TL recorder that computes it
from hooks (an independent computation: bridge hooks against HF module outputs): on the planted
tiny Llama (fast) and on the bundled SmolLM2-135M (``slow``), the same ME layer, events and dims and
the statistics to 1e-5 relative; the sink statistics; the WeMask perplexities of every selection.
Remote mode fails in one line without a key and without network (a closed local port: it cannot
hang), and the trace saves only small statistics.
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from me_interp import names
from me_interp.backends import _reduce, check_backend
from me_interp.backends import nnsight as nb
from me_interp.experiments import attention_sinks, me_layer, survey, wemask
from me_interp.loading.errors import UnsupportedArchitectureError
from me_interp.probes.attention import AttentionRecorder
from me_interp.probes.batching import record
from me_interp.probes.geometry import GeometryRecorder
from me_interp.probes.massive import locate_me_layer
from me_interp.probes.norms import scan_norms

# imported by the backend itself (after beartype: nnsight mounts .save on every object)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nnsight") is None,
    reason="the nnsight backend needs the extra `remote` (pip install -e '.[remote]'; setup.sh)",
)

PLANTED = "synthetic:planted"
RTOL = 1e-5
PROMPTS = [
    "The capital of France is Paris, a city of art and light.",
    "def f(x):\n    return x * 2 + 1",
    "One two three four five six seven eight nine ten eleven twelve thirteen",
    "Water boils at one hundred degrees at sea level.",
    "Hello there, general",
]


@pytest.fixture(scope="module")
def planted_tl():
    from me_interp import load_model

    return load_model(PLANTED, device="cpu")


@pytest.fixture(scope="module")
def planted_nn():
    return nb.load(PLANTED, device="cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).abs() / a.abs().clamp_min(1e-12)).max())


def _same_scan(s_tl, s_nn) -> None:
    m = s_tl.mask
    assert torch.equal(m, s_nn.mask)
    for site in nb.SCAN_SITES:
        assert _rel(s_tl.site_norms(site)[:, m], s_nn.site_norms(site)[:, m]) < RTOL, site
    assert _rel(s_tl.top_abs[:, m], s_nn.top_abs[:, m]) < RTOL
    assert (s_tl.top_dims[:, m] == s_nn.top_dims[:, m]).float().mean() > 0.99  # ties may reorder
    assert _rel(s_tl.median_abs, s_nn.median_abs) < RTOL


def _same_location(a, b) -> None:
    assert a.me_layer == b.me_layer
    assert a.massive_dims == b.massive_dims
    assert a.massive_positions == b.massive_positions
    assert [(e.layer, e.last_layer, e.site) for e in a.events] == [
        (e.layer, e.last_layer, e.site) for e in b.events
    ]
    for ea, eb in zip(a.events, b.events):
        assert math.isclose(ea.jump, eb.jump, rel_tol=RTOL)


def _compare_scans(tl_model, nn_model, prompts) -> tuple:
    b_tl, b_nn = tl_model.tokenize(prompts), nn_model.tokenize(prompts)
    assert torch.equal(b_tl.tokens, b_nn.tokens)  # one tokenisation (LoadedModel.tokenize)
    s_tl = scan_norms(tl_model, b_tl, names.SITES)
    sc = nb.scan(nn_model, b_nn, attention=True, grams=True)
    _same_scan(s_tl, sc.norms)
    loc_tl, loc_nn = locate_me_layer(s_tl), locate_me_layer(sc.norms)
    _same_location(loc_tl, loc_nn)
    return b_tl, b_nn, sc, loc_tl


def _compare_attention(tl_model, nn_model, b_tl, b_nn, sc, ref) -> None:
    rec = AttentionRecorder(tl_model, b_tl)
    geo = GeometryRecorder(tl_model, b_tl, positions=ref)
    record(tl_model, b_tl, [rec, geo])
    got = nb.attention_recorder(nn_model, b_nn, sc)
    finite = torch.isfinite(rec.to_key)
    assert torch.equal(finite, torch.isfinite(got.to_key))
    assert _rel(rec.to_key[finite], got.to_key[finite]) < RTOL
    assert _rel(rec.entropy, got.entropy) < RTOL
    assert _rel(rec.bos, got.bos) < RTOL
    p_tl, p_nn = rec.probe(reference=ref), got.probe(reference=ref)
    assert p_tl.sink_rate() == p_nn.sink_rate()
    gs_tl, gs_nn = geo.result(), nb.geometry(sc, b_nn, ref)
    for m, by in gs_tl.values.items():
        for tokens, v in by.items():
            w = gs_nn.values[m][tokens]
            ok = torch.isfinite(v)
            assert torch.equal(ok, torch.isfinite(w))
            assert _rel(v[ok], w[ok]) < 1e-6, (m, tokens)


# ------------------------------------------------------------------------------------------
# the planted tiny Llama (fast)
# ------------------------------------------------------------------------------------------


def test_scan_reproduces_the_tl_scan_on_the_planted_model(planted_tl, planted_nn):
    _, _, _, loc = _compare_scans(planted_tl, planted_nn, PROMPTS)
    assert loc.me_layer == 2  # what was planted (synthetic.planted_llama)


def test_sink_and_geometry_statistics_reproduce_the_tl_recorders(planted_tl, planted_nn):
    b_tl, b_nn, sc, loc = _compare_scans(planted_tl, planted_nn, PROMPTS)
    _compare_attention(planted_tl, planted_nn, b_tl, b_nn, sc, loc.reference_positions)


def test_me_layer_and_attention_sinks_runs_agree(planted_tl, planted_nn):
    r_tl = me_layer.run(me_layer.Config(model=PLANTED), planted_tl)
    r_nn = me_layer.run(me_layer.Config(model=PLANTED, backend="nnsight"), planted_nn)
    assert r_nn.me_layer == r_tl.me_layer == 2
    for k in ("r_pre", "r_mid", "r_post", "ref_ratio", "massive"):
        np.testing.assert_allclose(r_nn.array(k), r_tl.array(k), rtol=RTOL)
    a_tl = attention_sinks.run(attention_sinks.Config(model=PLANTED), planted_tl)
    a_nn = attention_sinks.run(attention_sinks.Config(model=PLANTED, backend="nnsight"), planted_nn)
    assert a_nn.me_layer == a_tl.me_layer
    for k in ("sink_rate", "attn_to_massive", "attn_entropy", "effective_rank"):
        np.testing.assert_allclose(
            np.array(getattr(a_nn.per_prompt, k), float),
            np.array(getattr(a_tl.per_prompt, k), float),
            rtol=RTOL,
        )


def _wemask_rows_agree(tl_model, nn_model, cfg: dict) -> None:
    w_tl = wemask.run(wemask.Config(**cfg), tl_model)
    w_nn = wemask.run(wemask.Config(**cfg, backend="nnsight"), nn_model)
    assert (w_nn.me_layer, w_nn.layers) == (w_tl.me_layer, w_tl.layers)
    assert math.isclose(w_nn.baseline.perplexity, w_tl.baseline.perplexity, rel_tol=RTOL)
    wemask_rows = [r for r in w_nn.rows if r.condition.is_wemask()]
    assert {r.condition.variant for r in wemask_rows} == set(wemask.VARIANTS)
    for row in w_nn.rows:
        c, r = row.condition, row.metrics
        o = w_tl.metrics(c.kind, c.variant, c.rate, c.alpha, c.seed)
        assert o is not None, row
        assert math.isclose(r.perplexity, o.perplexity, rel_tol=RTOL), c.variant
        np.testing.assert_allclose(r.per_text.nll, o.per_text.nll, rtol=RTOL)
        assert r.per_text.n_pred == o.per_text.n_pred
        for k in ("sink", "entropy", "eff_rank"):
            np.testing.assert_allclose(
                getattr(r.per_text, k), getattr(o.per_text, k), rtol=RTOL, atol=1e-7
            )
        assert math.isnan(r.kl)  # not measured by the nnsight backend: NaN, never 0
    full = w_nn.full_row()
    assert full.perplexity != w_nn.baseline.perplexity  # the mask acts


def test_wemask_perplexities_agree_for_every_selection(planted_tl, planted_nn):
    cfg = dict(model=PLANTED, rates=(0.0, 0.5, 1.0), claim_rate=0.5, n_seeds=2, max_texts=6)
    _wemask_rows_agree(planted_tl, planted_nn, {**cfg, "mc": "none"})


def test_the_trace_saves_only_small_statistics(planted_nn, monkeypatch):
    """Nothing of size d_model leaves a scan's trace: per layer, norms, top-k, medians."""
    kept = []
    real = _reduce.scan_layers

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        kept.append(out)
        return out

    monkeypatch.setattr(_reduce, "scan_layers", spy)
    batch = planted_nn.tokenize(PROMPTS)
    nb.scan(planted_nn, batch, top_k=4)
    d = planted_nn.d_model
    for chunk in kept:
        for stats in chunk:
            for v in stats.values():
                assert v.shape[-1] != d and v.numel() <= len(batch) * batch.tokens.shape[1] * 7


# ------------------------------------------------------------------------------------------
# the in-trace WeMask edit (positive and negative)
# ------------------------------------------------------------------------------------------


def test_mask_dims_zeroes_the_selected_dims_of_the_targets_only():
    torch.manual_seed(0)
    h, resid = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    target = torch.zeros(3, 5, dtype=torch.bool)
    target[:, 0] = True
    fixed = torch.tensor([1, 6])
    out = _reduce.mask_dims(h, resid, target, "weight", 2, fixed)
    assert torch.equal(out[:, 1:], h[:, 1:])  # other tokens bit-identical
    assert (out[:, 0, fixed] == 0).all()
    keep = torch.ones(8, dtype=torch.bool)
    keep[fixed] = False
    assert torch.equal(out[:, 0, keep], h[:, 0, keep])
    mag = _reduce.mask_dims(h, resid, target, "magnitude", 3, None)
    top = resid[:, 0].abs().topk(3, -1).indices
    assert (mag[:, 0].gather(-1, top) == 0).all()
    assert torch.equal(_reduce.mask_dims(h, resid, ~target & False, "activation", 3, None), h)


# ------------------------------------------------------------------------------------------
# refusals and remote mode (offline)
# ------------------------------------------------------------------------------------------


def test_backend_fields_are_validated():
    with pytest.raises(ValueError, match="backend"):
        check_backend("bogus", False)
    with pytest.raises(ValueError, match="--backend nnsight"):
        me_layer.Config(remote=True)
    with pytest.raises(ValueError, match="positions"):
        wemask.Config(backend="nnsight", positions="massive")


def test_the_backend_reads_the_architecture_description(planted_tl, planted_nn):
    """The nnsight model is described from its plain HF model as the bridge describes its own, and
    the backend finds the modules it reads through that description."""
    assert planted_nn.arch == planted_tl.arch
    for L in range(planted_nn.n_layers):
        assert torch.equal(planted_nn.attn_norm_gain(L), planted_tl.attn_norm_gain(L))
    assert planted_nn.info()["arch"] == planted_tl.info()["arch"]


def test_sandwich_norm_models_are_refused_in_one_line():
    with pytest.raises(UnsupportedArchitectureError, match="--backend tl"):
        nb.load("synthetic:planted-gemma2")


def _one_line(rc, err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def no_key(monkeypatch):
    nb._nnsight()
    from nnsight import CONFIG

    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    monkeypatch.setattr(CONFIG.API, "APIKEY", None)


def test_remote_without_a_key_is_one_line_exit_2(no_key, tmp_path, capsys):
    argv = ["--backend", "nnsight", "--remote", "--model", "meta-llama/Llama-3.1-8B"]
    rc = me_layer.main([*argv, "--out", str(tmp_path)])
    _one_line(rc, capsys.readouterr().err, "NDIF_API_KEY")
    rc = survey.main(
        ["--backend", "nnsight", "--remote", "--models", "meta-llama/Llama-3.1-405B"]
        + ["--out", str(tmp_path)]
    )
    _one_line(rc, capsys.readouterr().err, "NDIF_API_KEY")
    assert not any(tmp_path.iterdir())  # nothing written


def test_remote_without_network_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    """A key but no NDIF: a closed local port refuses at once (and the connect has a timeout)."""
    monkeypatch.setenv("NDIF_API_KEY", "not-a-real-key")
    monkeypatch.setenv("NDIF_HOST", "http://127.0.0.1:9")
    for main, argv in (
        (attention_sinks.main, ["--model", "meta-llama/Llama-3.1-70B"]),
        (wemask.main, ["--model", "meta-llama/Llama-3.1-70B"]),
        (survey.main, ["--models", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B"]),
    ):
        rc = main([*argv, "--backend", "nnsight", "--remote", "--out", str(tmp_path)])
        _one_line(rc, capsys.readouterr().err, "cannot reach NDIF", "127.0.0.1:9")


def test_remote_needs_a_hosted_model_name(monkeypatch):
    monkeypatch.setenv("NDIF_API_KEY", "not-a-real-key")
    with pytest.raises(ValueError, match="HF name"):
        nb.load(PLANTED, remote=True)


def test_other_experiments_refuse_the_backend_flag(capsys):
    from me_interp.experiments import mechanism

    with pytest.raises(SystemExit) as e:
        mechanism.main(["--backend", "nnsight"])
    _one_line(e.value.code, capsys.readouterr().err, "--backend")


# ------------------------------------------------------------------------------------------
# the bundled model (slow)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_nn():
    return nb.load(None, device="cpu", dtype="float32")


@pytest.mark.slow
def test_bundled_scan_and_sinks_reproduce_tl(bundled, bundled_nn):
    from me_interp.prompts import builtin_prompts

    prompts = builtin_prompts()[:8]
    b_tl, b_nn, sc, loc = _compare_scans(bundled, bundled_nn, prompts)
    assert loc.me_layer is not None
    _compare_attention(bundled, bundled_nn, b_tl, b_nn, sc, loc.reference_positions)


@pytest.mark.slow
def test_bundled_me_layer_run_agrees(bundled, bundled_nn, tmp_path):
    """The experiment through either backend: the same result. On 16 of the 82 built-in prompts
    (their lengths vary, so the length-sorted chunks and the padding are exercised): whether the two
    backends agree does not depend on how many prompts they agree on, and each prompt costs a
    forward on both (the default 82 took 38 s of the suite)."""
    from me_interp.prompts import builtin_prompts

    path = tmp_path / "prompts.json"  # a JSON list: some built-in prompts span several lines
    path.write_text(json.dumps(builtin_prompts()[:16]), encoding="utf-8")
    cfg = dict(prompts=str(path))
    r_tl = me_layer.run(me_layer.Config(**cfg), bundled)
    r_nn = me_layer.run(me_layer.Config(**cfg, backend="nnsight"), bundled_nn)
    assert r_nn.me_layer == r_tl.me_layer
    _same_location(r_tl.location, r_nn.location)
    for k in ("r_pre", "r_mid", "r_post", "ref_ratio"):
        np.testing.assert_allclose(r_nn.array(k), r_tl.array(k), rtol=RTOL)


@pytest.mark.slow
def test_bundled_wemask_perplexities_agree(bundled, bundled_nn):
    # 4 texts: the agreement is per text (see test_bundled_me_layer_run_agrees)
    cfg = dict(rates=(0.1, 1.0), n_seeds=1, max_texts=4, mc="none", alphas=())
    _wemask_rows_agree(bundled, bundled_nn, cfg)


def test_the_command_line_runs_the_nnsight_backend(tmp_path, capsys):
    """``--backend nnsight`` end to end: exit 0, the run written, the backend in env.json."""

    rc = me_layer.main(["--model", PLANTED, "--backend", "nnsight", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ME layer: 2 (0-based)" in out
    (run,) = (tmp_path / "me_layer").iterdir()
    env = json.loads((run / "env.json").read_text())
    assert "nnsight" in json.dumps(env)
    assert json.loads((run / "config.json").read_text())["backend"] == "nnsight"
