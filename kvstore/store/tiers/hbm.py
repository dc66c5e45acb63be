"""Device-memory tier: one preallocated CUDA pool (torch), carved into slab slots.

Views are device tensors, so a block moves between this tier and a device buffer (an
engine's KV pages) with a device-to-device copy and never touches host memory. torch is
imported only when the tier is built; nothing else in the store needs it.
"""

from __future__ import annotations

from typing import Any

from kvstore.store.tiers.base import Slot
from kvstore.store.tiers.slab import DEFAULT_SLAB_BYTES, SlabTier


def is_cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class HbmTier(SlabTier):
    """HBM tier with a fixed capacity in bytes on one CUDA device.

    `device` is any torch device; "cpu" runs the same code on host memory, which is how
    the tier is tested on machines without a GPU. Raises RuntimeError when `device` is a
    CUDA device and torch or CUDA is missing.
    """

    name = "hbm"

    def __init__(
        self, capacity_bytes: int, slab_bytes: int = DEFAULT_SLAB_BYTES, device: str = "cuda"
    ) -> None:
        if device.startswith("cuda") and not is_cuda_available():
            raise RuntimeError("the HBM tier needs torch with CUDA")
        import torch

        super().__init__(capacity_bytes, slab_bytes)
        self._torch = torch
        self._pool = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=device)

    @property
    def device(self) -> Any:
        return self._pool.device

    def view(self, slot: Slot) -> Any:
        """The slot's bytes as a 1-D uint8 device tensor (no copy)."""
        return self._pool[slot.offset : slot.offset + slot.nbytes]

    def write_from(self, slot: Slot, src: Any) -> None:
        """Copies a tensor's or a host buffer's bytes (contiguous) into the slot."""
        if not isinstance(src, self._torch.Tensor):
            src = self._torch.frombuffer(src, dtype=self._torch.uint8)
        self.view(slot).copy_(self._as_bytes(src), non_blocking=True)

    def read_into(self, slot: Slot, dest: Any) -> None:
        """Copies the slot into a contiguous tensor of exactly `slot.nbytes` bytes."""
        self._as_bytes(dest).copy_(self.view(slot), non_blocking=True)

    def synchronize(self) -> None:
        """Waits for every copy issued so far."""
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)

    def _as_bytes(self, tensor: Any) -> Any:
        if not tensor.is_contiguous():
            raise ValueError("HBM copies need a contiguous tensor")
        return tensor.view(self._torch.uint8).reshape(-1)
