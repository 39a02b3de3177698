"""Datasets for the chaos suite, importable by the loader's writer processes (so: module level, picklable).

Every row carries an id that is unique per writer *process*: ``pid * 2**32 + counter``. A writer respawned after
a SIGKILL restarts its iterator from scratch but under a new pid, so any id seen twice means the loader handed
out one slot twice. ``x`` is ``id + arange(WIDTH)`` and ``check`` a hash of the id, so a row whose fields come
from two different writes (a torn row) fails :func:`check_batch`.

``ChaosDataset`` can stall on a gate directory (``allowance`` chunks per process, then it touches
``waiting-<pid>`` and waits for ``open``) so a test can hold the buffer below the mixing threshold, and can
misbehave in the ways listed in :data:`FAULTS` after ``fault_after`` good chunks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

ID_SHIFT = 2**32
WIDTH = 6
_MIX = 0x9E3779B97F4A7C15 & (2**62 - 1)
GATE_LIMIT_S = 240.0  # a stalled writer gives up eventually, so no test can leave one spinning forever

FAULTS = (
    "ragged",  # one field of a chunk has fewer rows than the others
    "extra_field",  # a later chunk has a field the first chunk had not
    "dtype",  # a later chunk changes a field's dtype
    "shape",  # a later chunk changes a field's row shape
    "non_tensor",  # a field is a Python list
    "tensors_chunk",  # a chunk of bare tensors, not of dicts of them
    "complex",  # a complex tensor
    "object_np",  # a numpy array of Python objects
    "str_np",  # a numpy array of str
    "writer_mismatch",  # writers disagree from their first chunk: odd worker ids yield float64 'x'
    "empty",  # only empty chunks, forever
    "raise_iter",  # __iter__ raises before the first chunk
    "raise_late",  # raises after fault_after good chunks
)


def check_of(ids: torch.Tensor) -> torch.Tensor:
    return (ids * 2654435761 + 12345) ^ _MIX


def make_chunk(ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    x = ids.unsqueeze(1) + torch.arange(WIDTH, dtype=torch.int64)
    return [{"x": x, "id": ids, "check": check_of(ids)}, {"y": (ids % 1000).to(torch.float32).unsqueeze(1)}]


def writer_of(row_id: int) -> int:
    """The pid of the writer process that produced ``row_id``."""
    return row_id // ID_SHIFT


def check_batch(batch: list[dict[str, torch.Tensor]], bs: int, shuffle_size: int) -> list[int]:
    """Assert that no row of ``batch`` is torn and its slot indices are in range; return its ids."""
    from gigashuffle import INDEX_KEY

    group, extra = batch[0], batch[1]
    ids = group["id"]
    assert ids.shape == (bs,), ids.shape
    torn = (group["x"] - torch.arange(WIDTH, dtype=torch.int64) != ids.unsqueeze(1)).any(dim=1)
    torn |= group["check"] != check_of(ids)
    torn |= extra["y"][:, 0] != (ids % 1000).to(torch.float32)
    assert not torn.any(), f"torn rows: ids {ids[torn].tolist()}"
    index = group[INDEX_KEY]
    assert ((index >= 0) & (index < shuffle_size)).all(), index.tolist()
    return [int(i) for i in ids.tolist()]


def _explode_in_iter() -> None:
    raise ValueError("chaos dataset exploded in __iter__ before the first chunk")


def _explode_late(count: int) -> None:
    raise RuntimeError(f"chaos dataset exploded after {count} good chunks")


class ChaosDataset(IterableDataset):  # type: ignore[type-arg]
    def __init__(
        self,
        rows: int = 8,
        gate_dir: str | None = None,
        allowance: int = 0,
        fault: str | None = None,
        fault_after: int = 0,
        chunk_delay_s: float = 0.0,
        mark_dir: str | None = None,
    ) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        self.rows = rows
        self.gate_dir = gate_dir
        self.allowance = allowance
        self.fault = fault
        self.fault_after = fault_after
        self.chunk_delay_s = chunk_delay_s
        self.mark_dir = mark_dir  # where the first fault leaves ``fault-<pid>`` holding its wall-clock time

    def _mark_fault(self) -> None:
        if self.mark_dir is not None:
            path = Path(self.mark_dir) / f"fault-{os.getpid()}"
            if not path.exists():
                # Atomic: the test may read the directory while a second writer is still writing its stamp.
                partial = path.parent / f".{path.name}.tmp"  # not matched by the test's fault-* glob
                partial.write_text(repr(time.time()))
                partial.replace(path)

    # -- the gate ---------------------------------------------------------------------------------------------
    def _wait_at_gate(self) -> None:
        assert self.gate_dir is not None
        gate = Path(self.gate_dir)
        if (gate / "open").exists():
            return
        (gate / f"waiting-{os.getpid()}").touch()
        deadline = time.monotonic() + GATE_LIMIT_S
        while not (gate / "open").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {gate} stayed shut for {GATE_LIMIT_S}s")
            time.sleep(0.01)

    # -- chunks -----------------------------------------------------------------------------------------------
    def __iter__(self) -> Any:
        if self.fault == "raise_iter":
            self._mark_fault()
            _explode_in_iter()
        base = os.getpid() * ID_SHIFT
        count = 0
        while True:
            if self.gate_dir is not None and count >= self.allowance:
                self._wait_at_gate()
            if self.chunk_delay_s:
                time.sleep(self.chunk_delay_s)
            ids = torch.arange(base + count * self.rows, base + (count + 1) * self.rows, dtype=torch.int64)
            chunk = make_chunk(ids)
            if self.fault is not None and count >= self.fault_after:
                chunk = self._spoil(chunk, count)
            count += 1
            yield chunk

    def _spoil(self, chunk: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
        self._mark_fault()
        group = chunk[0]
        fault = self.fault
        if fault == "ragged":
            group["check"] = group["check"][:-1]  # 'check' comes after 'x' and 'id': it is the one named
        elif fault == "extra_field":
            group["surprise"] = group["id"].clone()
        elif fault == "dtype":
            group["x"] = group["x"].to(torch.int32)
        elif fault == "shape":
            group["x"] = torch.cat([group["x"], group["x"]], dim=1)
        elif fault == "non_tensor":
            group["x"] = group["x"].tolist()
        elif fault == "tensors_chunk":
            return [group["x"], group["id"]]
        elif fault == "complex":
            group["x"] = group["x"].to(torch.complex64)
        elif fault == "object_np":
            group["x"] = np.array([object() for _ in range(len(group["id"]))], dtype=object)
        elif fault == "str_np":
            group["x"] = np.array([str(i) for i in group["id"].tolist()])
        elif fault == "writer_mismatch":
            info = get_worker_info()
            if info is not None and info.id % 2 == 1:
                group["x"] = group["x"].to(torch.float64)  # exact for these ids, so its rows check out if read
        elif fault == "empty":
            return [{key: value[:0] for key, value in g.items()} for g in chunk]
        elif fault == "raise_late":
            _explode_late(count)
        return chunk
