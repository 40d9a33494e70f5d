"""The ME-layer experiment: run(), result keys, claims (planted, null models, bundled), figures, CLI,
bad inputs."""

from __future__ import annotations

import importlib
import json
from functools import partial

import numpy as np
import pytest

from me_interp import claims, io, load_model, names, plotting, synthetic
from me_interp.experiments import me_layer

H, F, NA = claims.HOLDS, claims.FAILS, claims.NOT_APPLICABLE

# The verdict the planted construction implies, claim by claim (synthetic.planted_llama: the gain dims
# and FFN neuron of layer 2 write the massive dim of the BOS token, and nothing later writes that dim).
PLANTED = {
    "me_layer.sudden_birth": H,  # ratio ~1 at layer 1, ~300 at layer 2: a jump of ~300 in one layer
    "me_layer.one_layer": H,  # the other layers change nothing on the BOS token's ratio
    "me_layer.ffn_creates": H,  # the planted neuron (the FFN) makes the whole jump
    "me_layer.carried": H,  # no later component writes the massive dim
}
# On models without a massive activation the existence claim fails and the rest is not applicable.
NULL = {
    "me_layer.sudden_birth": F,
    "me_layer.one_layer": NA,
    "me_layer.ffn_creates": NA,
    "me_layer.carried": NA,
}


