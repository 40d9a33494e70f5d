"""The ME-layer experiment: run(), result keys, claims (planted, null models, bundled), figures, CLI,
bad inputs."""

from __future__ import annotations

import importlib
from functools import partial

import numpy as np
import pytest

from me_interp import claims, io, load_model, names, plotting, study, synthetic
from me_interp.experiments import me_layer

H, F, INC, NA = claims.HOLDS, claims.FAILS, claims.INCONCLUSIVE, claims.NOT_APPLICABLE

# The verdict the planted construction implies, claim by claim (synthetic.planted_llama: the gain dims
# and FFN neuron of layer 2 write the massive dim of the BOS token, and nothing later writes that dim).
PLANTED = {
    "me_layer.sudden_birth": H,  # ratio ~1 at layer 1, ~300 at layer 2: a jump of ~300 in one layer
    # every prompt starts with <s>, the massive token: one distinct measurement of it, so nothing can
    # be held out (one outcome, not decided)
    "me_layer.one_layer": INC,
    "me_layer.ffn_creates": H,  # the planted neuron (the FFN) makes the whole jump, attention x1
    # no later component writes the massive dim, but its norm (a function of its prefix, <s>) is one
    # distinct measurement: not decided
    "me_layer.carried": INC,
}
# Without BOS and with <s> second after different first tokens, the massive token (position 1) has
# 16 distinct prefixes: the largest-jump layer of 8 prompts is the largest jump of the other 8.
PLANTED_SECOND = {**PLANTED, "me_layer.one_layer": H, "me_layer.carried": H}
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
    assert io.to_jsonable(study.roundtrip(res)) == io.to_jsonable(res)
    loc, h = res.location, res.header
    assert h.model == model.name and h.bos == model.bos and h.seed == 0
    assert (
        res.me_layer == h.me_layer == h.layer == plant.layer and h.layer_1based == plant.layer + 1
    )
    assert loc.massive_dims == [plant.massive_dim] and res.me_site == "ffn"
    assert loc.events and loc.massive_positions
    ratios = loc.site_ratios
    assert len(loc.max_over_median) == len(ratios["resid_post"]) == model.n_layers
    for key in ("resid_post", "ffn_out"):
        assert all(isinstance(x, float) for x in ratios[key])
    assert all(isinstance(x, float) for x in loc.max_over_median)
    assert ratios["ffn_out"][plant.layer] > 100
    assert ratios["resid_post"][plant.layer - 1] < 2
    figs = me_layer.figures(res)
    assert set(figs) == {"norms_by_site", "me_layer_tokens_by_dim", "ratios"}
    # no sandwich norms: the five panels of the paper's Figure 1, nothing else
    assert _panel_sites(figs["norms_by_site"]) == list(plotting.FIGURE_SITES)
    titles = [a.text for a in figs["norms_by_site"].layout.annotations]
    assert titles == [plotting.SITE_TITLES[s] for s in plotting.FIGURE_SITES]
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
    run = io.read_run(run_dir)
    assert run["result"]["location"]["me_layer"] == run["result"]["header"]["me_layer"] == 2
    assert io.read_result(me_layer.Result, run_dir).me_layer == 2
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
    assert io.read_result(me_layer.Result, run_dir).me_layer is None


def test_cli_bad_prompts(tmp_path, capsys):
    p = tmp_path / "p.txt"
    p.write_text("")
    rc = me_layer.main(
        ["--model", "synthetic:planted", "--prompts", str(p), "--bos", "no", "--out", str(tmp_path)]
    )
    assert rc == 2
    assert "holds no prompts" in capsys.readouterr().err


def test_cli_drops_single_token_prompts(tmp_path):
    """With --bos no, "w1" is one token: it is dropped with a note (issue 17; it used to be an
    error), the kept prompt is scanned."""
    p = tmp_path / "p.txt"
    p.write_text("w1\nw2 w3\n")
    with pytest.warns(UserWarning, match="dropped 1 of 2 prompts"):
        rc = me_layer.main(
            [
                "--model",
                "synthetic:planted",
                "--prompts",
                str(p),
                "--bos",
                "no",
                "--out",
                str(tmp_path),
            ]
        )
    assert rc == 0


