"""The loader's state as the frameworks need it: keyed by rank, and gathered to every rank before a save.

NOTE [ Rank-keyed state ]
``loader.state_dict()`` is one rank's state under one key, ``f"rank{global_rank}"``; the dicts of all ranks merge
with ``dict.update``, and ``loader.load_state_dict(merged)`` takes its own rank's part. Lightning's fit loop, the
Hugging Face Trainer and accelerate's ``save_state`` write a data loader's state from rank 0 only, so each rank's
state would be lost but rank 0's: ``GatheredState.state_dict()`` therefore gathers every rank's state
(``loader.gathered_state_dict()``, an ``all_gather_object``: a collective, which these frameworks call on every
rank at the same step before writing on rank 0) and returns the merged dict, which any one rank's file then holds
whole. ``torch.distributed.checkpoint`` saves each rank's own keys, so ``RankKeyedState`` there needs no gather.
"""

from __future__ import annotations

from typing import Any

from gigashuffle import MultiprocessShuffledDataloader


class RankKeyedState:
    """The loader as a ``torch.distributed.checkpoint`` ``Stateful``: each rank saves and loads its own key."""

    def __init__(self, loader: MultiprocessShuffledDataloader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)  # takes its own rank's part; a missing one: CheckpointError


class GatheredState(RankKeyedState):
    """The loader's state for frameworks that save from rank 0 only: every rank's state, gathered on each."""

    def state_dict(self) -> dict[str, Any]:
        return self.loader.gathered_state_dict()


class StatefulLoader(GatheredState):
    """The loader as a framework's data loader: iterates it, and its ``state_dict`` is the gathered one, so a
    framework that checkpoints its loaders' states from rank 0 (Lightning's fit loop) restores every rank."""

    def __iter__(self) -> Any:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
