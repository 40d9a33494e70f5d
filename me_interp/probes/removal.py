"""Was a removal a removal? The edited token's norm ratio against the ``ordinary_ratio`` threshold.

An edit that is said to *remove* the massive activation (reset the massive dims, cap the FFN output,
move the massive component away) must leave the edited token ordinary: its norm ratio
``R = ‖h_p‖ / mean_{t≠p} ‖h_t‖`` (prompt means) at most ``ordinary_ratio`` (a threshold of
:data:`me_interp.claims.THRESHOLDS`) at every layer it is read. A fraction of the excess is not
enough: ``(R − 1)`` down to 9 % of the excess can leave a token 15 × the others, which still draws
an attention sink, so its effects cannot be told from those of an intact massive token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from me_interp import claims


def not_ordinary(ratios: Mapping[str, Sequence[float]], edit: str) -> str | None:
    """Why ``edit`` did not remove the massive activation (``None``: it did): ``ratios`` maps where
    the ratio was read (``"the ME layer"``, ``"the last layer"``) to the edited token's per-prompt
    norm ratios after the edit; each prompt mean must be at most ``ordinary_ratio``."""
    t = claims.threshold("ordinary_ratio")
    means = {where: float(np.mean(r)) for where, r in ratios.items()}
    over = {where: m for where, m in means.items() if not m <= t}
    if not over:
        return None
    said = ", ".join(f"{m:.3g}× at {where}" for where, m in means.items())
    return (
        f"{edit} did not make the massive token ordinary: its norm ratio to the other tokens is "
        f"{said} (> {t:g}, threshold 'ordinary_ratio'), so what follows is not that of a model "
        "without it"
    )
