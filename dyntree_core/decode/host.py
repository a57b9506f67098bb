"""The one way the device-side decode step reads the device: ``fetch``.

Every device -> host read of a device-side step goes through ``fetch(*tensors)``: the tensors are
copied in one batch and the host waits once (one synchronisation on CUDA, whatever the number of
tensors). Keeping reads here makes them countable: tests replace ``fetch`` with a recording stub
and assert the number of synchronisations per step.
"""

from __future__ import annotations

import numpy as np
import torch

from . import op_count


def fetch(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Host copies of ``tensors`` (any devices) as numpy arrays, with one wait for the device."""
    op_count.on_fetch()  # one read; what follows is host data
    out = [t.detach().to("cpu", non_blocking=True) for t in tensors]
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()
    return [o.numpy() for o in out]
