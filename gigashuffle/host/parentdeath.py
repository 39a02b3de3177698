"""A child's death with its parent: ``PR_SET_PDEATHSIG``, one call for the loader's children and the embedded
server (NOTE [ Why a zygote ] in procs/zygote.py, NOTE [ Embedded server ] in control/embedded.py)."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(expected_parent: int, signum: int = signal.SIGKILL) -> None:
    """Get ``signum`` when the parent dies; exit now if it already has (the race before prctl)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != expected_parent:
        os._exit(1)
