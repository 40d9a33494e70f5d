# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Causal tests of the ME layer: activation patching and a weight swap
#
# The paper's evidence for the ME layer is mostly correlational. This notebook runs two of
# me_interp's causal experiments from the library API on the bundled model (SmolLM2-135M-Instruct),
# each on a small subsample of the built-in prompts so that it runs in well under a minute:
#
# 1. **activation patching** (`me_interp.experiments.activation_patching`): corrupt the input so the
#    massive activation is not formed, then patch single clean activations back in — which
#    (layer, site) restores it?
# 2. **weight swap** (`me_interp.experiments.weight_swap`): exchange the ME layer's pre-FFN RMSNorm +
#    FFN (the paper's pair) with another layer's — does the emergence move with them?
#
# Every experiment has a `Config` (a dataclass; `python -m me_interp.experiments.NAME --help` lists the
# same fields), `run(cfg, model) -> Result` (no files, no printing), `SPECS` (its claims, judged by
# `claims.judge(SPECS, result)`, each with its interval, rule, control and kind) and `figures(result)` (plotly figures). Layers are
# 0-based. The source of this notebook is `causal_patching.py` (jupytext percent format).

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from me_interp import claims, load_model, viewer
from me_interp.experiments import activation_patching, weight_swap
from me_interp.interventions.causal import remove_massive
from me_interp.probes import find_me_layer

torch.set_num_threads(1)
model = load_model()
model

# %% [markdown]
# ## 1. Activation patching
#
# `corruption="auto"` replaces token 0 by token 1 when that removes the massive activation (else it
# removes the massive token's input to the ME layer). The metric is the signed projection of the
# massive token's state onto the clean massive direction, normalised so that clean = 1 and corrupt = 0:
# a negative cell erases the massive activation, a cell above 1 overshoots it.

# %%
cfg = activation_patching.Config(max_prompts=4, max_tokens=16)
patching = activation_patching.run(cfg, model)
for claim in claims.judge(activation_patching.SPECS, patching):
    kind = f"({claims.KIND_LABEL[claim.kind]}) " if claim.kind != "claim" else ""
    print(kind + claim.line(), end="\n\n")

# %%
patch_figs = activation_patching.figures(patching)
print(sorted(patch_figs))
patch_figs["patching_projection"]

# %% [markdown]
# ## 2. Weight swap
#
# Swap the ME layer's `ffn_path` (pre-FFN RMSNorm gain + FFN) with a few partner layers, and the
# `attn_path` as the control; the heat map gives the ME layer found after each swap.

# %%
swap_cfg = weight_swap.Config(n_prompts=4, max_partners=6, parts=("ffn_path", "attn_path"))
swap = weight_swap.run(swap_cfg, model)
for claim in claims.judge(weight_swap.SPECS, swap):
    print(claim.line(), end="\n\n")

# %%
swap_figs = weight_swap.figures(swap)
swap_figs["me_layer_after_swap"]

# %% [markdown]
# ## 3. The sink after a causal edit
#
# Remove the massive activation (the massive token's ME-layer output set to the other tokens' mean)
# and look at the strongest sink head two layers later, unmodified and edited side by side.

# %%
prompt = "The capital of France is Paris, and the capital of Italy is Rome."
batch = model.tokenize([prompt])
loc = find_me_layer(model, batch)
ME = loc.me_layer
positions = loc.massive_positions[0]
edit = remove_massive(model, batch, ME, positions)
after = min(ME + 2, model.n_layers - 1)
plain = viewer.attention_patterns(model, prompt, after)[after]
head = int(torch.tensor(viewer.mass_on(plain, positions)).argmax())
view = viewer.compare_view(
    model, prompt, [after], [head], fwd_hooks=edit, label="massive activation removed"
)
print(f"ME layer {ME}; massive positions {positions}; head {head} of layer {after}")
for p in view.panels:
    print(f"{p.title}: {p.note()}")
view
