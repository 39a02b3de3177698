"""Per-sample sources (Hugging Face ``datasets``, webdataset, any iterable of dicts) as gigashuffle datasets.

A gigashuffle dataset yields chunks, ``list[dict[str, Tensor]]``; most sources yield one sample (a dict) at a time.
:class:`Chunked` groups their samples into chunks of ``rows`` rows, stacking each field. :class:`Sharded` (from
gigashuffle/shards.py) reads a list of shard files in chunks, with checkpoints that resume on another world size or
``num_writers``.

NOTE [ Splitting a source ]
Writers see a job-wide ``torch.utils.data.get_worker_info()`` (``id`` over every writer of every rank), and both
Hugging Face ``IterableDataset`` and webdataset's default ``split_by_worker`` split their shards on it: that alone
gives every writer of the job its own share. A source that is *also* split by node or rank
(``datasets.distributed.split_dataset_by_node``, ``webdataset.split_by_node``) would be split twice and silently
read ``1 / world_size`` of the data, so :class:`Chunked` refuses one. A source with fewer shards than the job has
writers leaves some writers nothing; they idle (NOTE [ Empty shares ] in procs/writer.py), which is not an error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from gigashuffle.errors import CheckpointError
from gigashuffle.shards import NpyReader, ParquetReader, PtReader, Sharded

__all__ = ["Chunk", "Chunked", "NpyReader", "ParquetReader", "PtReader", "Sharded", "chunks", "reshard_of"]

Chunk = list[dict[str, torch.Tensor]]


def node_split_of(source: Any) -> str | None:
    """How ``source`` is already split by node or rank, in words, or None if it is not (as far as we can tell)."""
    distributed = getattr(source, "_distributed", None)  # set by datasets.distributed.split_dataset_by_node
    if distributed is not None:
        return (
            f"it was split with datasets.distributed.split_dataset_by_node(rank={getattr(distributed, 'rank', '?')}, "
            f"world_size={getattr(distributed, 'world_size', '?')})"
        )
    if _stages_named(source, "split_by_node"):
        return "its pipeline has webdataset.split_by_node"
    return None


def _stages_named(source: Any, name: str) -> bool:
    """Whether a webdataset pipeline (its ``pipeline`` list of stages) has a stage called ``name``."""
    stages = getattr(source, "pipeline", None)
    if not isinstance(stages, list):
        return False
    return any(getattr(stage, "__name__", None) == name for stage in stages)


def _as_tensor(key: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic, bool, int, float)) or (
        isinstance(value, (list, tuple)) and not any(isinstance(v, (str, bytes)) for v in value)
    ):
        return torch.as_tensor(value)
    raise TypeError(
        f"Chunked: sample field {key!r} is a {type(value).__name__}, which has no tensor form; pass fields=(...) "
        "naming only numeric fields, or decode it first (e.g. webdataset's .decode(), datasets' .map())"
    )


def chunks(samples: Iterable[Mapping[str, Any]], rows: int, fields: Sequence[str] | None = None) -> Iterator[Chunk]:
    """Group ``samples`` into chunks of ``rows`` rows (the last one of a pass may be shorter).

    Each field of a chunk is the samples' values stacked along a new first dimension; ``fields`` picks the fields
    (default: every field whose name does not start with ``__``, so webdataset's ``__key__``/``__url__`` stay out).
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"Chunked: rows={rows!r} is invalid: use a positive int (rows per chunk)")
    pending: list[Mapping[str, Any]] = []
    keys: Sequence[str] | None = fields
    for sample in samples:
        if keys is None:
            keys = [k for k in sample if not k.startswith("__")]
        pending.append(sample)
        if len(pending) == rows:
            yield _stack(pending, keys)
            pending = []
    if pending and keys is not None:
        yield _stack(pending, keys)


def _stack(samples: list[Mapping[str, Any]], keys: Sequence[str]) -> Chunk:
    group: dict[str, torch.Tensor] = {}
    for key in keys:
        try:
            values = [_as_tensor(key, sample[key]) for sample in samples]
        except KeyError as exc:
            raise KeyError(
                f"Chunked: a sample has no field {key!r}; every sample must have the fields {list(keys)}"
            ) from exc
        group[key] = torch.stack(values)
    return [group]


