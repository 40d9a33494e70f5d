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
# # Attention sinks and the ME layer
#
# This notebook loads the bundled model (SmolLM2-135M-Instruct), finds the layer where the massive
# activation is born (the *ME layer*), looks at attention patterns and sink heads before and after it
# in CircuitsVis (the massive token is marked ★), and applies WeMask (zeroing some dims of the massive
# token's attention input) to watch the sink weaken and the attention entropy change. Section 4 has
# sliders (ipywidgets) for layer, head, mask rate, variant and prompt; without ipywidgets, edit the
# parameter cell and re-run it. Install the extras with `pip install 'me_interp[notebook]'`; the
# viewer renders offline (the CircuitsVis JavaScript is inlined from the installed package).
#
# The source of this notebook is `experiments/notebooks/attention_sinks.py` (jupytext percent format);
# the `.ipynb` is generated from it with `jupytext --to ipynb`. Layers are **0-based**.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from me_interp import load_model
from me_interp.interventions.wemask import we_mask
from me_interp.probes import attention_stats, find_me_layer

torch.set_num_threads(1)
model = load_model()  # the bundled model, fp32 on CPU, the tokenizer's own BOS behaviour (none)
model

# %% [markdown]
# ## 1. Where is the massive activation born?

# %%
prompts = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Once upon a time, a small fox lived at the edge of a quiet forest.",
    "def add(a, b):\n    return a + b",
    "Water boils at 100 degrees Celsius at sea level.",
]
batch = model.tokenize(prompts)
loc = find_me_layer(model, batch)
ME = loc.me_layer
print(f"ME layer: {ME} (0-based) = {ME + 1} (1-based); created by the {loc.me_event.site}")
print(f"massive dims: {loc.massive_dims}; positions per prompt: {loc.massive_positions}")
print("norm ratio (massive token / mean of others) per layer:")
print([round(r, 1) for r in loc.site_ratios["resid_post"]])

# %% [markdown]
# ## 2. Attention to the massive token, per layer and head
#
# `attention_stats` gives, for each layer and head, the attention mass that queries 1..T-1 put on
# position 0 (the massive token) and the attention entropy. A *sink head* puts more than 0.3 of its
# attention there (Gu et al.).

# %%
stats = attention_stats(model, batch)
to_sink = stats.to_positions.mean(1)  # [layer, head], mean over prompts
fig = go.Figure(
    go.Heatmap(
        z=to_sink.T.tolist(), colorscale="Viridis", zmin=0, zmax=1, colorbar_title="attention"
    )
)
fig.add_vline(x=ME, line_dash="dash", line_color="red")
fig.update_layout(
    title="Mean attention to the massive token (position 0); dashed: ME layer",
    xaxis_title="layer (0-based)",
    yaxis_title="head",
)
fig

# %%
sink_rate = (to_sink > 0.3).float().mean(-1)
print("share of sink heads (attention to token 0 > 0.3) per layer:")
print([round(x, 2) for x in sink_rate.tolist()])
print(
    f"before the ME layer: {sink_rate[:ME].mean():.2f}; after it: {sink_rate[ME + 1 :].mean():.2f}"
)

# %% [markdown]
# ## 3. Watch the sink form: one head across the layers around the ME layer
#
# The head with the strongest sink two layers after the ME layer, from two layers before the ME layer
# to two after it, for the first prompt. Click a thumbnail to lock it; hover for the values. The
# label above each view gives that head's attention on the ★ token (mean over the queries after it).

# %%
from me_interp import viewer

layer_after = min(ME + 2, model.n_layers - 1)
SINK_HEAD = int(to_sink[layer_after].argmax())
around = list(range(max(ME - 2, 0), min(ME + 3, model.n_layers)))
strip = viewer.attention_view(model, prompts[0], around, [SINK_HEAD])
print(f"head {SINK_HEAD}; massive token(s) at positions {strip.marked}")
print(strip.panels[0].note())
strip

# %% [markdown]
# ## 4. WeMask: zero dims of the massive token's attention input
#
# `weight` masks the dims with the largest pre-attention RMSNorm gain (the paper's text); `activation`
# the dims with the largest normalised activation of the massive token (the authors' released code);
# `random` and `magnitude` are the paper's ablations. The view shows the unmodified run and the masked
# run side by side at one layer (`head = -1`: every head).
#
# **Parameters** (the view without widgets; also what the saved notebook shows): edit and re-run.

# %%
from IPython.display import display

from me_interp.interventions.wemask import VARIANTS

layer, head, rate, variant, prompt = ME + 1, SINK_HEAD, 0.3, "weight", 0


