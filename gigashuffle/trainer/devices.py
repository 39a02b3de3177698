"""The device a rank's batches go to, checked against this machine before the loader starts anything; ``"cuda"`` is
the rank's own GPU (NOTE [ GPU placement ] in trainer/pinning.py)."""

from __future__ import annotations

import torch

from gigashuffle.config import DataloaderConfig
from gigashuffle.trainer.cudaops import CudaOps


def _cuda_missing(field: str, value: object, fix: str) -> ValueError:
    why = (
        "this torch is built without CUDA"
        if torch.version.cuda is None
        else "torch.cuda.is_available() is False (no GPU visible: check CUDA_VISIBLE_DEVICES and the driver)"
    )
    return ValueError(f"DataloaderConfig.{field}={value!r} needs CUDA, but {why} (torch {torch.__version__}); {fix}")


def resolve_device(config: DataloaderConfig, cuda: CudaOps | None = None) -> torch.device | None:
    """The device batches go to (None: they stay in the ring); ValueError if this machine lacks it. ``"cuda"`` is
    the rank's own GPU (NOTE [ GPU placement ]), never the device current when the loader is built."""
    if config.device is None:
        return None
    cuda = cuda or CudaOps()
    device = torch.device(config.device)
    if device.type == "cpu":
        return device
    if not cuda.is_available():
        raise _cuda_missing(
            "device", config.device, "install a CUDA build of torch and run on a GPU machine, or use device='cpu'"
        )
    count = cuda.device_count()
    if device.index is None:
        if (own := own_gpu(config.local_rank, count)) is not None:
            return torch.device("cuda", own)
        raise ValueError(
            f"DataloaderConfig.device='cuda' is ambiguous: local_rank={config.local_rank} sees {count} GPUs; give "
            "each rank one GPU (CUDA_VISIBLE_DEVICES) or name it: device='cuda:N' with N below that"
        )
    if device.index >= count:
        raise ValueError(
            f"DataloaderConfig.device={config.device!r} is invalid: this process sees {count} GPUs (after "
            "CUDA_VISIBLE_DEVICES); use device='cuda' (the rank's own GPU: cuda:{local_rank}, or cuda:0 when each "
            "rank sees one) or an index below that"
        )
    return device


def own_gpu(local_rank: int, count: int) -> int | None:
    """The rank's own GPU among the ``count`` it sees: the only one (``CUDA_VISIBLE_DEVICES`` per rank), else
    ``cuda:{local_rank}``; None when ``local_rank`` is past them (no answer)."""
    if count == 1:
        return 0
    return local_rank if local_rank < count else None
