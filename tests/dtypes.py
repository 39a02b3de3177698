"""The dtypes a shared buffer holds, and chunks of them with every bit pattern (for tests that compare bytes)."""

from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)),
]
NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Every bit pattern is fair game (NaNs included): the tests that use it compare bytes, not values."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    count = int(np.prod(shape)) * dtype.itemsize
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)