def wemask_view(layer=layer, head=head, rate=rate, variant=variant, prompt=prompt):
    """Unmodified vs WeMask attention at ``layer`` (``head = -1``: all heads) for ``prompts[prompt]``."""
    return viewer.compare_view(
        model,
        prompts[prompt],
        [layer],
        None if head < 0 else [head],
        fwd_hooks=we_mask(model, rate, variant, me_layer=ME),
        label=f"WeMask {variant} r={rate:g} (layers >= {ME})",
    )


view = wemask_view(layer, head, rate, variant, prompt)
for p in view.panels:
    print(f"{p.title}: {p.note()}")
view

# %% [markdown]
# **Sliders.** Scrub `layer` through the ME layer with the mask on (`rate > 0`) and off (`rate = 0`):
# before the ME layer the two panels are identical (the mask starts there); after it the sink
# weakens as more dims are masked. Each change re-runs the two forwards (about a second).

# %%
try:
    import ipywidgets as widgets
except ImportError:  # the plain-parameter view above is the fallback
    widgets = None

if widgets is None:
    print("ipywidgets is not installed: edit the parameter cell above and re-run it")
else:
    controls = {
        "layer": widgets.IntSlider(
            value=layer, min=0, max=model.n_layers - 1, continuous_update=False, description="layer"
        ),
        "head": widgets.Dropdown(
            options=[("all", -1)] + [(str(h), h) for h in range(model.n_heads)],
            value=head,
            description="head",
        ),
        "rate": widgets.FloatSlider(
            value=rate, min=0.0, max=1.0, step=0.05, continuous_update=False, description="rate"
        ),
        "variant": widgets.Dropdown(options=list(VARIANTS), value=variant, description="variant"),
        "prompt": widgets.Dropdown(
            options=[(p[:40], i) for i, p in enumerate(prompts)], value=prompt, description="prompt"
        ),
    }
    shown = widgets.HTML()
    numbers = widgets.HTML()

    def update(change=None):
        v = wemask_view(**{k: w.value for k, w in controls.items()})
        numbers.value = "<br>".join(f"<b>{p.title}</b>: {p.note()}" for p in v.panels)
        shown.value = v.iframe(height=900)

    for w in controls.values():
        w.observe(update, names="value")
    update()
    display(
        widgets.VBox(
            [
                widgets.HBox(list(controls.values())[:3]),
                widgets.HBox(list(controls.values())[3:]),
                numbers,
                shown,
            ]
        )
    )

# %% [markdown]
# Averaged over the prompts, every layer and head:

# %%
masked = attention_stats(model, batch, fwd_hooks=we_mask(model, rate, variant, me_layer=ME))

fig = make_subplots(
    rows=1, cols=2, subplot_titles=["attention to the massive token", "attention entropy (nats)"]
)
for label, s, color in (
    ("unmodified", stats, "steelblue"),
    (f"WeMask {variant} r={rate}", masked, "firebrick"),
):
    fig.add_trace(go.Scatter(y=s.mean_to_positions(), name=label, line_color=color), 1, 1)
    fig.add_trace(
        go.Scatter(y=s.mean_entropy(), name=label, line_color=color, showlegend=False), 1, 2
    )
for c in (1, 2):
    fig.add_vline(x=ME, line_dash="dash", line_color="gray", row=1, col=c)
    fig.update_xaxes(title_text="layer (0-based)", row=1, col=c)
fig.update_layout(title="Sink and entropy with and without WeMask (mean over prompts and heads)")
fig

# %%
before = torch.tensor(stats.mean_to_positions()[ME:]).mean()
after = torch.tensor(masked.mean_to_positions()[ME:]).mean()
print(f"mean attention to the massive token over layers >= {ME}: {before:.3f} -> {after:.3f}")
print(
    "mean entropy over the same layers:",
    f"{torch.tensor(stats.mean_entropy()[ME:]).mean():.3f} -> {torch.tensor(masked.mean_entropy()[ME:]).mean():.3f}",
)

# %% [markdown]
# ## 5. Sweep the mask rate
#
# How the sink responds to the mask rate for each dim selection.

# %%
rates = [0.0, 0.1, 0.3, 0.5, 1.0]
fig = go.Figure()
for v in ("weight", "activation", "random", "magnitude"):
    ys = []
    for r in rates:
        s = attention_stats(model, batch, fwd_hooks=we_mask(model, r, v, me_layer=ME))
        ys.append(float(torch.tensor(s.mean_to_positions()[ME:]).mean()))
    fig.add_trace(go.Scatter(x=rates, y=ys, mode="lines+markers", name=v))
fig.update_layout(
    title=f"Attention to the massive token (layers >= {ME}) vs WeMask rate",
    xaxis_title="mask rate r",
    yaxis_title="mean attention to position 0",
)
fig
