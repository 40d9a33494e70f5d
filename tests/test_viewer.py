"""The CircuitsVis attention viewer: patterns, the marked massive token, side-by-side runs, offline HTML."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from me_interp import names, synthetic, viewer
from me_interp.probes import attention_stats, find_me_layer

pytest.importorskip("circuitsvis")


@pytest.fixture(scope="module")
def prompt():
    return synthetic.planted_prompts(1, 10)[0]


def _render_calls(fragment: str) -> list[tuple[str, str, dict]]:
    """(div id, element, props) of every CircuitsVis.render call in a fragment."""
    calls = re.findall(r'CircuitsVis\.render\(("[^"]+"), CircuitsVis\.(\w+), (\{.*\})\);', fragment)
    return [(json.loads(i), el, json.loads(props)) for i, el, props in calls]


def test_patterns_match_a_cached_forward(planted, prompt):
    model, plant = planted
    got = viewer.attention_patterns(model, prompt, [1, plant.layer + 1])
    batch = model.tokenize([prompt])
    _, cache = model.bridge.run_with_cache(batch.tokens, attention_mask=batch.attention_mask)
    for layer, pattern in got.items():
        ref = cache[names.pattern(layer)][0]
        assert pattern.shape == (model.n_heads, batch.tokens.shape[1], batch.tokens.shape[1])
        torch.testing.assert_close(pattern, ref.float(), rtol=0, atol=0)


def test_marked_token_is_the_detected_massive_token(planted, prompt):
    model, plant = planted
    marked = viewer.massive_positions(model, prompt)
    loc = find_me_layer(model, model.tokenize([prompt]))
    assert loc.me_layer == plant.layer and marked == loc.massive_positions[0] == [0]
    labels = viewer.token_labels(model, prompt, marked)
    ids = model.tokenize([prompt]).tokens[0].tolist()
    assert [lab.startswith(viewer.MARK) for lab in labels] == [i in marked for i in range(len(ids))]
    assert labels[1] == model.tokenizer.decode([ids[1]])


def test_no_mark_without_a_massive_activation(twin, prompt):
    model, _ = twin
    assert viewer.massive_positions(model, prompt) == []
    view = viewer.attention_view(model, prompt, 3, [0])
    assert view.marked == [] and not any(viewer.MARK in t for t in view.panels[0].tokens)
    assert "no massive token detected" in view.panels[0].note()


def test_mass_on_the_marked_token_matches_attention_stats(planted, prompt):
    model, plant = planted
    layers = list(range(model.n_layers))
    view = viewer.attention_view(model, prompt, layers)
    stats = attention_stats(model, model.tokenize([prompt]), positions=[0])
    ref = stats.to_positions[:, 0, :].flatten().tolist()  # [layer head] in view order
    assert view.panels[0].mass == pytest.approx(ref, abs=1e-6)
    # the planted sink head attends to the massive token only from the ME layer on
    sink = view.panels[0].mass
    H = model.n_heads
    assert sink[(plant.layer + 1) * H + plant.sink_head] > 0.9
    assert sink[(plant.layer - 1) * H + plant.sink_head] < 0.5


def test_compare_view_changes_only_the_masked_layers(planted, prompt):
    from me_interp.interventions.wemask import we_mask

    model, plant = planted
    hooks = we_mask(model, 1.0, "weight", me_layer=plant.layer)
    layers = [plant.layer - 1, plant.layer + 1]
    view = viewer.compare_view(
        model, prompt, layers, [plant.sink_head], fwd_hooks=hooks, label="WeMask r=1"
    )
    plain, masked = view.panels
    assert [p.title for p in view.panels] == ["unmodified", "WeMask r=1"]
    assert plain.head_names == [f"L{layer} H{plant.sink_head}" for layer in layers]
    # before the masked layers: bit-identical (negative); after: the sink is gone (positive)
    assert torch.equal(plain.attention[0], masked.attention[0])
    assert plain.mass[1] > 0.9 and masked.mass[1] < 0.5 * plain.mass[1]
    # the same tokens are marked in both panels (those of the unmodified prompt)
    assert plain.tokens == masked.tokens and plain.tokens[0].startswith(viewer.MARK)


def test_html_is_offline_and_carries_the_props_circuitsvis_expects(planted, prompt, tmp_path):
    import circuitsvis.attention

    model, plant = planted
    view = viewer.compare_view(
        model, prompt, plant.layer + 1, runs={"a": [], "b": [], "c": []}, massive=[0]
    )
    path = view.save_html(tmp_path / "view.html")
    page = path.read_text(encoding="utf-8")
    # the bundle is inlined once, whatever the number of panels; nothing loads from a network
    assert page.count("var CircuitsVis=") == 1
    assert "unpkg.com" not in page and "cdn.jsdelivr" not in page
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert not re.search(r"""\bimport\b[^;]*\bfrom\s*["']https?:""", page)
    calls = _render_calls(view.fragment())
    assert len(calls) == 3 and all(el == viewer.ELEMENT for _, el, _ in calls)
    props = calls[0][2]
    torch.testing.assert_close(
        torch.tensor(props["attention"]), view.panels[0].attention, atol=1e-4, rtol=0
    )
    # the prop names are those of circuitsvis' own attention_heads in the installed version
    ref = circuitsvis.attention.attention_heads(
        attention=view.panels[0].attention,
        tokens=view.panels[0].tokens,
        attention_head_names=view.panels[0].head_names,
        max_value=1.0,
        min_value=0.0,
        mask_upper_tri=True,
    ).local_src
    ref_props = json.loads(re.search(r"CircuitsVis\.AttentionHeads,\s*(\{.*\})\s*\)", ref).group(1))
    assert set(ref_props) == set(props)
    assert ref_props["tokens"] == props["tokens"]


