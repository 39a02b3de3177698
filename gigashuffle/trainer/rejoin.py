"""What the trainer does when Redis forgot or contradicts its node session: join again, keep the buffer and children.

NOTE [ Rejoining ]
Redis may forget or contradict the node session: restarted without persistence, flushed, restored from an older
snapshot, failed over to a replica. The heartbeat notices (a claim that is gone within one beat, a changed
generation or ``run_id`` within ``VERIFY_EVERY`` beats: NOTE [ Heartbeat ]), and so does a child whose
generation-checked call is refused. None of that touches the rows:
the buffer and its slot table live in the children's shared memory. So the trainer
  1. joins again: the first rank of the node back starts a new generation, the others join it;
  2. publishes the buffer's metadata again under it, from the verified copy it kept when it mapped the slot
     table (first publication wins; every rank's copy describes the same buffer). It does this before any child
     starts under the new generation, so a new writer attaches to the node's buffer instead of making another;
  3. sends ``Rejoin(generation)`` to every child that has the buffer mapped (``Attached``/``RingReady`` seen):
     it registers again (its attach socket) and quotes the new generation; the dummy writer publishes its row
     again. Such a child never stopped moving rows: no child calls Redis in the steady state;
  4. kills, through the zygote, every child still starting under the old generation (it holds no slots and
     would quote it) and starts it again; one started since the join quotes the new one and is left alone (a
     kill would read as yet another session change, and a second rejoin would wipe what this one published).
     A child that died of a refused generation is started again too. Neither counts against ``max_restarts``:
     nothing failed.
The processes that serve the buffer list themselves in Redis again only as each takes its ``Rejoin``, so a child
that starts in between finds the metadata and no listed server: it looks in the runtime directory for one (as
below) instead of waiting.
No row is lost, delivered twice or torn, since the slot table never left shared memory. A rank whose trainer
never mapped the slot table (no child of it had attached yet) cannot republish the metadata, and a new writer may
start before the ranks that can have: finding no metadata, it looks for the node's buffer in the runtime
directory and publishes that one again (NOTE [ A buffer Redis forgot ] in procs/forgottenbuffer.py), so a node keeps one
buffer.
Only a Redis that stays unreachable past ``redis_timeout_s`` fails the loader (``QueueStateLostError``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gigashuffle.config import DataloaderConfig
from gigashuffle.control.session import NodeSession
from gigashuffle.errors import GigashuffleError, QueueStateLostError
from gigashuffle.procs.messages import Rejoin, Role
from gigashuffle.procs.zygoteclient import ChildProcess, Zygote
from gigashuffle.trainer.nodetable import TableView

log = logging.getLogger(__name__)


def join_again(
    config: DataloaderConfig, session: NodeSession, node_table: TableView, reason: BaseException
) -> BaseException | None:
    """Steps 1 and 2: join again and publish the buffer's metadata again. Returns the loader's failure when the
    session cannot be joined again (Redis stayed unreachable), else None."""
    if isinstance(reason, QueueStateLostError):
        log.warning(
            "queue %r: %s; rejoining with the buffer and processes as they are",
            config.queue_name, str(reason).splitlines()[0],
        )  # fmt: skip
        try:
            session.rejoin()
            node_table.republish()
        except GigashuffleError as exc:
            reason = exc
        else:
            return None
    return QueueStateLostError(
        f"queue {config.queue_name!r}: {reason}. Redis stayed unreachable past redis_timeout_s="
        f"{config.redis_timeout_s}, so the node session could not be joined again; recreate the loader."
    )


def resume_children(
    children: list[ChildProcess],
    generation: str,
    zygote: Zygote,
    spawn: Callable[[Role, int, int], ChildProcess],
) -> None:
    """Steps 3 and 4, once the pids of every child spawned so far are known: attached children quote the new
    generation; children still starting are killed and started again (``superseded``), as are those that died
    under the old session."""
    for child in list(children):
        if child.alive and child.attached:
            child.generation = generation
            try:
                child.channel.send(Rejoin(generation))
            except OSError as exc:
                log.debug("%s %d did not take Rejoin: %s", child.role, child.index, exc)
        elif child.alive and not child.superseded and child.generation != generation:
            # One spawned since the join (a death handled while learning the pids) already quotes the new session.
            child.superseded = True
            zygote.kill(child.seq)
        elif not child.alive and child.superseded:
            child.superseded = False  # died under the old session, before we rejoined: start it now
            children.append(spawn(child.role, child.index, child.restarts))
