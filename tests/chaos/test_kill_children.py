"""SIGKILL of one loader child: the owner writer, another writer, or a reader.

Three moments: ``fill`` (the writers stall on a gate with the buffer below the mixing threshold, so no batch can
have been read; the trainer waits in next()), ``run`` (after a random number of batches, while the trainer
reads), and ``blocked`` (the trainer has drained the buffer below the threshold and sits in next(); every
writer stalls on the gate). A killer thread finds the victim (the owner is the ``processes()`` entry with
``owner: True``), kills it, waits until the trainer has reclaimed it (repaired its slots in the slot table and
dropped its entry from the queue's ``procs`` hash), and then opens the gate.

With ``max_restarts=3`` the loader must go on: the victim is respawned, no id is read twice (ids are unique per
writer process), no row is torn, a respawned writer's rows arrive, and the slot table accounts for every slot.
With ``max_restarts=0`` next() must raise ``WorkerDied`` naming the role, the pid and SIGKILL within a few
seconds.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from chaos_datasets import ChaosDataset
from redis_servers import wait_until

from gigashuffle import WorkerDied

MOMENTS = ("fill", "run", "blocked")
VICTIMS = ("owner", "writer", "reader")
DETECT_LIMIT_S = 10.0  # the design notices a death within ~1 s; this bound only catches a hang
TEST_LIMIT_S = 120.0


def _ring_mappings() -> set[str]:
    """The reader rings this process maps, by device and inode of each ring's memfd."""
    with open("/proc/self/maps") as maps:
        return {" ".join(line.split()[3:5]) for line in maps if "memfd:gigashuffle-ring" in line}


def _start(chaos: Any, redis_url: str, victim: str, moment: str, seed: int, max_restarts: int) -> tuple[Any, ...]:
    name = {"owner": "owner writer", "writer": "other writer", "reader": "reader"}[victim]
    rng = chaos.begin("SIGKILL child", f"{name}, {moment}, max_restarts={max_restarts}", seed, redis_url)
    # shuffle_size 128 with min_mixing 0.5: a reader needs 64 full slots. A writer publishes each chunk as soon as
    # it is copied, so allowance A publishes A * 8 rows per writer: A <= 3 stays below 64 with two writers (fill),
    # A in 6..8 gives a few batches and then blocks the trainer.
    cfg = chaos.config(bs=rng.choice((4, 8)), num_readers=rng.choice((1, 2)), max_restarts=max_restarts)
    if moment == "fill":
        dataset = ChaosDataset(rows=8, gate_dir=str(chaos.gate), allowance=rng.randint(1, 3))
    elif moment == "blocked":
        dataset = ChaosDataset(rows=8, gate_dir=str(chaos.gate), allowance=rng.randint(6, 8))
    else:
        dataset = ChaosDataset(rows=8)
    loader = chaos.loader(dataset, cfg)
    return rng, cfg, loader, chaos.consumer(loader)


