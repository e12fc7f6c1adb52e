"""The grammar-mask buffer a rank's sampler reads: allocated once, validated on re-registration.

A step's masks are xgrammar bitmask rows ((rows, ceil(vocab / 32)) int32; a set bit allows a
token). The buffer holds every sampled position a step can have: `max_num_seqs * (1 + k)` with
speculation, one row per verified position. It is registered at start-up; a second
registration must name the same shape, dtype and device, else it raises rather than swapping
the tensor the sampler reads. Across TP ranks `check_ranks_agree` makes the engine fail to
start when any rank registered another shape. No xgrammar import: workers need only torch.
"""

from __future__ import annotations

import torch

MASK_DTYPE = torch.int32


def mask_shape(num_rows: int, vocab_size: int) -> tuple[int, int]:
    return (num_rows, -(-vocab_size // 32))


class VocabMaskBuffer:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.tensor: torch.Tensor | None = None

    def register(
        self, num_rows: int, dtype: torch.dtype = MASK_DTYPE, device: torch.device | None = None
    ) -> tuple[int, ...]:
        shape = mask_shape(num_rows, self.vocab_size)
        device = self.device if device is None else torch.device(device)
        if self.tensor is None:
            self.tensor = torch.full(shape, -1, dtype=dtype, device=device)
            return shape
        have = (tuple(self.tensor.shape), self.tensor.dtype, self.tensor.device)
        if have != (shape, dtype, device):
            raise ValueError(
                f"vocab mask buffer: re-registered as {shape} {dtype} on {device}, but the "
                f"registered buffer is {have[0]} {have[1]} on {have[2]}"
            )
        return shape

    def load(self, bitmask: torch.Tensor) -> torch.Tensor:
        """This step's masks in the registered buffer (its first rows), which the sampler
        reads. Masks that do not fit its shape raise: they are a bug, never resized."""
        if self.tensor is None:
            raise RuntimeError("vocab mask buffer used before register_vocab_mask_buffer")
        rows, width = bitmask.shape
        if (
            width != self.tensor.shape[1]
            or rows > self.tensor.shape[0]
            or (bitmask.dtype != self.tensor.dtype)
        ):
            raise ValueError(
                f"grammar masks {tuple(bitmask.shape)} {bitmask.dtype} do not fit the registered "
                f"buffer {tuple(self.tensor.shape)} {self.tensor.dtype}"
            )
        view = self.tensor[:rows]
        if view.data_ptr() != bitmask.data_ptr():
            view.copy_(bitmask)
        return view


def check_ranks_agree(shapes: list[tuple[int, ...]]) -> None:
    """Every TP rank registered the same mask buffer, or the engine does not start."""
    for rank, shape in enumerate(shapes):
        if tuple(shape) != tuple(shapes[0]):
            raise ValueError(
                f"vocab mask buffer: rank {rank} registered {tuple(shape)} but rank 0 "
                f"registered {tuple(shapes[0])}; every rank must agree"
            )
