"""Offloaded target: stream decoder-layer weights from pinned host memory through GPU slots.

Public API:
    offload_decoder_layers(model, device="cuda", slots=2, resident_layers="auto") -> OffloadedModel
    OffloadedModel.stats() -> TransferStats(bytes, copy_seconds, wait_seconds, forwards, layers)
    sync_offload_layers / accelerate_offload_layers: the baselines.
``device="cpu"`` runs the identical streaming code with a host stand-in backend (synchronous
copies, no streams, simulated page-locking) for tests; it is not an offload engine and its
timings mean nothing. Pinned host memory is owned (``pinning``): ``OffloadedModel.close()``
releases every registration the handle made; ``pinned_registrations()`` counts the live ones.
"""

from .pinning import CudaCallError, HostBuffer, OffloadError, PinCount, pinned_registrations
from .baselines import BaselineHandle, accelerate_offload_layers, sync_offload_layers
from .layout import HostLayer, LayerLayout
from .model import OffloadedModel, decoder_stack, offload_decoder_layers
from .stats import TransferStats

__all__ = [
    "BaselineHandle",
    "CudaCallError",
    "HostBuffer",
    "PinCount",
    "pinned_registrations",
    "HostLayer",
    "LayerLayout",
    "OffloadError",
    "OffloadedModel",
    "TransferStats",
    "accelerate_offload_layers",
    "decoder_stack",
    "offload_decoder_layers",
    "sync_offload_layers",
]
