"""What gigashuffle can tell about a per-sample source without reading it: its node split, whether its state resumes.

The sources are Hugging Face ``datasets`` and webdataset pipelines; where a state does not resume, the checks say why
and what to use instead."""

from __future__ import annotations

from typing import Any


def node_split_of(source: Any) -> str | None:
    """How ``source`` is already split by node or rank, in words, or None if it is not (as far as we can tell)."""
    distributed = getattr(source, "_distributed", None)  # set by datasets.distributed.split_dataset_by_node
    if distributed is not None:
        return (
            f"it was split with datasets.distributed.split_dataset_by_node(rank={getattr(distributed, 'rank', '?')}, "
            f"world_size={getattr(distributed, 'world_size', '?')})"
        )
    if stages_named(source, "split_by_node"):
        return "its pipeline has webdataset.split_by_node"
    return None


def stages_named(source: Any, name: str) -> bool:
    """Whether a webdataset pipeline (its ``pipeline`` list of stages) has a stage called ``name``."""
    stages = getattr(source, "pipeline", None)
    if not isinstance(stages, list):
        return False
    return any(getattr(stage, "__name__", None) == name for stage in stages)


def is_webdataset(source: Any) -> bool:
    return type(source).__module__.split(".")[0] == "webdataset"


def why_stateless(source: Any) -> str:
    buffer = shuffle_buffer_of(source)
    if buffer is not None:
        return (
            f"its source shuffles with a Hugging Face buffer (IterableDataset.shuffle(buffer_size={buffer})), whose "
            "rows are not in its state_dict(): a resume would lose them (and datasets 5.x cannot load such a state "
            "in a worker). gigashuffle's buffer shuffles already: drop .shuffle() from the source"
        )
    if is_webdataset(source):
        return (
            f"its source is a webdataset pipeline ({type(source).__name__}), which has no state_dict(); read the "
            "tar shards with gigashuffle.sources.Sharded(shards, TarReader(transform=...), rows=...) instead: it "
            "checkpoints exactly and resumes on any world size or num_writers (README: Data sources)"
        )
    return (
        f"its source {type(source).__name__} has no state_dict()/load_state_dict(); use a source that has them (a "
        "Hugging Face datasets IterableDataset, e.g. Dataset.to_iterable_dataset(num_shards=...); for webdataset "
        "tar shards, Sharded(shards, TarReader(...), rows=...)), or implement them on the source"
    )


def shuffle_buffer_of(source: Any) -> Any:
    """The buffer size of a Hugging Face ``IterableDataset.shuffle(buffer_size=...)`` in ``source``, else None."""
    stack = [getattr(source, "_ex_iterable", None)]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return getattr(node, "buffer_size", "?")
        stack.append(getattr(node, "ex_iterable", None))
        stack.extend(getattr(node, "ex_iterables", None) or ())
    return None


def has_state(source: Any) -> bool:
    return callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))