def _killer(chaos: Any, loader: Any, consumer: Any, victim: str, moment: str, rng: Any) -> dict[str, Any]:
    cfg = loader.config
    keys = chaos.keys(cfg)
    url = loader.redis_url
    try:
        proc, info = chaos.find_victim(loader, victim, rng)
        role, pid = info["role"], int(info["pid"])
        if moment == "fill":
            time.sleep(rng.uniform(0.0, 0.3))
            assert consumer.batches == 0, "the buffer was below the mixing threshold: no batch can have been read"
        elif moment == "run":
            target = rng.randint(5, 60)
            wait_until(lambda: consumer.batches >= target, timeout_s=60.0, what=f"{target} batches")
        else:
            settle = rng.uniform(0.2, 0.8)

            def blocked() -> bool:
                since = consumer.in_next_since
                return (
                    set(loader.child_pids()["writer"]) <= chaos.waiting_at_gate()
                    and chaos.full_slots(url, keys) < cfg.min_full_slots
                    and since is not None
                    and time.monotonic() - since > settle
                )

            wait_until(blocked, timeout_s=60.0, what="the trainer to block in next() with every writer stalled")
        at_kill = consumer.batches
        pids_at_kill = set(loader.child_pids()[role])
        writers_at_kill = set(loader.child_pids()["writer"])
        rings_at_kill = _ring_mappings()
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not chaos.registered(url, keys, proc), timeout_s=DETECT_LIMIT_S,
                   what=f"the trainer to reclaim the lease of killed {role} {pid}")  # fmt: skip
        reclaimed_s = time.monotonic() - t_kill
        respawned = None
        if cfg.max_restarts:
            count = cfg.num_writers if role == "writer" else cfg.num_readers

            def replaced() -> bool:
                pids = loader.child_pids()[role]
                return len(pids) == count and pid not in pids and all(p is not None for p in pids)

            wait_until(replaced, timeout_s=30.0, what=f"{role} {pid} to be respawned")
            respawned = sorted(set(loader.child_pids()[role]) - pids_at_kill)
        return {"role": role, "pid": pid, "proc": proc, "t_kill": t_kill, "at_kill": at_kill,
                "reclaimed_s": reclaimed_s, "respawned": respawned,
                "writers_at_kill": writers_at_kill, "rings_at_kill": rings_at_kill}  # fmt: skip
    finally:
        chaos.open_gate()


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("victim", VICTIMS)
def test_sigkilled_child_is_respawned(chaos: Any, redis_url: str, victim: str, moment: str, seed: int) -> None:
    rng, cfg, loader, consumer = _start(chaos, redis_url, victim, moment, seed, max_restarts=3)
    killer = chaos.thread(lambda: _killer(chaos, loader, consumer, victim, moment, rng), "killer")
    need_after = rng.randint(20, 60)
    end = time.monotonic() + TEST_LIMIT_S
    info: dict[str, Any] | None = None
    while True:
        consumer.next()
        if info is None and not killer.is_alive():
            info = killer.result()
        if info is not None and consumer.batches - info["at_kill"] >= need_after:
            new_writers = consumer.writers_seen() - info["writers_at_kill"]
            if info["role"] == "reader" or new_writers:
                break
        assert time.monotonic() < end, f"no recovery within {TEST_LIMIT_S} s ({consumer.batches} batches)"
    consumer.assert_unique()
    pids = loader.child_pids()
    assert info["pid"] not in pids[info["role"]]
    assert len(pids["writer"]) == cfg.num_writers and len(pids["reader"]) == cfg.num_readers, pids
    if info["role"] == "reader" and len(info["rings_at_kill"]) == cfg.num_readers:
        # Every reader's ring was mapped at the kill (a reader killed at start-up may have sent none yet). Its
        # batches were read long ago, so the dead reader's ring is unmapped: restarts keep no dead ring mapped.
        unmapped = info["rings_at_kill"] - _ring_mappings()
        assert unmapped, f"the killed reader's ring is still mapped: {sorted(info['rings_at_kill'])}"
    figures = chaos.assert_stats(loader)
    chaos.finish("recovered", detect_s=info["reclaimed_s"], batches=consumer.batches, killed=info["role"],
                 **figures)  # fmt: skip


@pytest.mark.parametrize("seed", range(1))
@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("victim", VICTIMS)
def test_sigkilled_child_fails_fast_without_restarts(
    chaos: Any, redis_url: str, victim: str, moment: str, seed: int
) -> None:
    rng, _cfg, loader, consumer = _start(chaos, redis_url, victim, moment, seed, max_restarts=0)
    killer = chaos.thread(lambda: _killer(chaos, loader, consumer, victim, moment, rng), "killer")
    end = time.monotonic() + TEST_LIMIT_S
    with pytest.raises(WorkerDied) as excinfo:
        while time.monotonic() < end:
            consumer.next()
    raised = time.monotonic()
    info = killer.result()
    err = excinfo.value
    detect_s = raised - info["t_kill"]
    text = str(err)
    assert (err.role, err.pid, err.signal) == (info["role"], info["pid"], signal.SIGKILL), text
    assert f"{info['role']} " in text and f"pid {info['pid']}" in text and "SIGKILL" in text, text
    assert detect_s < DETECT_LIMIT_S, f"WorkerDied came {detect_s:.1f} s after the kill"
    consumer.assert_unique()
    chaos.finish("error: WorkerDied", detect_s=detect_s, batches=consumer.batches, killed=info["role"])


