"""A loader serves the process that opened it. A fork of the training process (a DataLoader worker, a pool, an
``os.fork()``) holds a copy of every loader open in it: the copy refuses every use, its close touches nothing of the
parent's loader, and the fork lets go of the node buffer and the slot table at once, keeping the reader rings its
inherited batches are views of (NOTE [ Forks of the trainer ] in trainer/forks.py). A pickle of a loader is refused."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import leaks
import pytest
import torch
from datasets import PassIds, take
from forked import fork_child, wait_child
from torch.utils.data import DataLoader, Dataset

from gigashuffle import DataloaderConfig, GigashuffleError, MultiprocessShuffledDataloader

FORK_REFUSAL = "is a fork of it"


def _node_memory() -> set[tuple[str, int, str]]:
    """The gigashuffle memfds this process holds, as (kind, inode, how): kind ``buffer``, ``slots`` or ``ring``, how
    ``mapped`` or ``fd``. Inodes tell this test's loader from what earlier tests of the process left."""
    held: set[tuple[str, int, str]] = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        kind = _kind(fields[5] if len(fields) == 6 else "")
        if kind:
            held.add((kind, int(fields[4]), "mapped"))
    for fd, target in leaks.open_fds():
        if kind := _kind(target):
            held.add((kind, os.fstat(fd).st_ino, "fd"))
    return held


def _kind(name: str) -> str:
    for kind in ("buffer", "slots", "ring"):
        if name.startswith(f"/memfd:gigashuffle-{kind} "):
            return kind
    return ""


def _of_files(held: set[tuple[str, int, str]], files: set[tuple[str, int]]) -> set[tuple[str, str]]:
    """(kind, how) of what ``held`` holds of ``files`` (kind, inode)."""
    return {(kind, how) for kind, inode, how in held if (kind, inode) in files}


def _ids_sum(batches: list[Any]) -> int:
    return sum(int(batch[0]["id"].sum()) for batch in batches)


@contextlib.contextmanager
def _loader_with_its_buffer_mapped(
    redis_url: str,
) -> Iterator[tuple[MultiprocessShuffledDataloader, Iterator[Any], list[Any], set[tuple[str, int]]]]:
    """A 1+1 loader that saves rows at a checkpoint, its iterator, 3 batches taken and kept (views of its reader's
    ring), and its memfds as (kind, inode), told from what the process held before. After its ``state_dict()`` the
    trainer has the whole buffer mapped (the rank that copies rows does), and it holds fds of the buffer and table."""
    config = DataloaderConfig(
        bs=8, shuffle_size=256, queue_name=f"fork-{uuid.uuid4().hex[:8]}", num_writers=1, num_readers=1,
        redis_url=redis_url, checkpoint_rows="saved",
    )  # fmt: skip
    before = {(kind, inode) for kind, inode, _how in _node_memory()}
    with MultiprocessShuffledDataloader(PassIds(4000, 40), config) as loader:
        it = iter(loader)
        kept = take(it, 3)
        loader.state_dict()
        held = _node_memory()
        files = {(kind, inode) for kind, inode, _how in held} - before
        assert {("buffer", "mapped"), ("buffer", "fd"), ("slots", "fd")} <= _of_files(held, files), held
        yield loader, it, kept, files


def test_a_fork_of_the_trainer_leaves_the_loader_to_its_parent_and_holds_no_node_buffer(
    redis_url: str, runtime_dir: Path
) -> None:
    with _loader_with_its_buffer_mapped(redis_url) as (loader, it, kept, files):
        processes = loader.child_pids()
        for copy_of in (pickle.dumps, copy.copy):
            with pytest.raises(TypeError, match=r"cannot be pickled or copied.*DataloaderConfig"):
                copy_of(loader)
        report_r, report_w = os.pipe()

        def in_the_fork() -> int:
            os.close(report_r)
            memory = sorted(_of_files(_node_memory(), files))
            report: dict[str, Any] = {"memory": memory, "kept": _ids_sum(kept), "refused": []}
            uses: list[tuple[str, Callable[[], Any]]] = [
                ("next", lambda: next(it)),
                ("iter", lambda: iter(loader)),
                ("stats", loader.stats),
                ("state_dict", loader.state_dict),
                ("child_pids", loader.child_pids),
            ]
            for name, use in uses:
                try:
                    use()
                except GigashuffleError as exc:
                    if FORK_REFUSAL in str(exc):
                        report["refused"].append(name)
            loader.close()  # what the fork's exit does: its with-block unwound, or the exit hook
            os.write(report_w, json.dumps(report).encode())
            return 0

        child = fork_child(in_the_fork)
        os.close(report_w)
        status = wait_child(child)
        with os.fdopen(report_r, "rb") as pipe:
            report = json.loads(pipe.read() or b"{}")
        assert os.waitstatus_to_exitcode(status) == 0 and report, f"the fork failed: status {status}"

        memory = {(kind, how) for kind, how in report["memory"]}
        assert not {kind for kind, _how in memory} & {"buffer", "slots"}, f"the fork holds the node's: {memory}"
        assert ("ring", "mapped") in memory, "the fork lost the ring its inherited batches are views of"
        assert report["kept"] == _ids_sum(kept), "a batch inherited by the fork read other rows there"
        assert report["refused"] == ["next", "iter", "stats", "state_dict", "child_pids"], report["refused"]

        # The parent's loader went on untouched: the same processes, and the pass's rows, each once.
        assert not loader.closed
        assert loader.child_pids() == processes
        more = take(it, 40)
        ids = [int(i) for batch in kept + more for i in batch[0]["id"]]
        assert len(ids) == len(set(ids)) and all(0 <= i < 4000 for i in ids), "rows lost or repeated"


class _NodeMemoryOfWorker(Dataset):  # type: ignore[type-arg]
    """Each item: how many handles on ``files`` (a loader's buffer and slot table) the DataLoader worker holds."""

    def __init__(self, files: set[tuple[str, int]]) -> None:
        self.files = files

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        held = _node_memory()
        return torch.tensor(len([1 for kind, inode, _how in held if (kind, inode) in self.files]))


def test_dataloader_workers_forked_beside_a_loader_hold_none_of_its_node_buffer(
    redis_url: str, runtime_dir: Path
) -> None:
    """The common fork: a validation DataLoader's workers, persistent, started while the training loader is open.
    Each was a copy of the trainer, with the buffer's fds and mapping: its memory outlived the loader for the run."""
    with _loader_with_its_buffer_mapped(redis_url) as (_loader, it, _kept, files):
        validation = DataLoader(
            _NodeMemoryOfWorker({(kind, inode) for kind, inode in files if kind != "ring"}),
            num_workers=2,
            persistent_workers=True,
            timeout=60,
            multiprocessing_context="fork",
        )
        assert [int(held) for held in validation] == [0, 0, 0, 0]
        take(it, 5)  # and the training loader goes on
