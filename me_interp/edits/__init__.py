"""Weight edits as context managers that always restore the original weights.

Every edit is built on :func:`edited_parameters` (save clones, write, restore in ``finally``):

    with swapped_layers(model, a, b, part="ffn"): ...
    with patched_weights(model, source_layer, target_layer, part, source_model=None): ...
    with permuted_gain(model, layer, perm, norm="ffn"): ...
    with flattened_gain(model, layer, alpha, norm="ffn"): ...
    with svd_ablated(model, layer, matrix, k): ...
    with directions_removed(W, SVD.of(W), directions, scale=1.0): ...
    with neurons_ablated(model, layer, neurons): ...
    with down_weights_zeroed(model, [(layer, row, col), ...]): ...

Parts (:data:`PARTS`): the single parts ``attn_norm``, ``ffn_norm``, ``ffn``, ``attn``; ``block``;
the sandwich-norm-only ``post_ffn_norm`` / ``post_attn_norm`` (:data:`~me_interp.edits.core.ALL_PARTS`);
and the composites ``ffn_path`` (``ffn_norm`` + ``ffn`` + ``post_ffn_norm`` where present) and
``attn_path`` (``attn_norm`` + ``attn`` + ``post_attn_norm`` where present).
"""

from me_interp.edits.core import (
    COMPOSITE_PARTS,
    PARTS,
    SINGLE_PARTS,
    check_part,
    edited_parameters,
    part_module,
    part_parameters,
)
from me_interp.edits.ffn import (
    MATRICES,
    SVD,
    Directions,
    check_neurons,
    direction_plan,
    directions_removed,
    down_weights_zeroed,
    energy_matched,
    ffn_matrix,
    ffn_singular_values,
    neurons_ablated,
    random_others,
    svd_ablated,
    top_singular_part,
)
from me_interp.edits.gains import (
    NORMS,
    check_permutation,
    flattened_gain,
    gain,
    gain_parameter,
    permuted_gain,
    random_permutation,
    set_gain,
    top_dims,
    top_dims_permutation,
)
from me_interp.edits.swap import patched_weights, swapped_layers

__all__ = [
    "COMPOSITE_PARTS",
    "MATRICES",
    "NORMS",
    "PARTS",
    "SINGLE_PARTS",
    "SVD",
    "check_neurons",
    "check_part",
    "check_permutation",
    "Directions",
    "direction_plan",
    "directions_removed",
    "down_weights_zeroed",
    "edited_parameters",
    "energy_matched",
    "ffn_matrix",
    "ffn_singular_values",
    "flattened_gain",
    "gain",
    "gain_parameter",
    "neurons_ablated",
    "part_module",
    "part_parameters",
    "patched_weights",
    "permuted_gain",
    "random_others",
    "random_permutation",
    "set_gain",
    "svd_ablated",
    "swapped_layers",
    "top_dims",
    "top_dims_permutation",
    "top_singular_part",
]
