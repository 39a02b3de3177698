"""accelerate: the loader's state in ``Accelerator.save_state``/``load_state``, for every process.

``register(accelerator, loader)`` registers the loader for checkpointing; ``save_state`` then asks every process
for its state and writes the main process's copy, which holds every rank's (NOTE [ Rank-keyed state ] in
integrations/state.py), and ``load_state`` hands each process its own part. Install with
``pip install gigashuffle[accelerate]``.
"""

from __future__ import annotations

from typing import Any

from gigashuffle import MultiprocessShuffledDataloader
from gigashuffle.integrations.state import GatheredState


def register(accelerator: Any, loader: MultiprocessShuffledDataloader) -> GatheredState:
    """Register ``loader`` with ``accelerator.register_for_checkpointing``; returns the registered object."""
    if not isinstance(loader, MultiprocessShuffledDataloader):
        raise TypeError(f"register(accelerator, loader=...) needs a MultiprocessShuffledDataloader, got {loader!r}")
    state = GatheredState(loader)
    accelerator.register_for_checkpointing(state)
    return state
