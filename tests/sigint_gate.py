"""A script's own SIGINT handler for the Ctrl-C tests: ``KeyboardInterrupt`` only while armed (inside the loader call
under test), so that an interrupt never lands in the script's own bookkeeping; the others are counted."""

from __future__ import annotations


class Gate:
    def __init__(self) -> None:
        self.armed = False
        self.raised = 0
        self.stray = 0

    def __call__(self, signum: int, frame: object) -> None:
        if self.armed:
            self.raised += 1
            raise KeyboardInterrupt
        self.stray += 1
