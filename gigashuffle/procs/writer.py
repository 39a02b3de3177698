"""A writer process, from its spec to its loop: it takes up its resume point (``procs/resume.py``), takes a first
chunk for the buffer's layout, allocates and publishes the node buffer or maps the published one, says ``Attached``
and holds until the trainer says go (NOTE [ Restore before reading ] in procs/resume.py); then it writes for good
(NOTE [ Writer cycle ] in procs/writecycle.py). Its chunks come from ``procs/chunks.py`` (NOTE [ Empty shares ]);
the trainer's messages are applied in ``procs/writercontrol.py``.
"""

from __future__ import annotations

from gigashuffle.control import dummyrow
from gigashuffle.errors import SchemaError
from gigashuffle.procs.channel import Channel
from gigashuffle.procs.childenv import ChildEnv
from gigashuffle.procs.childspec import NO_CONTEXT, ChildSpec
from gigashuffle.procs.chores import Housekeeping
from gigashuffle.procs.chunks import Chunks, before_fetch
from gigashuffle.procs.forgottenbuffer import find_served_buffer
from gigashuffle.procs.messages import Attached
from gigashuffle.procs.positions import KEEP_BUFFERS, Track, lane_of
from gigashuffle.procs.resume import StreamPosition, initial_position
from gigashuffle.procs.workerinfo import become_worker
from gigashuffle.procs.writecycle import write_forever
from gigashuffle.procs.writercontrol import IDLE_POLL_S, handle_control
from gigashuffle.schema import Layout
from gigashuffle.shm.counters import ChildCounters
from gigashuffle.shm.lanes import writer_lanes


def run(spec: ChildSpec, channel: Channel) -> None:
    become_worker(spec.config, spec.index, spec.dataset, spec.seed, spec.start)
    if spec.context is not NO_CONTEXT:
        spec.dataset.context = spec.context
    if spec.epoch is not None:
        spec.dataset.set_epoch(spec.epoch)
    lanes = writer_lanes(spec.config.local_rank, spec.index)
    point = spec.point
    position = initial_position(spec.dataset, spec.stateful, point, lanes)
    cfg = spec.config
    positions = cfg.checkpoint_rows == "positions" and spec.stateful and cfg.delivers_once
    track = Track(positions, lane_of(cfg.local_rank, cfg.num_writers, spec.index), int(KEEP_BUFFERS * cfg.shuffle_size))
    # A filter takes the skip in (procs/positions.py); the lane's base is set from it when the buffer is bound.
    position.skip_left = track.restart(point.base, position.base_state, point.keep, point.until, point.skip)
    env = ChildEnv(spec, channel)
    try:
        _run(spec, env, position, track)
    finally:
        env.close()
        position.close()


def _run(spec: ChildSpec, env: ChildEnv, position: StreamPosition, track: Track) -> None:
    chunks = Chunks(spec, env, position, track)
    handle_control(env, chunks)
    before_fetch(chunks)
    chunk = chunks.next()
    layout = Layout.from_chunk(chunk)
    if env.store.meta().get("layout") is None:
        served = find_served_buffer(env.runtime_dir, env.scope)  # NOTE [ A buffer Redis forgot ]
        held = env.adopt_buffer(served) if served is not None else None
        if held is None:  # no live buffer of this queue on this node (or none that fits): allocate one
            _rows, as_bytes = layout.rows_in(chunk)
            first_row = b"".join(field[0].numpy().tobytes() for field in as_bytes)
            held = env.publish_buffer(layout, first_row)
        if not held:
            env.attach_buffer()
    else:
        env.attach_buffer()
    published, meta = env.read_meta()
    if published != layout:
        raise SchemaError(
            f"this writer's chunks have layout [{layout.describe()}] but the buffer of queue "
            f"{spec.config.queue_name!r} was created for [{published.describe()}]; every writer of a queue "
            "must yield the same fields, dtypes and row shapes"
        )
    if env.table is None:
        raise AssertionError("writer has no slot table after attach")
    position.bind(env.table)  # NOTE [ Respawned writers ]: before the trainer maps the counter, before any commit
    counters = ChildCounters()  # NOTE [ Child counters ] in shm/counters.py: its fd travels first with Attached
    if counters.memory.fd is None:
        raise AssertionError("new counters have no fd")
    # An owner's buffer and table went to the trainer before their publication (ChildEnv.publish_buffer).
    env.channel.send(Attached(), (counters.memory.fd, *position.fds()))
    counters.memory.close_fd()
    if dummyrow.is_dummy_writer(spec.config, spec.index):
        env.dummy_row = (meta["layout"], dummyrow.row_bytes(layout, chunk))
        dummyrow.publish_row(env.store, env.secret, spec.generation, *env.dummy_row, env.proc)
    if not _hold(env, chunks):
        chunk = None  # a state was loaded: the chunk taken for the layout is not part of the stream any more
    write_forever(env, chunks, chunk, layout, counters)


def _hold(env: ChildEnv, chunks: Chunks) -> bool:
    """Wait for ``Go`` or ``LoadState`` before committing any row (NOTE [ Restore before reading ] in
    procs/resume.py); False if a state was loaded meanwhile."""
    serial = chunks.position.serial
    chores = Housekeeping(env)
    while not env.spec.go:
        if env.channel.poll(IDLE_POLL_S):
            handle_control(env, chunks)
        chores.tick()
    return chunks.position.serial == serial
