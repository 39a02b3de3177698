"""gigashuffle: one node-wide shared-memory shuffle buffer for PyTorch training, coordinated through Redis."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gigashuffle._version import __version__
from gigashuffle.config import DataloaderConfig
from gigashuffle.errors import (
    AttachError,
    CheckpointError,
    ConfigMismatchError,
    GigashuffleError,
    NodeLockBusy,
    QueueInUseError,
    QueueStateLostError,
    RedisUnavailableError,
    SchemaError,
    TamperedMetadataError,
    WorkerDied,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from gigashuffle.loader import MultiprocessShuffledDataloader
    from gigashuffle.schema import INDEX_KEY
    from gigashuffle.shm.slottable import LockUsage, ShuffleBufferStats
    from gigashuffle.trainer.metrics import LoaderMetrics, WriterMetrics

    # What a dataset yields: a chunk of rows, as groups of named fields sharing their first dimension.
    Buffer = list[dict[str, torch.Tensor | np.ndarray]]

# Importing the package stays free of torch, numpy and redis (config and errors need none of them), so that
# `gigashuffle --help` and tools that only read a config answer at once; these names import on first use.
_LAZY = {
    "MultiprocessShuffledDataloader": ".loader",
    "INDEX_KEY": ".schema",
    "ShuffleBufferStats": ".shm.slottable",
    "LockUsage": ".shm.slottable",
    "LoaderMetrics": ".trainer.metrics",
    "WriterMetrics": ".trainer.metrics",
}


def __getattr__(name: str) -> Any:
    value: Any
    if name == "Buffer":
        import numpy as np
        import torch

        value = list[dict[str, torch.Tensor | np.ndarray]]
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "INDEX_KEY",
    "AttachError",
    "Buffer",
    "CheckpointError",
    "ConfigMismatchError",
    "DataloaderConfig",
    "GigashuffleError",
    "LoaderMetrics",
    "LockUsage",
    "MultiprocessShuffledDataloader",
    "NodeLockBusy",
    "QueueInUseError",
    "QueueStateLostError",
    "RedisUnavailableError",
    "SchemaError",
    "ShuffleBufferStats",
    "TamperedMetadataError",
    "WorkerDied",
    "WriterMetrics",
    "__version__",
]
