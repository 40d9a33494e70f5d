"""Which heads' attention to the massive token carries the sink's effect: the per-head question of
activation_patching.

The massive activation matters downstream through attention: later heads attend to the massive token
(the sink) and what they write depends on it. Removing the massive activation (the experiment's
corrupt run) changes the model's next-token distribution; this asks whether that change is carried
by *a few* heads, the ones that attend most to the massive token, or spread over many. The
measurement (:mod:`me_interp.patching.sinkheads`): sink heads chosen on half of the prompts, their
outputs patched together into the corrupt run of the other half, scored by ``KL(clean ‖ patched)``
of the next-token distribution (normalised: clean = 1, corrupt = 0), against as many heads drawn at
random from the *non-sink* heads of the same layers (attention to ``p`` below ``sink_attention``).
Per held-out prompt ``b`` and draw ``s`` the control's statistic is ``(KL_random[b, s] − KL_sink[b])
/ (mean KL_corrupt − mean KL_clean)``, whose mean is the sink heads' restore minus the random heads'.

Patching a head's *pattern* instead would restore that head's own attention to ``p`` by
construction, so the output distribution is the outcome. With the ``first_token`` corruption token
0 differs in every layer, so part of ``KL(clean ‖ corrupt)`` comes from layers before the ME layer,
which no head after it can restore; ``remove_input`` leaves them clean.

The figure (``sink_heads``, :func:`me_interp.plotting.sink_heads`) maps each head's clean
attention to ``p`` and its own restore (patched alone, estimated by attribution patching: exact
patching of every head costs minutes on the bundled model), the sink heads marked. The claims use
exact patching.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from me_interp import claims
from me_interp.patching.corrupt import Corrupted, corrupt_for
from me_interp.patching.sinkheads import measure

_HEADS = (
    "the clean outputs (hook_z, every position) of the k sink heads — the heads after the ME layer "
    "with the most attention to the massive token on the selection half of the prompts — patched "
    "together into the corrupt run"
)
_KL = (
    "normalised KL(clean ‖ run) of the next-token distribution at the last token (clean = 1, "
    "corrupt = 0; ratio of held-out prompt means)"
)


def why_heads(r, why_removed: Callable) -> str | None:
    """Why the sink-heads claims do not apply: the experiment's own reasons (``why_removed``), the
    question not measured, or no sink head (no head after the ME layer attends to ``p`` with at
    least ``sink_attention`` on the selection prompts)."""
    why = why_removed(r) or r.sink_heads_why
    if why is None and r.sink_heads is None:
        why = "the sink-heads question was not measured in this run"
    if why is None:
        most = float(r.sink_heads.selection_attention().max())
        if most < claims.threshold("sink_attention"):
            why = (
                f"no sink head: no head after layer {r.layer} attends to position "
                f"{r.header.position} with at least {claims.threshold('sink_attention'):g} "
                f"(threshold 'sink_attention'; the most: {most:.3g})"
            )
    return why


def specs(name: str, restore_stat: Callable, why_removed: Callable) -> tuple[claims.Spec, ...]:
    """The two sink-heads claims of experiment ``name``."""

    def details(r) -> str:
        return f"corruption {r.corruption}; ME layer {r.layer}; {r.sink_heads.details()}"

    def why_random(r) -> str | None:
        return why_heads(r, why_removed) or r.sink_heads.control_why

    return (
        claims.Spec(
            f"{name}.sink_heads_restore",
            "§2.4, §2.6",
            "The massive activation acts on the output through the heads that attend to it: the "
            "clean outputs of the few heads with the most attention to the massive token (chosen on "
            "other prompts), patched together into the run where the activation never formed, "
            "restore at least half of the clean next-token distribution",
            f"{_KL} of {_HEADS}",
            ">=",
            "restore",
            control="as many random non-sink heads of the same layers (sink_heads_beat_random); "
            "each head alone (figure sink_heads)",
            stat=lambda r: claims.Sample(
                r.sink_heads.rows(), restore_stat, unit="held-out prompts"
            ),
            applies=lambda r: why_heads(r, why_removed),
            details=details,
        ),
        claims.Spec(
            f"{name}.sink_heads_beat_random",
            "§2.4, §2.6",
            "The heads that attend most to the massive token carry its effect on the output more "
            "than heads that do not attend to it: patched together, they restore more of the clean "
            "next-token distribution than as many random non-sink heads of the same layers, by at "
            "least the head_excess threshold",
            f"restore of {_HEADS}, minus that of as many heads drawn at random from the non-sink "
            "heads of the same layers (selection attention to p below sink_attention); per "
            "held-out prompt × random draw (KL_random − KL_sink) / (mean KL_corrupt − mean "
            "KL_clean); two-way (crossed) bootstrap over held-out prompts × draws",
            ">=",
            "head_excess",
            control="random non-sink heads of the same layers (the statistic's baseline)",
            stat=lambda r: claims.Nested(
                r.sink_heads.excess(), unit="held-out prompts", inner="random draws"
            ),
            applies=why_random,
            details=details,
        ),
    )


def measured(cfg, model, clean, cx: Corrupted, layer: int, position: int):
    """``(SinkHeads, None)`` on the clean batch and its corruption ``cx``, or ``(None, why)``."""
    if cfg.n_random == 0:
        return None, "not measured in this run (--n-random 0)"
    try:
        held = partial(corrupt_for, model, cx.corruption, layer, position)
        return measure(
            model,
            clean,
            cx.batch,
            cx.hooks,
            held,
            layer,
            position,
            k=cfg.n_sink_heads,
            n_random=cfg.n_random,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
        ), None
    except claims.NotApplicable as e:
        return None, str(e)
