from me_interp.probes import locate_me_layer, scan_norms


def test_planted_me_layer(planted, planted_prompts):
    model, plant = planted
    loc = locate_me_layer(scan_norms(model, model.tokenize(planted_prompts)))
    assert loc.me_layer == plant.layer
