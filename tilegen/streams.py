"""Side CUDA streams for work that may overlap the launch stream's (the Gluon backward's head
groups beside each other)."""

from __future__ import annotations

import torch

_SIDE: dict[tuple[int, int], torch.cuda.Stream] = {}


def side_stream(device: torch.device, which: int = 0) -> torch.cuda.Stream:
    """Side stream number `which` of `device`, created once (streams are not freed, so one
    per device and number rather than one per call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE.get((index, which))
    if stream is None:
        stream = _SIDE[(index, which)] = torch.cuda.Stream(device=index)
    return stream