@pytest.mark.parametrize("seed", range(3))
def test_seed_race_loser_never_hands_out_its_own_buffer(
    chaos: Any, redis_url: str, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Regression: a writer that loses the PUBLISH_META race must never serve the buffer it allocated.

    Found by the owner-kill runs (a batch of all-zero rows). Both writers allocate a buffer and start serving it
    before PUBLISH_META decides the owner; the loser used to list its socket in Redis first, so a reader that saw the
    winner's metadata and attached in that window mapped the loser's never-written buffer and gathered zeros
    forever. The interleaving is forced here in-process: the reader attaches from inside the loser's PUBLISH_META call.
    """
    import itertools

    import torch
    from chaos_datasets import make_chunk

    from gigashuffle.control.client import connect
    from gigashuffle.control.session import NodeSession
    from gigashuffle.procs import childenv
    from gigashuffle.procs.channel import Channel
    from gigashuffle.procs.childspec import ChildSpec
    from gigashuffle.schema import Layout

    rng = chaos.begin("owner seed race", "reader attaches while the PUBLISH_META loser still serves", seed, redis_url)
    numbers = itertools.count()
    # Every ChildEnv here shares this pid; give each its own attach socket, as separate processes would have.
    monkeypatch.setattr(childenv, "attach_socket_path", lambda pid, d: d / f"attach-{pid}-{next(numbers)}.sock")
    cfg = chaos.config(bs=4, shuffle_size=rng.choice((16, 32, 64)))
    client = connect(redis_url)
    session = NodeSession(client, cfg)
    envs: list[childenv.ChildEnv] = []
    ends: list[Channel] = []

    def child(role: str, index: int) -> childenv.ChildEnv:
        ours, theirs = Channel.pair()
        ends.extend((ours, theirs))
        spec = ChildSpec(role=role, index=index, config=cfg, redis_url=redis_url,
                         generation=session.generation, runtime_dir=str(chaos.runtime_dir))  # fmt: skip
        env = childenv.ChildEnv(spec, theirs)
        env.store.client.hdel(env.store.keys.procs, env.proc)
        env.proc = f"0.{role[0]}{index}.{next(numbers)}"
        env.register()
        envs.append(env)
        return env

    try:
        loser = child("writer", 1)  # listed first in the procs hash, so an attaching reader tries it first
        winner = child("writer", 0)
        reader = child("reader", 0)
        ids = torch.arange(cfg.shuffle_size, dtype=torch.int64) + 7_000_000 + rng.randint(0, 1000)
        chunk = make_chunk(ids)
        layout = Layout.from_chunk(chunk)
        rows, as_bytes = layout.rows_in(chunk)
        first_row = b"".join(field[0].numpy().tobytes() for field in as_bytes)
        assert winner.publish_buffer(layout, first_row)
        assert winner.buffer is not None
        winner.buffer.write(torch.arange(rows), as_bytes, 0)
        seed_call = loser.store.publish_meta

        def seed_then_reader_attaches(*args: Any) -> bool:
            won = seed_call(*args)
            reader.attach_buffer()  # the metadata is published; the loser has not closed its server yet
            return won

        loser.store.publish_meta = seed_then_reader_attaches  # type: ignore[method-assign]
        started = time.monotonic()
        assert not loser.publish_buffer(layout, first_row)
        took = time.monotonic() - started
        assert reader.buffer is not None
        some = torch.tensor(sorted(rng.sample(range(rows), 4)))
        got, want = reader.buffer.read_rows(some), winner.buffer.read_rows(some)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (
            "the reader mapped a buffer other than the published one (the PUBLISH_META loser's): it reads zeros"
        )
    finally:
        for env in envs:
            if env.server is not None:
                env.server.close()
            if env.buffer is not None:
                env.buffer.close()
            if env.table is not None:
                env.table.close()
            env.client.close()
        for end in ends:
            end.close()
        session.leave()
        client.close()
    chaos.finish("ok: reader mapped the published buffer", detect_s=took)
