"""A process of the node stopped (SIGSTOP) while it holds the slot table's lock, then killed.

No process can take a live holder's flock, so the node's writers and readers wait; the trainer must say why
instead of hanging silently (NOTE [ A stopped lock holder ] in shm/slottable.py):

- its heartbeat goes on (it reads the table's counts without the lock), so the node keeps its session;
- ``stats()`` raises ``NodeLockBusy`` naming the holder's pid and that it is stopped, once its patience is spent;
- the "no batch for N s" warning names the holder, its state and the fix;
- once the holder is killed (the kernel drops its lock) batches come again, none twice, and nothing leaks.

The holder is a plain Python process that opens its own description of the node's table memfd (passed to it as
``table_fd``), takes the lock as a loader process does, and stops itself.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import redis
from chaos_datasets import ChaosDataset
from redis_servers import wait_until
from slot_audit import node_table

import gigashuffle.loader as loader_module
import gigashuffle.trainer.batches as batches_module
from gigashuffle import NodeLockBusy
from gigashuffle.host.pids import is_stopped

HOLDER = """
import fcntl, os, signal, sys
fd = os.open(f"/proc/self/fd/{sys.argv[1]}", os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
os.kill(os.getpid(), signal.SIGSTOP)
"""
WARNING_WITHIN_S = 30.0


class _Warnings(logging.Handler):
    """Sets ``seen`` once the loader warns that it waits for a batch and names a stopped lock holder."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "no batch for" in text and "slot-table lock is held by" in text:
            self.texts.append(text)
            self.seen.set()


def _claim_ttl_ms(url: str, key: str) -> int:
    with redis.Redis.from_url(url, socket_timeout=5.0) as client:
        return int(client.pttl(key))


def test_a_stopped_lock_holder_is_named_and_batches_resume_once_it_is_gone(
    chaos: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    chaos.begin("stopped lock holder", "SIGSTOP with the node lock held, then SIGKILL", 0, redis_url)
    cfg = chaos.config(bs=8, num_readers=1, ring_depth=4)
    loader = chaos.loader(ChaosDataset(rows=8), cfg)
    consumer = chaos.consumer(loader)
    consumer.take(5)
    monkeypatch.setattr(batches_module, "_SLOW_WARNING_S", 0.5)
    monkeypatch.setattr(loader_module, "_LOCK_PATIENCE_S", 0.5)
    keys = chaos.keys(cfg)
    with node_table(loader.redis_url, keys, cfg.shuffle_size) as table:
        assert table is not None and table.fd is not None
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(table.fd)], pass_fds=[table.fd])
    warnings = _Warnings()
    logging.getLogger("gigashuffle.trainer.batches").addHandler(warnings)
    try:
        wait_until(lambda: is_stopped(holder.pid), timeout_s=30.0, what="the lock holder to stop itself")
        stopped_at = time.monotonic()

        # The heartbeat extends the rank's claim (lease 10 s, every second) while the lock is held.
        claim = keys.rank(cfg.global_rank)
        before = _claim_ttl_ms(loader.redis_url, claim)
        wait_until(
            lambda: _claim_ttl_ms(loader.redis_url, claim) > before,
            timeout_s=5.0,
            what="the heartbeat to extend the claim while the lock is held",
        )

        with pytest.raises(NodeLockBusy, match=rf"pid {holder.pid} .*stopped by a signal: send it SIGCONT"):
            loader.stats()

        def kill_after_warning() -> float | None:
            seen = warnings.seen.wait(WARNING_WITHIN_S)
            named_after = time.monotonic() - stopped_at
            holder.send_signal(signal.SIGKILL)  # in any case, so the trainer's next() returns
            return named_after if seen else None

        killer = chaos.thread(kill_after_warning, "holder-killer")
        # The reader's ring and the trainer's queue hold a few batches; then next() waits for the lock.
        consumer.take(4 + 4)
        named_after = killer.result(WARNING_WITHIN_S + 30.0)
        assert named_after is not None, "no warning named the stopped lock holder"
        assert f"pid {holder.pid} " in warnings.texts[0]
        assert "stopped by a signal" in warnings.texts[0]
    finally:
        logging.getLogger("gigashuffle.trainer.batches").removeHandler(warnings)
        holder.kill()
        holder.wait(timeout=10.0)
    consumer.take(5)
    consumer.assert_unique()
    chaos.assert_stats(loader)
    chaos.finish("named, resumed once killed", detect_s=named_after)
