"""Per-sample sources (Hugging Face ``datasets``, webdataset, any iterable of dicts) as gigashuffle datasets.

A gigashuffle dataset yields chunks, ``list[dict[str, Tensor]]``; most sources yield one sample (a dict) at a time.
:class:`Chunked` groups their samples into chunks of ``rows`` rows, stacking each field. ``Sharded`` (from
gigashuffle/sources/shards.py) reads a list of shard files in chunks, with checkpoints that resume on another world
size or ``num_writers``.

NOTE [ Splitting a source ]
Writers see a job-wide ``torch.utils.data.get_worker_info()`` (``id`` over every writer of every rank), and both
Hugging Face ``IterableDataset`` and webdataset's default ``split_by_worker`` split their shards on it: that alone
gives every writer of the job its own share. A source that is *also* split by node or rank
(``datasets.distributed.split_dataset_by_node``, ``webdataset.split_by_node``) would be split twice and silently
read ``1 / world_size`` of the data, so :class:`Chunked` refuses one. A source with fewer shards than the job has
writers leaves some writers nothing; they idle (NOTE [ Empty shares ] in procs/chunks.py), which is not an error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset

from gigashuffle.errors import CheckpointError
from gigashuffle.sources.sourcechecks import has_state, node_split_of, shuffle_buffer_of, stages_named, why_stateless
from gigashuffle.sources.stacking import Chunk, default_fields, stack


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
            keys = default_fields(sample)
        pending.append(sample)
        if len(pending) == rows:
            yield stack(pending, keys)
            pending = []
    if pending and keys is not None:
        yield stack(pending, keys)


class Chunked(IterableDataset):  # type: ignore[type-arg]
    """A gigashuffle dataset over a per-sample ``source``: chunks of ``rows`` samples, fields stacked.

    ``source`` is iterated afresh for each pass in each writer, so it must be picklable and split itself by
    ``get_worker_info()`` (Hugging Face ``IterableDataset`` and webdataset do), never by node: see
    NOTE [ Splitting a source ]. ``transform`` maps each sample before it is stacked. ``pass_field``, if set, adds
    an int64 field of that name holding each row's pass number (each ``iter()`` is a pass) and puts the pass
    number in the state (NOTE [ Chunked state ]).
    """

    def __init__(
        self,
        source: Iterable[Mapping[str, Any]],
        rows: int,
        fields: Sequence[str] | None = None,
        transform: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
        pass_field: str | None = None,
    ) -> None:
        split = node_split_of(source)
        if split is not None:
            raise ValueError(
                f"Chunked: the source {type(source).__name__} is already split by node: {split}. gigashuffle writers "
                "see a job-wide get_worker_info() that the source splits on, so a node split on top reads only "
                "1/world_size of the data; pass the unsplit source (see NOTE [ Splitting a source ] in "
                "gigashuffle.sources)"
            )
        if stages_named(source, "single_node_only") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
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
        self.pass_field = pass_field
        self._pass = 0
        self._ended = False  # the last pass ended: the next iter() is the next pass
        # A state loaded and not read from yet (the source may still report its old one): (state,) or ().
        self._loaded: tuple[Any, ...] = ()

    def state_dict(self) -> Any:
        """The source's ``state_dict()`` (with ``pass_field``, ``{"pass": n, "source": ...}``): a chunk is stacked
        from samples the source has yielded, so between two chunks the source's position is exactly past the last
        chunk (``loader.state_dict()`` asks then). NOTE [ Chunked state ]."""
        source = _stateful_source(self.source)
        inner = self._loaded[0] if self._loaded else source.state_dict()
        return inner if self.pass_field is None else {"pass": self._pass, "source": inner}

    def load_state_dict(self, state: Any) -> None:
        """Hand ``state`` to the source; the next ``iter(self)`` reads on from there."""
        source = _stateful_source(self.source)
        if self.pass_field is not None:
            if not (isinstance(state, dict) and set(state) == {"pass", "source"} and _count(state["pass"])):
                raise CheckpointError(
                    f"Chunked.load_state_dict: with pass_field={self.pass_field!r} the state must be "
                    f"{{'pass': int, 'source': ...}} as state_dict() returns it, got {type(state).__name__} "
                    f"{str(state)[:80]!r}; resume with the same pass_field the checkpoint was taken with"
                )
            self._pass, state = state["pass"], state["source"]
        source.load_state_dict(state)
        self._loaded, self._ended = (state,), False

    def __iter__(self) -> Iterator[Chunk]:
        if self._ended:
            self._pass, self._ended = self._pass + 1, False
        self._loaded = ()  # the source reads from here on: its own state_dict() is current again
        samples: Iterable[Mapping[str, Any]] = self.source
        if self.transform is not None:
            samples = map(self.transform, samples)
        for chunk in chunks(samples, self.rows, self.fields):
            yield chunk if self.pass_field is None else _tagged(chunk, self.pass_field, self._pass)
        _forget_loaded_state(self.source)
        self._ended = True


# NOTE [ Chunked state ]
# The writer asks a dataset's state_dict() between chunks, also right after load_state_dict() and before the next
# chunk. A Hugging Face IterableDataset's state_dict() answers its last *iterated* state until an iteration starts
# (load_state_dict only notes the state to start from), so Chunked answers the loaded state itself until its next
# pass reads: else a cut or a respawn in that window would resume from the stale state. The pass number (with
# pass_field) counts iter() calls; a pass ends with the source at its end, and a state taken then is still of that
# pass: loading it reads an empty rest of the pass, then the next one. So the pass moves on when the next iter()
# starts, never at the end of one, and a resume of any state reads every row once per pass.


def _tagged(chunk: Chunk, field: str, pass_: int) -> Chunk:
    group = chunk[0]
    n = len(next(iter(group.values())))
    return [{**group, field: torch.full((n,), pass_, dtype=torch.int64)}, *chunk[1:]]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _forget_loaded_state(source: Any) -> None:
    """A pass ended: a Hugging Face ``IterableDataset`` starts every ``iter()`` of its epoch from the state it was
    last loaded with (its private ``_starting_state_dict``), so every pass after a resume would start at the
    resumed position again; the next pass must start at the start. Without that attribute, nothing to do."""
    if getattr(source, "_starting_state_dict", None) is not None:
        source._starting_state_dict = None


def _stateful_source(source: Any) -> Any:
    if not has_state(source) or shuffle_buffer_of(source) is not None:
        raise CheckpointError(f"Chunked: the loader cannot checkpoint it: {why_stateless(source)}")
    return source


def missing_state_methods(dataset: Any) -> str | None:
    """Why ``dataset`` cannot be checkpointed, in words, or None if it has ``state_dict``/``load_state_dict``."""
    if isinstance(dataset, Chunked):
        source = dataset.source
        return None if has_state(source) and shuffle_buffer_of(source) is None else why_stateless(source)
    missing = [name for name in ("state_dict", "load_state_dict") if not callable(getattr(dataset, name, None))]
    if not missing:
        return None
    return (
        f"it has no {'/'.join(m + '()' for m in missing)}; implement state_dict() (the dataset's position, as "
        "ints, strings, lists and dicts of them) and load_state_dict(state) (after which iter(dataset) reads on "
        "from that position)"
    )


def reshard_of(dataset: Any) -> Callable[..., list[Any]] | None:
    """The dataset's ``reshard_states`` (NOTE [ Elastic resume ] in checkpoint/elastic.py), a :class:`Chunked`'s taken
    from its source (a chunk's rows are the source's samples, so a skip of rows is a skip of samples); None if it
    has none."""
    if isinstance(dataset, Chunked) and dataset.pass_field is not None:
        return None  # its states wrap the source's: the source's reshard_states cannot take them
    owner = dataset.source if isinstance(dataset, Chunked) else dataset
    reshard = getattr(owner, "reshard_states", None)
    return reshard if callable(reshard) else None
