"""How the device-side decode step reads the device: ``fetch`` and ``Flags``.

Every device -> host read of a device-side step goes through ``fetch(*tensors)``: the tensors are
copied in one batch and the host waits once (one synchronisation on CUDA, whatever the number of
tensors). The one other read is a ``Flags`` read: a one-element result copied behind the programs
that made it and read while the programs launched after them still run (the wait is for that copy's
event, not for the stream), so the device is not left idle by it. Keeping reads here makes them
countable (``op_count``): tests assert the number of each per step.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import op_count


def fetch(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Host copies of ``tensors`` (any devices) as numpy arrays, with one wait for the device."""
    op_count.on_fetch(sum(t.numel() * t.element_size() for t in tensors))  # one read; what follows is host data
    out = [t.detach().to("cpu", non_blocking=True) for t in tensors]
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()
    return [o.numpy() for o in out]


class Flags:
    """``n`` one-element booleans the host reads while later programs run.

    ``post(i, t)`` queues a copy of the device's ``t`` (``[1]`` bool) into host slot ``i`` behind the
    work launched so far (on CUDA into page-locked memory, with an event after it); ``read(i)`` waits
    for that copy only and returns the value. Slot views and the event objects are made once, so a
    post is one dispatched op and a read none.
    """

    def __init__(self, n: int, device: torch.device):
        cuda = device.type == "cuda"
        self._device = device
        self._host = torch.zeros(n, dtype=torch.bool, pin_memory=cuda)
        self._slots = [self._host[i:i + 1] for i in range(n)]
        self._np = self._host.numpy()
        self._events: list[Optional[torch.cuda.Event]] = [torch.cuda.Event() if cuda else None for _ in range(n)]

    def post(self, i: int, t: torch.Tensor) -> None:
        self._slots[i].copy_(t, non_blocking=True)
        event = self._events[i]
        if event is not None:
            event.record(torch.cuda.current_stream(self._device))

    def read(self, i: int) -> bool:
        op_count.on_flag_read()
        event = self._events[i]
        if event is not None:
            event.synchronize()
        return bool(self._np[i])
