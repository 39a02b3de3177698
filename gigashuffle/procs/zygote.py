"""The zygote: a fresh interpreter per loader that imports torch once and forks the loader's children.

NOTE [ Why a zygote ]
Spawning each child costs a full interpreter start plus ``import torch`` (seconds, and ~160 MB of private
memory per child). Forking the trainer is fast but unsafe once it has started CUDA or threads. The zygote is
exec'ed fresh (so it is CUDA-safe), takes the trainer's sys.path and working directory, imports torch once, then
forks each child from that clean state: start-up costs one interpreter start, and children share torch's pages
copy-on-write. It never imports the trainer's main module (see NOTE [ Pickling the dataset ] in procs/pickling.py).

Lifetime: the zygote watches its channel to the trainer; when the trainer closes it or dies, the zygote kills
its children and exits. Children get PR_SET_PDEATHSIG(SIGKILL) against the single-threaded zygote, so nothing
outlives a SIGKILLed trainer by more than a poll interval. The zygote reports each child's exit status to the
trainer, which owns all recovery decisions. A closed loader's zygote reaps its children and may serve the trainer's
next loader (NOTE [ Reused zygotes ] in procs/zygotereuse.py).
"""

from __future__ import annotations

import logging
import multiprocessing.spawn
import os
import signal
import socket
import sys
from typing import Any

from gigashuffle.host.parentdeath import set_parent_death_signal
from gigashuffle.procs.channel import Channel, ChannelClosed
from gigashuffle.procs.messages import Exited, Kill, Prepared, Release, Released, Spawn, Spawned

log = logging.getLogger(__name__)

_POLL_S = 0.05


def _reap(trainer: Channel, children: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.pop(pid, None)
        trainer.send(Exited(pid, os.waitstatus_to_exitcode(status)))


def _fork_child(trainer: Channel, payload: bytes, title: str, control_fd: int) -> int:
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid:
        os.close(control_fd)
        return pid
    code = 1
    try:
        set_parent_death_signal(zygote_pid)
        trainer.close()  # the trainer must see EOF on the zygote's channel when the zygote dies
        from gigashuffle.procs import childmain

        code = childmain.child_main(payload, title, control_fd)
    finally:
        os._exit(code)


def serve(trainer: Channel) -> bool:
    """Fork and reap one loader's children until it closes: True when it released us (every child reaped, and
    ``Released`` sent), False when the trainer closed the channel or died."""
    # Unreaped children: pid -> spawn request number. An entry goes when its child is reaped, so a week of
    # restarts leaves nothing behind, and a kill by request number can never reach a reused pid.
    children: dict[int, int] = {}
    released = False
    try:
        while not released:
            _reap(trainer, children)
            if not trainer.poll(_POLL_S):
                continue
            message, fds = trainer.recv()
            if isinstance(message, Spawn):
                pid = _fork_child(trainer, message.payload, message.title, fds[0])
                children[pid] = message.seq
                trainer.send(Spawned(message.seq, pid))
            elif isinstance(message, Kill):
                # By request number, and only while unreaped: the pid cannot have been reused by then.
                for pid, seq in children.items():
                    if seq == message.seq:
                        os.kill(pid, signal.SIGKILL)
                        break
            elif isinstance(message, Release):
                released = True
    except (ChannelClosed, ConnectionError):
        pass  # the trainer closed us or died: take the children down with us
    finally:
        _stop_children(children)
    if released:
        try:
            trainer.send(Released())  # only now: the trainer vouches for its children's deaths on it
        except (ChannelClosed, OSError):
            return False
    return released


def _stop_children(children: dict[int, int]) -> None:
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            continue
    # A SIGKILLed trainer cannot remove its children's attach sockets; the children are gone now, so do it.
    from gigashuffle.host.rundir import attach_socket_path, remove_socket, runtime_dir_path

    directory = runtime_dir_path()  # not made again if it is gone: nothing is left in it to remove
    try:
        for pid in children:
            remove_socket(attach_socket_path(pid, directory))
    except OSError as exc:
        log.debug("could not remove the attach sockets of %s: %s", sorted(children), exc)


def _remove_dead_trainer_sockets(trainer_pid: int) -> None:
    """The attach sockets a SIGKILLed trainer left (NOTE [ The trainer holds the buffer ] in trainer/nodetable.py):
    those of its pid that no server answers on. A trainer that closed this loader normally removed its own, and one
    that lives on (another loader of it still serves) answers."""
    from gigashuffle.host.rundir import remove_socket, runtime_dir_path, trainer_sockets

    for path in trainer_sockets(trainer_pid, runtime_dir_path()):  # none when the directory is gone
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            remove_socket(path)
        except OSError as exc:
            log.debug("left %s: %s", path, exc)
        finally:
            probe.close()


def _set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        log.debug("setproctitle is not installed; process titles stay unchanged")


def _prepare(preparation: dict[str, Any]) -> bool:
    """Take a loader's preparation; True when the trainer waits for ``Prepared`` (a reused zygote)."""
    _set_title(preparation.pop("gigashuffle_title", "gigashuffle zygote"))
    env = preparation.pop("gigashuffle_env", None)
    if env is not None:  # the loader's environment, for its children (NOTE [ Reused zygotes ])
        os.environ.clear()
        os.environ.update(env)
    answer = bool(preparation.pop("gigashuffle_answer", False))
    # The trainer's sys.path and working directory, so that its modules import here by name; its main module
    # was left out of the preparation on purpose. Then import torch once for every child (a no-op when reused).
    multiprocessing.spawn.prepare(preparation)
    import torch  # noqa: F401

    # Imported before any fork, so every child shares these pages and none imports them again: the entry point
    # (childmain), what unpickles the dataset (pickling), and the loops with what they import (the slot table, the
    # control plane, redis-py). A child that imported its loop itself spent about a third of a reused zygote's
    # start-up there, each child, every loader (compiling from source where no bytecode is written).
    from gigashuffle.procs import childmain, pickling, reader, writer  # noqa: F401

    return answer


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes us
    trainer_pid = os.getppid()
    trainer = Channel(socket.socket(fileno=int(argv[0])))
    while True:
        preparation: dict[str, Any]
        try:
            preparation, _ = trainer.recv()  # parked: until the trainer's next loader, or its exit
        except (ChannelClosed, OSError):
            break  # the loader was closed before it told us anything, or the trainer is gone
        if _prepare(preparation):
            trainer.send(Prepared())
        if not serve(trainer):
            break
        _set_title(f"gigashuffle zygote (idle, trainer {trainer_pid})")
    _remove_dead_trainer_sockets(trainer_pid)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Skip interpreter teardown: with torch imported it takes 1-2 s on a busy machine, and the zygote must be gone
    # as soon as its children are (a SIGKILLed trainer's processes all go within 2 s; close() waits for us).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
