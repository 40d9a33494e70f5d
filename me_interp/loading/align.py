"""Right-aligning a left-padded batch: each row rolled so its first real token sits at index 0."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def align(x: torch.Tensor, starts: Sequence[int], dims: Sequence[int] = (1,)) -> torch.Tensor:
    """``x`` with each row ``b`` (dim 0) rolled left by ``starts[b]`` along each of ``dims`` (the
    position axes, all of length ``T``): a left-padded row's first real token moves to index 0 and
    its pads to the end. For a ``[batch, pos, ...]`` activation ``dims=(1,)``; for an attention
    pattern ``[batch, head, q, k]`` ``dims=(2, 3)``."""
    T = x.shape[dims[0]]
    idx = (
        torch.arange(T, device=x.device)[None, :]
        + torch.as_tensor(list(starts), device=x.device)[:, None]
    ) % T
    for d in dims:
        shape = [x.shape[0]] + [1] * (x.dim() - 1)
        shape[d] = T
        view = idx.view(shape).expand(*x.shape[:d], T, *x.shape[d + 1 :])
        x = torch.gather(x, d, view)
    return x
