"""The loader's state as the frameworks need it: keyed by rank, and gathered to every rank before a save.

NOTE [ Rank-keyed state ]
``loader.state_dict()`` is one rank's state under one key, ``f"rank{global_rank}"``; the dicts of all ranks merge
with ``dict.update``, and ``loader.load_state_dict(merged)`` takes its own rank's part. Lightning's fit loop, the
Hugging Face Trainer and accelerate's ``save_state`` write a data loader's state from rank 0 only, so each rank's
state would be lost but rank 0's: ``GatheredState.state_dict()`` therefore gathers every rank's state
(``loader.gathered_state_dict()``, an ``all_gather_object``: a collective, which these frameworks call on every
rank at the same step before writing on rank 0) and returns the merged dict, which any one rank's file then holds
whole. ``torch.distributed.checkpoint`` saves each rank's own keys, so ``RankKeyedState`` there needs no gather;
but ``dcp.load`` loads tensors in place into the tensors of the ``state_dict()`` it is given at load time, and
loads only the keys that one has: a fresh loader's state has no saved rows, or other ones, so the cut's rows would
never come back. ``RankKeyedState`` therefore hands dcp each rank's part as one opaque ``bytes`` value (``torch.save``
of the part; read back with ``weights_only=True``), which dcp stores and restores whole under the rank's key.

A framework that fetches a batch ahead (Lightning) has been handed one batch more than it trained on when it
checkpoints: ``StatefulLoader`` keeps the batches it handed out beyond those the framework reports trained
(``trained``: a count the framework keeps) and passes them as ``state_dict(unconsumed=...)``, so their rows come
back after a resume (checkpoint/unconsumed.py).
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gigashuffle import MultiprocessShuffledDataloader
from gigashuffle.checkpoint.parts import rank_key
from gigashuffle.errors import CheckpointError

# Batches a framework may fetch ahead of its training step (Lightning: one).
_MAX_AHEAD = 4


class RankKeyedState:
    """The loader as a ``torch.distributed.checkpoint`` ``Stateful``: each rank saves and loads its own key, its
    part as one ``bytes`` value (NOTE [ Rank-keyed state ]). Resume with the same world size and ``num_writers``
    (for an elastic resume, save ``gathered_state_dict()`` with ``torch.save``)."""

    def __init__(self, loader: MultiprocessShuffledDataloader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.loader.state_dict(), buffer)
        return {rank_key(self.loader.config.global_rank): buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = rank_key(self.loader.config.global_rank)
        blob = state_dict.get(key) if isinstance(state_dict, dict) else None
        if not isinstance(blob, bytes):
            raise CheckpointError(
                f"RankKeyedState.load_state_dict: the checkpoint has no bytes under {key!r} (it has "
                f"{sorted(state_dict)[:8] if isinstance(state_dict, dict) else type(state_dict).__name__}); it was "
                "not saved by RankKeyedState with this world size"
            )
        try:
            state = torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as error:
            raise CheckpointError(
                f"RankKeyedState.load_state_dict: {key!r} cannot be read back ({error}); a dataset state with types "
                "other than tensors, numbers, strings, lists and dicts needs torch.serialization.add_safe_globals"
            ) from error
        self.loader.load_state_dict(state)  # takes its own rank's part; a missing one: CheckpointError


class GatheredState:
    """The loader's state for frameworks that save from rank 0 only: every rank's state, gathered on each."""

    def __init__(self, loader: MultiprocessShuffledDataloader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return self.loader.gathered_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)  # takes its own rank's part; a missing one: CheckpointError


class StatefulLoader(GatheredState):
    """The loader as a framework's data loader: iterates it, and its ``state_dict`` is the gathered one, so a
    framework that checkpoints its loaders' states from rank 0 (Lightning's fit loop) restores every rank.

    ``trained`` returns how many batches the framework has taken into training steps (it may count from a value
    restored with its own checkpoint): the batches handed out beyond those are saved as not consumed."""

    def __init__(self, loader: MultiprocessShuffledDataloader, trained: Callable[[], int] | None = None) -> None:
        super().__init__(loader)
        self._trained = trained
        self._handed: deque[Any] = deque(maxlen=_MAX_AHEAD)
        self._yielded = 0
        self._trained_at_start = 0

    def __iter__(self) -> Iterator[Any]:
        self._handed.clear()
        self._yielded = 0
        self._trained_at_start = self._trained() if self._trained is not None else 0
        for batch in self.loader:
            self._yielded += 1
            self._handed.append(batch)
            # Keep only what may still be untrained: holding a batch holds its ring slot.
            while len(self._handed) > max(0, self._ahead()):
                self._handed.popleft()
            yield batch

    def _ahead(self) -> int:
        if self._trained is None:
            return 0
        return self._yielded - (self._trained() - self._trained_at_start)

    def untrained(self) -> list[Any]:
        """The batches handed out and not yet taken into a training step, oldest first."""
        ahead = self._ahead()
        if ahead <= 0:
            return []
        if ahead > len(self._handed):
            raise CheckpointError(
                f"StatefulLoader: {ahead} batches were handed out and not trained on, more than the {_MAX_AHEAD} "
                "a framework may fetch ahead; the trained count the framework gave is wrong"
            )
        return list(self._handed)[-ahead:]

    def state_dict(self) -> dict[str, Any]:
        return self.loader.gathered_state_dict(unconsumed=self.untrained())

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
