"""Side CUDA streams for work that may overlap the launch stream's (the backward's maps beside
its delta pass, head groups of the Gluon backward beside each other)."""

from __future__ import annotations

import dataclasses
from typing import Any

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


def record_on(obj: Any, stream: torch.cuda.Stream) -> None:
    """`Tensor.record_stream(stream)` for every CUDA tensor in `obj` (tensors, tuples, lists,
    dicts and dataclasses of them): memory allocated on one stream and used on `stream` is not
    handed out again before `stream`'s work on it is done."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            record_on(x, stream)
    elif isinstance(obj, dict):
        for x in obj.values():
            record_on(x, stream)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            record_on(getattr(obj, f.name), stream)
