"""gigashuffle: one node-wide shared-memory shuffle buffer for PyTorch training, coordinated through Redis."""

import numpy as np
import torch

from .config import DataloaderConfig
from .errors import (
    AttachError,
    ConfigMismatchError,
    GigashuffleError,
    QueueInUseError,
    QueueStateLostError,
    RedisUnavailableError,
    SchemaError,
    TamperedMetadataError,
    WorkerDied,
)
from .loader import MultiprocessShuffledDataloader
from .schema import INDEX_KEY
from .slottable import ShuffleBufferStats

Buffer = list[dict[str, torch.Tensor | np.ndarray]]
"""What a dataset yields: a chunk of rows, as groups of named fields sharing their first dimension."""

__version__ = "0.1.0"

__all__ = [
    "INDEX_KEY",
    "AttachError",
    "Buffer",
    "ConfigMismatchError",
    "DataloaderConfig",
    "GigashuffleError",
    "MultiprocessShuffledDataloader",
    "QueueInUseError",
    "QueueStateLostError",
    "RedisUnavailableError",
    "SchemaError",
    "ShuffleBufferStats",
    "TamperedMetadataError",
    "WorkerDied",
    "__version__",
]