class Chunked(IterableDataset):  # type: ignore[type-arg]
    """A gigashuffle dataset over a per-sample ``source``: chunks of ``rows`` samples, fields stacked.

    ``source`` is iterated afresh for each pass in each writer, so it must be picklable and split itself by
    ``get_worker_info()`` (Hugging Face ``IterableDataset`` and webdataset do), never by node: see
    NOTE [ Splitting a source ]. ``transform`` maps each sample before it is stacked.
    """

    def __init__(
        self,
        source: Iterable[Mapping[str, Any]],
        rows: int,
        fields: Sequence[str] | None = None,
        transform: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    ) -> None:
        split = node_split_of(source)
        if split is not None:
            raise ValueError(
                f"Chunked: the source {type(source).__name__} is already split by node: {split}. gigashuffle writers "
                "see a job-wide get_worker_info() that the source splits on, so a node split on top reads only "
                "1/world_size of the data; pass the unsplit source (see NOTE [ Splitting a source ] in "
                "gigashuffle.sources)"
            )
        if _stages_named(source, "single_node_only") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                "Chunked: the source is a webdataset pipeline with the default nodesplitter=single_node_only, which "
                "fails under torchrun with WORLD_SIZE > 1; pass WebDataset(..., nodesplitter=None): gigashuffle "
                "writers already split the shards over the whole job through get_worker_info()"
            )
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"Chunked: rows={rows!r} is invalid: use a positive int (rows per chunk)")
        self.source = source
        self.rows = rows
        self.fields = tuple(fields) if fields is not None else None
        self.transform = transform

    def state_dict(self) -> Any:
        """The source's ``state_dict()``: a chunk is stacked from samples the source has yielded, so between two
        chunks the source's position is exactly past the last chunk (``loader.state_dict()`` asks then)."""
        return _stateful_source(self.source).state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Hand ``state`` to the source; the next ``iter(self)`` reads on from there."""
        _stateful_source(self.source).load_state_dict(state)

    def __iter__(self) -> Iterator[Chunk]:
        samples: Iterable[Mapping[str, Any]] = self.source
        if self.transform is not None:
            samples = map(self.transform, samples)
        yield from chunks(samples, self.rows, self.fields)
        _forget_loaded_state(self.source)


def _forget_loaded_state(source: Any) -> None:
    """A pass ended: a Hugging Face ``IterableDataset`` starts every ``iter()`` of its epoch from the state it was
    last loaded with (its private ``_starting_state_dict``), so every pass after a resume would start at the
    resumed position again; the next pass must start at the start. Without that attribute, nothing to do."""
    if getattr(source, "_starting_state_dict", None) is not None:
        source._starting_state_dict = None


def _stateful_source(source: Any) -> Any:
    if not (callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))):
        raise CheckpointError(
            f"Chunked: its source {type(source).__name__} has no state_dict()/load_state_dict(), so the loader "
            "cannot checkpoint it; use a source that has them (a Hugging Face datasets IterableDataset does: "
            "Dataset.to_iterable_dataset(num_shards=...)), or implement them on the source"
        )
    return source


def missing_state_methods(dataset: Any) -> str | None:
    """Why ``dataset`` cannot be checkpointed, in words, or None if it has ``state_dict``/``load_state_dict``."""
    if isinstance(dataset, Chunked):
        source = dataset.source
        if callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None)):
            return None
        return (
            f"its source {type(source).__name__} has no state_dict()/load_state_dict(); use a source that has "
            "them (a Hugging Face datasets IterableDataset, e.g. Dataset.to_iterable_dataset(num_shards=...)), or "
            "implement them on the source"
        )
    missing = [name for name in ("state_dict", "load_state_dict") if not callable(getattr(dataset, name, None))]
    if not missing:
        return None
    return (
        f"it has no {'/'.join(m + '()' for m in missing)}; implement state_dict() (the dataset's position, as "
        "ints, strings, lists and dicts of them) and load_state_dict(state) (after which iter(dataset) reads on "
        "from that position)"
    )


def reshard_of(dataset: Any) -> Callable[..., list[Any]] | None:
    """The dataset's ``reshard_states`` (NOTE [ Elastic resume ] in trainer/elastic.py), a :class:`Chunked`'s taken
    from its source (a chunk's rows are the source's samples, so a skip of rows is a skip of samples); None if it
    has none."""
    owner = dataset.source if isinstance(dataset, Chunked) else dataset
    reshard = getattr(owner, "reshard_states", None)
    return reshard if callable(reshard) else None
