"""The layer-streaming engine: K GPU slots fed from per-layer pinned host buffers.

Schedule. The streamed layers run in a fixed cyclic order ``order = [R, R+1, ..., L-1]``
(layers ``0..R-1`` are resident). Streamed layer execution number ``seq`` (counted across
forwards) runs layer ``order[seq % len(order)]`` out of slot ``seq % K``. When execution
``seq`` is about to start, copies for ``seq .. seq+K-1`` are issued, so layer ``i+1`` (and
``i+2`` with 3 slots) is copied while layer ``i`` computes, and the last layer of a forward
prefetches the first streamed layers of the next forward.

Handshakes (no ``synchronize`` anywhere on the hot path):
  * copy into slot s:  ``copy_stream.wait_event(slot_free[s])`` (compute finished with the
    previous occupant) -> record ``start`` -> ``slot.copy_(pinned, non_blocking)`` -> record
    ``copy_done[s]``;
  * before the layer runs: compute stream records ``ready``, then ``wait_event(copy_done[s])``;
    the layer's parameters are re-pointed (``.data``) at typed views of the slot;
  * after the layer ran: compute stream records ``slot_free[s]``; parameters are re-pointed
    back at the pinned host views (between forwards the model is an ordinary HF model whose
    streamed layers live in host memory).
Slot buffers are allocated once and never freed while the engine lives, so no allocator
block crosses streams (no ``record_stream`` needed); host buffers are never written after
packing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .backend import Backend, Event, OffloadError
from .layout import HostLayer, LayerLayout, point_params
from .stats import StatsAccumulator


class LayerStreamer:
    """Streams ``layers[i]`` for ``i in order`` through ``slots`` device buffers.

    Args:
        backend: CUDA or host stand-in.
        layers: ``{layer index: decoder layer module}`` for the streamed layers.
        host: ``{layer index: HostLayer}`` packed weights (buffers may be shared between layers).
        order: execution order of the streamed layer indices within one forward.
        slots: number of device slot buffers (1 = no overlap: a synchronous baseline).
        stats: the accumulator the consumed copies are reported to.
    """

    def __init__(self, backend: Backend, layers: dict[int, nn.Module], host: dict[int, HostLayer],
                 order: list[int], slots: int, stats: StatsAccumulator):
        if slots < 1:
            raise OffloadError(f"slots must be >= 1, got {slots}")
        if not order:
            raise OffloadError("no streamed layers")
        self.backend, self.layers, self.host, self.order, self.k = backend, layers, host, list(order), int(slots)
        self.stats = stats
        self.slot_nbytes = max(host[i].layout.nbytes for i in order)
        self._slots = [backend.alloc_device(self.slot_nbytes) for _ in range(self.k)]
        self._views: dict[tuple[int, LayerLayout], list[torch.Tensor]] = {}
        self._pos = {idx: p for p, idx in enumerate(self.order)}
        self._slot_free: list[Optional[Event]] = [None] * self.k
        self._copy_start: list[Optional[Event]] = [None] * self.k
        self._copy_done: list[Optional[Event]] = [None] * self.k
        self._consume = 0  # next seq to run
        self._issue = 0  # next seq to copy
        self._active: Optional[tuple[int, int, Optional[Event]]] = None  # (layer, slot, ready)

    # ------------------------------------------------------------------ schedule
    def _seq_layer(self, seq: int) -> int:
        return self.order[seq % len(self.order)]

    def _slot_views(self, slot: int, layout: LayerLayout) -> list[torch.Tensor]:
        key = (slot, layout)
        if key not in self._views:
            self._views[key] = layout.views(self._slots[slot])
        return self._views[key]

    def _issue_copy(self, seq: int) -> None:
        b, slot = self.backend, seq % self.k
        host = self.host[self._seq_layer(seq)]
        n = host.layout.nbytes
        cs = b.copy_stream()
        b.wait(cs, self._slot_free[slot])
        start, done = b.event(True), b.event(True)
        b.record(start, cs)
        b.copy(self._slots[slot][:n], host.buffer.tensor[:n], cs)
        b.record(done, cs)
        self._copy_start[slot], self._copy_done[slot] = start, done

    def _resync(self, idx: int) -> int:
        """Jump the schedule so ``idx`` is the next execution (after an abort or a skipped layer)."""
        self.abort()
        n = len(self.order)
        seq = -(-self._issue // n) * n + self._pos[idx]
        self._consume = self._issue = seq
        return seq

    def drop_prefetch(self) -> None:
        """Forget the copies issued ahead of use: the next forward copies every streamed layer
        itself (a cold start; used to time one forward in isolation)."""
        self.abort()
        n = len(self.order)
        self._consume = self._issue = -(-self._issue // n) * n

    def abort(self) -> None:
        """Forget a half-run layer (exception inside a forward): its params go back to host views."""
        if self._active is not None:
            idx = self._active[0]
            h = self.host[idx]
            point_params(self.layers[idx], h.layout, h.views)
            self._active = None
            self._consume += 1

    # ------------------------------------------------------------------ hooks
    def before(self, idx: int) -> None:
        """Make layer ``idx``'s weights usable on the compute stream (pre-forward hook)."""
        seq = self._consume
        if self._active is not None or self._seq_layer(seq) != idx:
            seq = self._resync(idx)
        b = self.backend
        cur = b.current_stream()
        ready = b.event(True)
        b.record(ready, cur)
        while self._issue < seq + self.k:
            self._issue_copy(self._issue)
            self._issue += 1
        slot = seq % self.k
        b.wait(cur, self._copy_done[slot])
        h = self.host[idx]
        point_params(self.layers[idx], h.layout, self._slot_views(slot, h.layout))
        self._active = (idx, slot, ready)

    def after(self, idx: int) -> None:
        """Release layer ``idx``'s slot once the compute stream is past it (post-forward hook)."""
        if self._active is None or self._active[0] != idx:
            return  # layer called outside the schedule: before() already resynced
        _, slot, ready = self._active
        b = self.backend
        free = b.event(False)
        b.record(free, b.current_stream())
        self._slot_free[slot] = free
        h = self.host[idx]
        point_params(self.layers[idx], h.layout, h.views)
        start, done = self._copy_start[slot], self._copy_done[slot]
        assert start is not None and done is not None
        self.stats.add(h.layout.nbytes, start, done, ready)
        self._active = None
        self._consume += 1

    def close(self) -> None:
        """Wait for in-flight copies and drop the slots."""
        self.abort()
        self.backend.synchronize()
        self._views.clear()
        self._slots = []


def check_inference(args: tuple[Any, ...]) -> None:
    """Streamed weights are overwritten in place: refuse to build an autograd graph through them."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise OffloadError("offloaded layers are inference-only: call the model under torch.no_grad()")
