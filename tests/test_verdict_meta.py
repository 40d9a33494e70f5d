"""Meta-tests of the verdicts: the whole battery on models that lack the mechanism must claim nothing
about it, and on the planted model it must answer exactly what was planted, claim by claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from me_interp import __main__ as cli
from me_interp import claims, report, synthetic

N_PROMPTS = 16

HOLDS, FAILS, NA = claims.HOLDS, claims.FAILS, claims.NOT_APPLICABLE

PLANTED = {
    # layer 2 creates it through its pre-FFN gain dims and one FFN neuron; nothing later writes dim 7
    "me_layer.sudden_birth": HOLDS,
    "me_layer.one_layer": HOLDS,
    "me_layer.ffn_creates": HOLDS,
    "me_layer.carried": HOLDS,
    # the gain dims carry the massive token's energy at layer 2 only
    "mechanism.frac_aligned": HOLDS,
    "mechanism.frac_peak": HOLDS,
    "mechanism.kl_aligned": HOLDS,
    # after layer 2 the token is one-hot on dim 7, whose gain is flat: ΔKL is large at layers 3-4 too,
    # so layer 2 does not stand 3 SDs above the other layers
    "mechanism.kl_peak": FAILS,
    "mechanism.dc_gate_peak": HOLDS,
    "mechanism.dc_up_peak": HOLDS,
    "mechanism.dc_down_peak": HOLDS,
    "mechanism.magnification_peak": HOLDS,
    "mechanism.few_neurons": HOLDS,  # one planted neuron
    # every prompt starts with <s>: the cross-input test has no inputs with different first tokens
    "invariance.state": NA,
    "invariance.beyond_others": NA,
    "invariance.key": NA,
    "invariance.created_at_me": NA,
    "invariance.control": HOLDS,
    # head 0's key reads dim 7 in every layer: the sink exists only after layer 2
    "attention_sinks.sink_downstream": HOLDS,
    "attention_sinks.entropy_drop": HOLDS,
    "attention_sinks.rank_drop_all": HOLDS,
    "attention_sinks.rank_drop_others": FAILS,  # nothing planted collapses the other tokens
    # the planted language model is random: it does not need the sink, so no mask hurts it
    "wemask.small_rate_ppl_unchanged": HOLDS,
    "wemask.small_rate_mc_unchanged": HOLDS,
    "wemask.beats_random": FAILS,
    "wemask.beats_magnitude": FAILS,
    "wemask.activation_like_weight": HOLDS,
    "wemask.full_mask_collapses": FAILS,
    "wemask.full_mask_removes_sink": HOLDS,  # the sink head reads the masked attention input
    "activation_patching.removal": HOLDS,
    "activation_patching.undo": HOLDS,
    "activation_patching.ffn_writes": HOLDS,
    "activation_patching.state_causes_sink": HOLDS,
    "activation_patching.not_rewritten": HOLDS,
    # the mechanism needs the gain on dims 3, 11 and neuron 5: moving either away kills it
    "rmsnorm_permutation.ffn_permutation_removes": HOLDS,
    "rmsnorm_permutation.attn_permutation_keeps": HOLDS,
    "rmsnorm_permutation.top_dims_removes": HOLDS,
    "rmsnorm_permutation.other_dims_keep": HOLDS,
    "rmsnorm_permutation.flatten_removes": HOLDS,
    "ffn_svd_ablation.svd_gate_removes": HOLDS,
    "ffn_svd_ablation.svd_up_removes": HOLDS,
    "ffn_svd_ablation.svd_down_removes": HOLDS,
    "ffn_svd_ablation.svd_gate_random_keeps": HOLDS,
    "ffn_svd_ablation.svd_up_random_keeps": HOLDS,
    "ffn_svd_ablation.svd_down_random_keeps": HOLDS,
    "ffn_svd_ablation.top_neuron_removes": HOLDS,
    "ffn_svd_ablation.top_neurons_remove": HOLDS,
    "ffn_svd_ablation.random_neurons_keep": HOLDS,
    # both the gain and the neuron are needed: only the pair (or the whole block) carries it
    "weight_patching.ffn_path": HOLDS,
    "weight_patching.ffn_norm": FAILS,
    "weight_patching.ffn": FAILS,
    "weight_patching.attn_path": FAILS,
    "weight_patching.attn_norm": FAILS,
    "weight_patching.attn": FAILS,
    "weight_patching.block": HOLDS,
    "weight_swap.ffn_path": HOLDS,
    "weight_swap.ffn_norm": FAILS,
    "weight_swap.ffn": FAILS,
    "weight_swap.attn_path": FAILS,
    "weight_swap.attn_norm": FAILS,
    "weight_swap.attn": FAILS,
    "weight_swap.block": HOLDS,
    "weight_swap.ffn_path_needed": HOLDS,
    # the marker on the gain dims is in the embedding: every depth's input works with layer 2's weights
    "weight_input_cross.row_share": HOLDS,
    "weight_input_cross.row_breadth": HOLDS,
    "weight_input_cross.diagonal": HOLDS,
    "transplant.sink_follows": HOLDS,
    "transplant.second_sink": HOLDS,
    "component_ablation.cap_site": HOLDS,
    "component_ablation.cap_ffn": HOLDS,
    "component_ablation.normalize_product": HOLDS,
    "component_ablation.flatten_gain": HOLDS,
    "component_ablation.cap_ffn_hurts": FAILS,  # the random LM does not use the sink
    "component_ablation.mean_dims_harmless": NA,  # the same <s> everywhere: the mean is the value
    "component_ablation.zero_dims_hurts": FAILS,
    "sink_causality.remove_ffn": HOLDS,
    "sink_causality.remove_all": HOLDS,
    "sink_causality.remove_dims": HOLDS,
    "sink_causality.patch_other": NA,  # the same <s> everywhere: the swap is the identity
}


def _battery(tmp_path_factory, model: str) -> dict:
    root = tmp_path_factory.mktemp(model.replace(":", "_"))
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(synthetic.planted_prompts(N_PROMPTS, 10)) + "\n")
    out = root / "out"
    assert cli.main(["--model", model, "--prompts", str(prompts), "--out", str(out)]) == 0
    state = json.loads((out / report.STATE_FILE).read_text())
    state["out"] = str(out)
    return state


@pytest.fixture(scope="module", params=["synthetic:twin", "synthetic:tiny-llama"])
def null_battery(request, tmp_path_factory):
    return request.param, _battery(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def planted_battery(tmp_path_factory):
    return _battery(tmp_path_factory, "synthetic:planted")


def _claims(state: dict) -> dict[str, dict]:
    out = {}
    for name in report.EXPERIMENTS:
        for c in state["experiments"][name]["claims"]:
            assert c["id"] not in out, f"duplicate claim id {c['id']}"
            out[c["id"]] = c
    return out


def test_null_models_complete_and_claim_nothing(null_battery):
    model, state = null_battery
    statuses = {n: state["experiments"][n]["status"] for n in report.EXPERIMENTS}
    assert set(statuses.values()) <= set(report.FINISHED), statuses
    cs = _claims(state)
    held = [i for i, c in cs.items() if c["kind"] == "claim" and c["verdict"] == claims.HOLDS]
    assert held == [], f"{model}: claims hold on a model without the mechanism: {held}"
    # the existence claim is answered, not skipped: there is no massive activation
    assert any(c["verdict"] == claims.FAILS for c in cs.values())
    na = [c for c in cs.values() if c["verdict"] == claims.NOT_APPLICABLE]
    assert na and all("massive" in c["why"] for c in na)
    html = (Path(state["out"]) / report.REPORT_FILE).read_text()
    assert "not applicable" in html and "failed:" not in html


def test_the_planted_model_gets_exactly_what_was_planted(planted_battery):
    assert all(e["status"] == "done" for e in planted_battery["experiments"].values())
    got = {i: c["verdict"] for i, c in _claims(planted_battery).items()}
    wrong = {i: (got.get(i), v) for i, v in PLANTED.items() if got.get(i) != v}
    assert not wrong, f"(got, expected): {wrong}"
    assert set(got) == set(PLANTED), set(got) ^ set(PLANTED)


def test_every_claim_in_the_battery_is_in_docs(planted_battery):
    specs = {
        s.id
        for n in report.EXPERIMENTS
        for s in __import__(f"me_interp.experiments.{n}", fromlist=["SPECS"]).SPECS
    }
    assert set(_claims(planted_battery)) <= specs
    claims.check_specs(
        s
        for n in report.EXPERIMENTS
        for s in __import__(f"me_interp.experiments.{n}", fromlist=["SPECS"]).SPECS
    )


def test_docs_claims_md_is_current():
    path = Path(__file__).resolve().parents[1] / "docs" / "claims.md"
    assert path.read_text() == report.claims_markdown(), (
        "docs/claims.md is stale: regenerate it (see me_interp.report.claims_markdown)"
    )


def test_forcing_the_planted_layer_on_the_twin_makes_no_claim_hold(twin, tmp_path):
    """With ``--layer`` the experiments skip detection and measure at layer 2 of the twin, which has
    the planted model's weights but no mechanism: nothing may hold there either."""
    import dataclasses
    import importlib

    from me_interp.experiments.common import execute

    model, _ = twin
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(synthetic.planted_prompts(N_PROMPTS, 10)) + "\n")
    held, judged = [], []
    for name in report.EXPERIMENTS:
        module = importlib.import_module(f"me_interp.experiments.{name}")
        if "layer" not in {f.name for f in dataclasses.fields(module.Config)}:
            continue
        cfg = module.Config(prompts=str(prompts), out=str(tmp_path), layer=2)
        outcome = execute(module, cfg, model)
        judged.append(name)
        held += [c.id for c in outcome.claims if c.kind == "claim" and c.verdict == claims.HOLDS]
    assert len(judged) >= 8, judged
    assert held == [], f"claims hold at a forced layer of a model without the mechanism: {held}"