def test_cli_bad_arguments(tmp_path, capsys):
    assert (
        me_layer.main(["--model", "synthetic:planted", "--prompts", str(tmp_path / "missing.txt")])
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a value outside the flag's choices: argparse's line
        me_layer.main(
            ["--model", "synthetic:planted", "--criterion", "loud", "--out", str(tmp_path)]
        )
    assert e.value.code == 2 and "--criterion" in capsys.readouterr().err
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
    """The claims of ``result``: its experiment module's ``SPECS``, judged by the engine."""
    return claims.judge(importlib.import_module(type(result).__module__).SPECS, result)


def test_specs_are_unique_and_judged_in_order(planted, many_prompts):
    claims.check_specs(me_layer.SPECS)
    assert not hasattr(me_layer, "verdicts")  # declarative: the engine judges the specs
    res = me_layer.run(me_layer.Config(prompts=many_prompts), planted[0])
    assert [c.id for c in _claims(res)] == [s.id for s in me_layer.SPECS]
    assert _claims(res) == _claims(res)  # seeded: the same intervals


def test_planted_claims_are_what_the_construction_implies(planted, many_prompts):
    model, plant = planted
    res = me_layer.run(me_layer.Config(prompts=many_prompts), model)
    assert _verdicts(res) == PLANTED
    by_id = {c.id: c for c in _claims(res)}
    birth = by_id["me_layer.sudden_birth"].estimate
    assert birth.n == 16 and birth.method == "bootstrap" and birth.lo <= birth.value <= birth.hi
    assert 100 < birth.lo and birth.hi < 1000
    assert (
        by_id["me_layer.carried"].estimate.lo > 0.99
        and by_id["me_layer.carried"].estimate.n_eff == 1
    )
    one = by_id["me_layer.one_layer"]
    assert one.estimate.n == one.estimate.n_eff == 1 and one.outcomes == {
        "prompts 0…15 (16, one massive-token prefix)": True
    }
    assert "nothing to hold out" in one.details
    d = io.to_jsonable(res)
    assert "claims" not in d  # the CLI and the battery add them (execute)
    assert np.asarray(d["per_prompt"]["r_post"]).shape == (16, model.n_layers)
    assert res.judged_layer() == plant.layer
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


@pytest.fixture(scope="module")
def second_prompts(tmp_path_factory):
    """<s> second, after 16 different first tokens: 16 distinct massive-token prefixes."""
    p = tmp_path_factory.mktemp("prompts") / "second.txt"
    p.write_text(
        "\n".join(f"w{7 * i % 60} <s> " + synthetic.words(8, 3 * i + 1) for i in range(16)) + "\n"
    )
    return str(p)


def _no_bos(model):
    from me_interp.models import LoadedModel

    return LoadedModel(
        model.bridge, model.hf, model.tokenizer, "p", "no", model.dtype, model.device
    )


def test_one_layer_is_held_out(planted, second_prompts):
    """The largest-jump layer is chosen on the selection half and tested on the held-out half, one
    outcome per held-out prompt: computed here by hand from the per-prompt norm ratios."""
    model, plant = planted
    res = me_layer.run(me_layer.Config(prompts=second_prompts), _no_bos(model))
    assert res.location.reference_positions == [1] * 16
    assert _verdicts(res) == PLANTED_SECOND
    units = res.units
    assert units.n == 16 and len(units.select) == len(units.heldout) == 8
    sel, held = claims.halves(16, 0)
    assert units.prompts(units.select) == sel.tolist()
    assert units.prompts(units.heldout) == held.tolist()
    post, pre = np.asarray(res.per_prompt.r_post), np.asarray(res.per_prompt.r_pre)
    logj = np.log(post / np.concatenate([pre[:, :1], post[:, :-1]], axis=1))
    layer = int(np.argmax(logj[sel].mean(0)))
    assert layer == res.selected_jump_layer() == plant.layer
    one = {c.id: c for c in _claims(res)}["me_layer.one_layer"]
    want = {f"prompt {b}": bool(np.argmax(logj[b]) == layer) for b in held}
    assert one.outcomes == want and all(want.values())
    lo, hi = claims.clopper_pearson(8, 8)
    assert one.estimate.n == 8 and (one.estimate.lo, one.estimate.hi) == (lo, hi)
    assert "selected on 8 prompts, tested on the other 8" in one.details


def test_ffn_creates_divides_by_the_attention_factor(planted, many_prompts):
    """The rule holds the attention's factor: where the attention (not the FFN) makes the jump, the
    claim fails; the statistic is the median of R_post / R_mid / max(1, R_mid / R_pre)."""
    import dataclasses

    model, plant = planted
    res = me_layer.run(me_layer.Config(prompts=many_prompts), model)
    L = plant.layer
    pp = {k: np.asarray(v, dtype=np.float64) for k, v in vars(res.per_prompt).items()}
    est = {c.id: c for c in _claims(res)}["me_layer.ffn_creates"].estimate
    want = np.median(
        pp["r_post"][:, L]
        / pp["r_mid"][:, L]
        / np.maximum(1, pp["r_mid"][:, L] / pp["r_pre"][:, L])
    )
    assert est.value == pytest.approx(want)
    moved = dict(pp)  # the attention writes what the FFN wrote: R_mid = R_post at the ME layer
    moved["r_mid"] = pp["r_mid"].copy()
    moved["r_mid"][:, L] = pp["r_post"][:, L] / 1.5
    attn = dataclasses.replace(
        res, per_prompt=me_layer.PerPrompt(**{k: v.tolist() for k, v in moved.items()})
    )
    c = {c.id: c for c in _claims(attn)}["me_layer.ffn_creates"]
    assert c.verdict == F and c.estimate.hi < 1.0


def test_carried_is_not_applicable_at_the_last_layer(planted, many_prompts):
    import dataclasses

    model, plant = planted
    res = me_layer.run(me_layer.Config(prompts=many_prompts), model)
    last = model.n_layers - 1
    ev = dataclasses.replace(res.location.me_event, layer=last)
    loc = dataclasses.replace(res.location, me_layer=last, events=[ev])
    c = {c.id: c for c in _claims(dataclasses.replace(res, location=loc))}["me_layer.carried"]
    assert c.verdict == NA and "last layer" in c.why


@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_no_claim_holds_without_a_massive_activation(fixture, request, many_prompts):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    res = me_layer.run(me_layer.Config(prompts=many_prompts), model)
    assert res.me_layer is None
    assert _verdicts(res) == NULL
    # no layer makes a token's norm jump: the median jump of the largest-jump layer is about 1 (it
    # was counted 0 for every prompt, a zero-width interval that the engine no longer decides on)
    birth = _claims(res)[0].estimate
    assert 0.5 < birth.lo <= birth.hi < 2.0 and birth.n_eff > 1
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
    # the eraser right after the ME layer is judged (no middle layers); every prompt's massive
    # token is <s>, one distinct measurement, so the verdict waits for more units (decoy-fading and
    # the falsifiability table decide it on distinct prefixes)
    assert verdicts["me_layer.sudden_birth"] == H and verdicts["me_layer.carried"] == INC
    carried = {c.id: c for c in _claims(res)}["me_layer.carried"]
    assert carried.estimate.hi < 0.05 and "1 distinct measurement" in carried.why


@pytest.mark.slow
def test_cli_on_bundled_model(tmp_path, capsys, bundled):
    res = me_layer.run(me_layer.Config(out=str(tmp_path)), bundled)
    assert res.me_layer == 11 and res.header.layer_1based == 12
    assert res.header.bos == "auto" and res.bos_prepended is False
    assert 507 in res.location.massive_dims
    assert 100 < res.location.site_ratios["resid_post"][11] < 300
    by_id = {c.id: c for c in _claims(res)}
    # measured with the built-in prompts (82): birth jump 127 [124, 130]; the largest-jump layer of
    # 41 prompts (11) is the largest jump of each of the other 41; FFN factor over the attention's
    # 124 (attention 1.01); carried over layers 12-27 (the massive token's norm 0.985 of the ME
    # layer's; layer 28 erases it, reported apart)
    assert [by_id[i].verdict for i in PLANTED] == [H, H, H, H]
    birth = by_id["me_layer.sudden_birth"].estimate
    assert birth.n == res.n_prompts >= 64 and 80 < birth.lo <= birth.hi < 200
    one = by_id["me_layer.one_layer"]
    assert one.estimate.n == res.n_prompts // 2 and all(one.outcomes.values())
    assert 80 < by_id["me_layer.ffn_creates"].estimate.value < 200
    carried = by_id["me_layer.carried"]
    assert 0.97 < carried.estimate.lo <= carried.estimate.hi < 1.0
    assert "layers 12–27" in carried.details and "erasure (descriptive, not judged): layer 28" in (
        carried.details
    )


@pytest.fixture(scope="module")
def distinct_prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "distinct.txt"
    p.write_text("\n".join(synthetic.distinct_first_prompts(16, 10)) + "\n")
    return str(p)


@pytest.mark.parametrize(
    "name, one_layer, carried",
    [
        ("planted-nobos", H, H),  # one birth layer, carried to the last layer
        ("decoy-twostep", F, None),  # x16 then x60: a second jump over 'jump'
        ("decoy-twostep-even", F, None),  # x20 then x25 (carried: the last layer alone, exactly 1)
        ("decoy-erased", H, H),  # carried over layer 3, erased by layer 4 (reported, not judged)
        ("decoy-fading", H, F),  # x0.6 per layer after the ME layer: no eraser, not carried
    ],
)
def test_one_layer_and_carried_on_constructed_models(name, one_layer, carried, distinct_prompts):
    from me_interp import load_model

    res = me_layer.run(
        me_layer.Config(prompts=distinct_prompts), load_model(f"synthetic:{name}", device="cpu")
    )
    by_id = {c.id: c for c in _claims(res)}
    assert by_id["me_layer.one_layer"].verdict == one_layer
    assert carried is None or by_id["me_layer.carried"].verdict == carried
    assert by_id["me_layer.sudden_birth"].verdict == H and by_id["me_layer.sudden_birth"].placebo
    if name == "decoy-erased":
        assert "erasure (descriptive, not judged): layer 4" in by_id["me_layer.carried"].details