@pytest.fixture()
def word_prompts(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("w1 w2 w3 w4 w5 w6\nw9 w8 w7\nw30 w31 w32 w33 w34\n")
    return str(p)


def test_run_on_planted(planted, word_prompts):
    model, plant = planted
    res = me_layer.run(me_layer.Config(prompts=word_prompts), model)
    d = res.to_dict()
    for key in (
        "model",
        "bos",
        "me_layer",
        "me_layer_1based",
        "events",
        "massive_positions",
        "massive_dims",
        "layers",
    ):
        assert key in d
    assert d["me_layer"] == plant.layer and d["me_layer_1based"] == plant.layer + 1
    assert d["massive_dims"] == [plant.massive_dim] and d["me_site"] == "ffn"
    assert len(d["layers"]) == model.n_layers
    for key in ("resid_norm_ratio", "ffn_out_norm_ratio", "max_over_median"):
        assert all(isinstance(layer[key], float) for layer in d["layers"])
    assert d["layers"][plant.layer]["ffn_out_norm_ratio"] > 100
    assert d["layers"][plant.layer - 1]["resid_norm_ratio"] < 2
    figs = me_layer.figures(res)
    assert set(figs) == {"norms_by_site", "me_layer_tokens_by_dim", "ratios"}
    # no sandwich norms: the five panels of the paper's Figure 1, nothing else
    assert _panel_sites(figs["norms_by_site"]) == list(me_layer.FIGURE_SITES)
    titles = [a.text for a in figs["norms_by_site"].layout.annotations]
    assert titles == [plotting.SITE_TITLES[s] for s in me_layer.FIGURE_SITES]
    heat = figs["me_layer_tokens_by_dim"].data[0]
    row0 = list(heat.z[0])
    assert row0.index(max(row0)) == plant.massive_dim  # the massive dim lights up on token 0
    assert "ME layer" in me_layer.summary(res)


def _panel_sites(fig) -> list[str]:
    """The site of each panel of a ``norms_by_site`` figure, in panel order (from the traces' meta)."""
    return list(dict.fromkeys(t.meta for t in fig.data))


def _panel(fig, site: str) -> dict[str, list[float]]:
    """The two lines (massive token, mean of the others) of ``site``'s panel."""
    lines = [t for t in fig.data if t.meta == site]
    assert [t.legendgroup for t in lines] == ["massive", "others"]
    return {t.legendgroup: list(t.y) for t in lines}


def test_sandwich_figure_draws_the_own_outputs_as_cached(word_prompts):
    """On planted Gemma 3 (post-attention and post-FFN norms) ``norms_by_site`` also has panels for
    the attention's and the FFN's own outputs, and their lines are the norms of ``attn.hook_out`` /
    ``mlp.hook_out`` from ``run_with_cache``: the median over prompts (3, odd, so one middle value)
    of token 0's norm and of the mean norm of the other real tokens."""
    model = load_model("synthetic:planted-gemma3", device="cpu")
    assert model.arch.own_sites() == ("attn_own", "ffn_own")
    res = me_layer.run(me_layer.Config(prompts=word_prompts), model)
    assert res.location.reference_positions == [0, 0, 0]
    fig = me_layer.figures(res)["norms_by_site"]
    sites = ["attn_in", "attn_own", "attn_out", "ffn_in", "ffn_own", "ffn_out", "resid_post"]
    assert _panel_sites(fig) == sites  # one row per sub-layer, then the layer output
    titles = [a.text for a in fig.layout.annotations]
    assert titles[sites.index("ffn_out")] == plotting.RESIDUAL_TITLES["ffn_out"][1]
    assert titles[sites.index("ffn_own")] == plotting.SITE_TITLES["ffn_own"]

    batch = model.tokenize(open(word_prompts).read().split("\n")[:-1])
    hooks = {s: [names.site(s, L) for L in range(model.n_layers)] for s in ("attn_own", "ffn_own")}
    _, cache = model.bridge.run_with_cache(
        batch.tokens,
        attention_mask=batch.attention_mask,
        names_filter=[h for hs in hooks.values() for h in hs],
    )
    for site, hook_names in hooks.items():
        norms = np.stack([cache[h].double().norm(dim=-1).numpy() for h in hook_names])  # [L b p]
        real = batch.attention_mask.bool().numpy()
        others = real.copy()
        others[:, 0] = False
        want_massive = np.median(norms[:, :, 0], axis=1)
        want_others = np.median((norms * others).sum(-1) / others.sum(-1), axis=1)
        got = _panel(fig, site)
        np.testing.assert_allclose(got["massive"], want_massive, rtol=1e-5)
        np.testing.assert_allclose(got["others"], want_others, rtol=1e-5)
    # the FFN's own output at the planted layer is not its residual contribution (the post-FFN norm
    # rescales it), and the panels say so
    L = res.me_layer
    assert L == synthetic.planted("gemma3")[2].layer
    own, resid = _panel(fig, "ffn_own")["massive"][L], _panel(fig, "ffn_out")["massive"][L]
    assert abs(own / resid - 1) > 0.1


def test_cli_writes_a_complete_run(tmp_path, word_prompts, capsys):
    out = tmp_path / "runs"
    rc = me_layer.main(
        [
            "--model",
            "synthetic:planted",
            "--prompts",
            word_prompts,
            "--out",
            str(out),
            "--bos",
            "auto",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ME layer: 2 (0-based) = 3 (1-based)" in printed
    (run_dir,) = (out / "me_layer").iterdir()
    for f in ("config.json", "env.json", "result.json", "norms_by_site.html", "norms_by_site.json"):
        assert (run_dir / f).is_file(), f
    assert (out / io.PLOTLY_JS).is_file()
    html = (run_dir / "norms_by_site.html").read_text()
    assert "../../plotly.min.js" in html and len(html) < 500_000  # plotly.js shared, not embedded
    run = io.load_run(run_dir)
    assert run["result"]["me_layer"] == 2
    assert run["config"]["prompts"] == word_prompts and run["config"]["bos"] == "auto"
    assert run["env"]["bos"] == "auto" and run["env"]["dtype"] == "float32"
    assert "torch" in run["env"] and "layer_index" in run["env"]
    assert not list(run_dir.glob(".*.tmp"))


def test_cli_on_twin_reports_no_me_layer(tmp_path, word_prompts, capsys):
    rc = me_layer.main(
        ["--model", "synthetic:twin", "--prompts", word_prompts, "--out", str(tmp_path)]
    )
    assert rc == 0
    assert "none found" in capsys.readouterr().out
    (run_dir,) = (tmp_path / "me_layer").iterdir()
    assert json.loads((run_dir / "result.json").read_text())["me_layer"] is None


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "holds no prompts"),
        ("w1\nw2 w3\n", "single token"),  # with --bos no, "w1" is one token
    ],
)
def test_cli_bad_prompts(tmp_path, capsys, content, message):
    p = tmp_path / "p.txt"
    p.write_text(content)
    rc = me_layer.main(
        ["--model", "synthetic:planted", "--prompts", str(p), "--bos", "no", "--out", str(tmp_path)]
    )
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_bad_arguments(tmp_path, capsys):
    assert (
        me_layer.main(["--model", "synthetic:planted", "--prompts", str(tmp_path / "missing.txt")])
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert (
        me_layer.main(
            ["--model", "synthetic:planted", "--criterion", "loud", "--out", str(tmp_path)]
        )
        == 2
    )
    assert "criterion" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        me_layer.main(["--bos", "sometimes"])
    with pytest.raises(SystemExit):
        me_layer.main(["--dtype", "float8"])


def test_help_lists_the_common_flags(capsys):
    with pytest.raises(SystemExit) as e:
        me_layer.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--prompts", "--bos", "--dtype", "--device", "--seed", "--out"):
        assert flag in text


@pytest.fixture(scope="module")
def many_prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("\n".join(synthetic.planted_prompts(16, 10)) + "\n")
    return str(p)


def _verdicts(result) -> dict[str, str]:
    return {c.id: c.verdict for c in _claims(result)}


def _claims(result) -> list[claims.Claim]:
    """The claims of ``result``: its experiment module's ``verdicts``."""
    return importlib.import_module(type(result).__module__).verdicts(result)


def test_specs_are_unique_and_judged_in_order(planted, many_prompts):
    claims.check_specs(me_layer.SPECS)
    res = me_layer.run(me_layer.Config(prompts=many_prompts), planted[0])
    assert [c.id for c in _claims(res)] == [s.id for s in me_layer.SPECS]
    assert me_layer.verdicts(res) == me_layer.verdicts(res)  # seeded: the same intervals


def test_planted_claims_are_what_the_construction_implies(planted, many_prompts):
    model, plant = planted
    res = me_layer.run(me_layer.Config(prompts=many_prompts), model)
    assert _verdicts(res) == PLANTED
    by_id = {c.id: c for c in _claims(res)}
    birth = by_id["me_layer.sudden_birth"].estimate
    assert birth.n == 16 and birth.method == "bootstrap" and birth.lo <= birth.value <= birth.hi
    assert 100 < birth.lo and birth.hi < 1000
    assert by_id["me_layer.carried"].estimate.lo > 0.99
    d = res.to_dict()
    assert "claims" not in d  # the CLI and the battery add them (execute)
    assert np.asarray(d["per_prompt"]["r_post"]).shape == (16, model.n_layers)
    assert d["judged_layer"] == plant.layer
    line = by_id["me_layer.sudden_birth"].line()
    for part in ("[holds]", "95% CI", "n = 16 prompts", "threshold 'jump'", "control:"):
        assert part in line


def test_ffn_creates_is_not_applicable_when_the_site_is_unknown(planted, many_prompts):
    """A location from a scan without resid_pre/resid_mid has site "unknown": the FFN claim must not
    be judged (it was "ffn" by default, and the claim held)."""
    import dataclasses

    from me_interp.probes.massive import locate_me_layer
    from me_interp.probes.norms import scan_norms

    model, plant = planted
    res = me_layer.run(me_layer.Config(prompts=many_prompts), model)
    prompts = open(many_prompts).read().split("\n")[:-1]
    loc = locate_me_layer(scan_norms(model, model.tokenize(prompts), ("resid_post",)))
    assert loc.me_layer == plant.layer and loc.me_event.site == "unknown"
    unknown = dataclasses.replace(res, location=loc)
    by_id = {c.id: c for c in _claims(unknown)}
    assert by_id["me_layer.ffn_creates"].verdict == NA
    assert "unknown" in by_id["me_layer.ffn_creates"].why
    assert {k: v for k, v in _verdicts(unknown).items() if k != "me_layer.ffn_creates"} == {
        k: v for k, v in PLANTED.items() if k != "me_layer.ffn_creates"
    }


@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_no_claim_holds_without_a_massive_activation(fixture, request, many_prompts):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    res = me_layer.run(me_layer.Config(prompts=many_prompts), model)
    assert res.me_layer is None
    assert _verdicts(res) == NULL
    birth = _claims(res)[0].estimate
    assert birth.value == birth.lo == birth.hi == 0.0  # no prompt has a massive token
    for c in _claims(res)[1:]:
        assert "no massive activation" in c.why
    assert "judged at the largest jump" in _claims(res)[0].details


def test_carried_fails_when_a_later_layer_removes_the_activation(planted, many_prompts):
    """Neuron 0 of the next layer reads the massive dim and writes it back to zero: the activation is
    born as planted but not carried."""
    import torch

    from me_interp import names

    model, plant = planted
    L, D = plant.layer + 1, plant.massive_dim
    seen = {}

    def grab(x, hook, key):
        seen[key] = float(x[0, 0, D])  # the BOS token is the same in every prompt
        return x

    ffn = model.ffn_weights(L)
    saved = [t.detach().clone() for t in (ffn.gate, ffn.up, ffn.down)]
    try:
        with torch.no_grad():  # gate and up read only the massive dim of the normalised input
            for w in (ffn.gate, ffn.up):
                w[0].zero_()
                w[0, D] = 1.0
            ffn.down[:, 0].zero_()
        batch = model.tokenize(["w1 w2 w3"])
        hooks = [
            (names.resid_mid(L), partial(grab, key="v")),
            (names.ffn_in(L), partial(grab, key="g")),
        ]
        model.run_with_hooks(batch, hooks)
        g = torch.tensor(seen["g"])
        with torch.no_grad():
            ffn.down[D, 0] = -seen["v"] / float(torch.nn.functional.silu(g) * g)
        res = me_layer.run(me_layer.Config(prompts=many_prompts), model)
    finally:
        with torch.no_grad():
            for t, v in zip((ffn.gate, ffn.up, ffn.down), saved):
                t.copy_(v)
    assert res.me_layer == plant.layer
    verdicts = _verdicts(res)
    assert verdicts["me_layer.sudden_birth"] == H and verdicts["me_layer.carried"] == F
    carried = {c.id: c for c in _claims(res)}["me_layer.carried"].estimate
    assert carried.hi < 0.05


@pytest.mark.slow
def test_cli_on_bundled_model(tmp_path, capsys, bundled):
    res = me_layer.run(me_layer.Config(out=str(tmp_path)), bundled)
    d = res.to_dict()
    assert d["me_layer"] == 11 and d["me_layer_1based"] == 12
    assert d["bos"] == "auto" and d["bos_prepended"] is False
    assert 507 in d["massive_dims"]
    assert 100 < d["layers"][11]["resid_norm_ratio"] < 300
    by_id = {c.id: c for c in _claims(res)}
    # measured with the built-in prompts (82): birth jump 127 [124, 130], z 13.1, FFN factor 125,
    # carried 0.041 (the model removes the activation in its last layers: 167 -> 6.8)
    assert [by_id[i].verdict for i in PLANTED] == [H, H, H, F]
    birth = by_id["me_layer.sudden_birth"].estimate
    assert birth.n == res.n_prompts >= 64 and 80 < birth.lo <= birth.hi < 200
    assert 8 < by_id["me_layer.one_layer"].estimate.lo < 20
    assert 80 < by_id["me_layer.ffn_creates"].estimate.value < 200
    carried = by_id["me_layer.carried"].estimate
    assert 0.01 < carried.lo <= carried.hi < 0.1
