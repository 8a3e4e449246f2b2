"""Host-to-device copies that never make the host wait for the device.

A pass's inputs (token ids, positions, cache slots, block tables, sampling settings) are built as Python lists
on the scheduler thread. ``torch.tensor(values, device="cuda")`` copies them from pageable memory, which CUDA
only does synchronously: the host waits for every kernel queued before the copy, several times a pass. Here the
host side is allocated pinned (from PyTorch's caching host allocator, which pools the blocks and keeps each one
until the copy that reads it has run) and the copy is queued asynchronously on the current stream, so the only
wait left in a pass is the one that brings its results back (``sampler.to_host``).
"""

from __future__ import annotations

from typing import Any

import torch


def upload(values: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (numbers or nested lists of them) as a ``dtype`` tensor on ``device``, without a host sync on
    CUDA; elsewhere the plain ``torch.tensor``."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
