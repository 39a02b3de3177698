"""``gigashuffle bench --checkpoint-rows``: the loader's steady state with a stateful dataset, whose writers track
their commits and take ``state_dict()`` before each chunk, and with ``checkpoint_rows="positions"`` also stamp each
row's origin and keep recent chunk states (NOTE [ Positions checkpoint ] in checkpoint/positions.py).

``none`` (the default) is the bench as always: a dataset without state. ``saved`` and ``positions`` wrap it in
``Stateful``; alternate them (A B A B) to see what origin tracking costs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

MODES = ("none", "saved", "positions")
mode = "none"  # set once by the CLI, before any loader is built (one rank per bench process)


class Stateful(IterableDataset):  # type: ignore[type-arg]
    """``inner``'s chunks, counted: the state is the number of chunks yielded (not re-readable: no resume here)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chunks = 0

    def state_dict(self) -> dict[str, int]:
        return {"chunks": self.chunks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.chunks = int(state["chunks"])

    def __iter__(self) -> Iterator[Any]:
        for chunk in self.inner:
            self.chunks += 1
            yield chunk


def wrap(dataset: Any) -> Any:
    return dataset if mode == "none" else Stateful(dataset)


def checkpoint_rows() -> str:
    return "saved" if mode == "none" else mode
