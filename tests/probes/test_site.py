"""The Site (probes.site.locate): the one place the massive activation is located.

Positive tests on the planted model (it finds exactly what was planted), negative ones on the twin and
a random tiny Llama (nothing to find: not applicable unless a layer is given), and each derived field
against an independent computation from a plain TransformerLens cache.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from me_interp import claims, names
from me_interp.probes.massive import Criterion, massive_reference
from me_interp.probes.norms import scan_norms
from me_interp.probes.site import NO_MASSIVE, SCAN_SITES, locate, massive_units

PROMPTS = ["w1 w2 w3 w4 w5 w6", "w9 w10 w11 w12 w13 w14", "w30 w31 w32 w33 w34 w35"]


@pytest.fixture(scope="module")
def setup(planted):
    model, plant = planted
    return model, plant, model.tokenize(PROMPTS)


def test_it_finds_the_plant(setup):
    model, plant, batch = setup
    site = locate(model, batch)
    assert (site.layer, site.position, site.dims) == (plant.layer, 0, (plant.massive_dim,))
    assert site.detected and site.massive and not site.given and site.why_not is None
    assert site.reference == (0, 0, 0) and site.token_positions == [[0], [0], [0]]
    # every prompt starts with the same BOS, so its massive token is one measurement
    assert site.units.n == 1 and not site.units.held_out
    assert site.require() == plant.layer
    assert site.to_dict()["layer_1based"] == plant.layer + 1


def test_a_given_scan_gives_the_same_site(setup):
    model, _, batch = setup
    scan = scan_norms(model, batch, SCAN_SITES)
    assert locate(model, batch, scan=scan) == locate(model, batch)


@pytest.mark.parametrize("which", ["twin", "tiny_llama"])
def test_not_applicable_without_a_massive_activation(which, request):
    model = request.getfixturevalue(which)
    model = model[0] if isinstance(model, tuple) else model
    batch = model.tokenize(PROMPTS[:2])
    site = locate(model, batch)
    assert site.layer is None and not site.detected and not site.massive
    assert site.why_not.startswith(NO_MASSIVE)
    with pytest.raises(claims.NotApplicable, match=f"{NO_MASSIVE}.*pass --layer"):
        site.require()
    # a given layer is honoured, and the site says nothing was detected
    given = locate(model, batch, layer=2)
    assert given.layer == 2 and given.given and not given.detected and len(given.dims) == 1
    assert given.require() == 2 and "layer 2 was given" in given.why_not


def test_a_given_layer_before_the_emergence_is_not_massive(setup):
    model, plant, batch = setup
    site = locate(model, batch, layer=plant.layer - 1)
    assert site.detected and not site.at_layer and not site.massive
    assert "no massive activation at the output of the given layer" in site.why_not
    # the reference at that layer, as the probe defines it (position 0 where no token is massive)
    scan = scan_norms(model, batch, SCAN_SITES)
    assert list(site.reference) == massive_reference(scan, Criterion(), plant.layer - 1)


def test_dims_at_a_layer_without_a_massive_token_are_the_largest_value(setup):
    """Independent: the argmax of |h| of the massive token in a plain TL cache, commonest."""
    model, plant, batch = setup
    layer = plant.layer - 1
    site = locate(model, batch, layer=layer)
    _, cache = model.bridge.run_with_cache(batch.tokens, attention_mask=batch.attention_mask)
    h = cache[names.resid_post(layer)].float().abs()[:, site.position]  # [batch d_model]
    assert site.dims == (Counter(h.argmax(-1).tolist()).most_common(1)[0][0],)


def test_a_given_position(setup):
    model, _, batch = setup
    site = locate(model, batch, position=2)
    assert site.reference == (2, 2, 2) and site.position == 2
    with pytest.raises(ValueError, match="outside the shortest prompt"):
        locate(model, batch, position=99)
    with pytest.raises(ValueError, match="out of range"):
        locate(model, batch, layer=99)


def test_units_count_distinct_massive_token_prefixes():
    tokens = torch.tensor([[1, 5, 6], [1, 5, 7], [2, 5, 6], [3, 9, 9]])
    units = massive_units(tokens, [0, 0, 0, 0], seed=0)
    assert units.n == 3 and units.groups == ((0, 1), (2,), (3,))
    assert sorted(units.select + units.heldout) == [0, 1, 2]
    # a later massive token makes the longer prefix the key
    assert massive_units(tokens, [1, 1, 1, 1], seed=0).n == 3
    assert massive_units(tokens, [2, 2, 2, 2], seed=0).n == 4