def test_iframe_holds_the_whole_page_escaped(planted, prompt):
    import html

    model, _ = planted
    view = viewer.attention_view(model, prompt, 0, [0])
    frame = view.iframe(600)
    assert frame.startswith("<iframe srcdoc=") and "height:600px" in frame
    assert "<script" not in frame  # inside the attribute, escaped
    doc = html.unescape(frame[len('<iframe srcdoc="') : frame.index('" style=')])
    assert _render_calls(doc)[0][2] == _render_calls(view.to_html())[0][2]
    with pytest.raises(ValueError, match="height"):
        view.iframe(0)


def test_script_breaking_tokens_are_escaped(planted):
    model, _ = planted
    view = viewer.attention_view(model, "</script> <b>", 0, [0], massive=[])
    fragment = view.fragment()
    assert fragment.count("</script>") == 1  # only the closing tag of the one module script
    assert _render_calls(fragment)[0][2]["tokens"] == view.panels[0].tokens


def test_bad_input(planted, prompt):
    model, _ = planted
    with pytest.raises(ValueError, match="out of range"):
        viewer.attention_view(model, prompt, model.n_layers)
    with pytest.raises(ValueError, match="head 99 is out of range"):
        viewer.attention_view(model, prompt, 0, [99])
    with pytest.raises(ValueError, match="heads is empty"):
        viewer.attention_view(model, prompt, 0, [])
    with pytest.raises(ValueError, match="layers is empty"):
        viewer.attention_view(model, prompt, [])
    with pytest.raises(ValueError, match="either runs"):
        viewer.compare_view(model, prompt, 0, runs={"a": []}, fwd_hooks=[])
    with pytest.raises(ValueError, match="outside the prompt"):
        viewer.token_labels(model, prompt, [500])
    with pytest.raises(TypeError, match="prompt"):  # our check, or the run-time type check
        viewer.attention_view(model, ["a b"], 0)


def test_missing_circuitsvis_names_the_extra(planted, prompt, monkeypatch):
    model, _ = planted
    view = viewer.attention_view(model, prompt, 0, [0])  # measuring needs no circuitsvis
    monkeypatch.setitem(sys.modules, "circuitsvis", None)
    with pytest.raises(ImportError, match=r"me_interp\[notebook\]"):
        view.to_html()
