"""``DataloaderConfig``: every knob of a loader, validated once, in the training process.

Each invalid value raises ``ValueError``/``TypeError`` naming the field, the value and the fix, so that a
misconfigured job fails at construction instead of hanging in a child process later.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields
from typing import Any, Self

from gigashuffle.config.checks import BATCH_FORMATS, CHECKPOINT_ROWS, MOST_STRIPES, SEED_LIMIT, check
from gigashuffle.config.environment import RANK_ENV, REDIS_URL_ENV, _env_int, redis_url_in_use
from gigashuffle.config.settings import ConfigFields

# Keywords of torch's DataLoader (and the habits it leaves) that are not fields here, with what to write instead;
# ``{value}`` is the value given. pin_memory is a field of both, with the same meaning.
_DATALOADER_NAMES: dict[str, str] = {
    "batch_size": "use bs={value} (the output batch size per rank)",
    "num_workers": "a rank has two kinds of processes here: use num_writers={value} (processes that run the "
    "dataset) and/or num_readers={value} (processes that gather batches from the buffer)",
    "shuffle": "every batch is drawn at random from the node's buffer, so leave it out and size the buffer with "
    "shuffle_size",
    "drop_last": "every batch has bs rows, so leave it out",
    "prefetch_factor": "use ring_depth={value} (batches in flight per reader; None picks it)",
    "persistent_workers": "the loader's processes live until loader.close(), so leave it out",
    "generator": "use seed=N (writer i is seeded with seed + i)",
    "collate_fn": "a batch is the chunks' fields stacked (batch_format='dict' for model(**batch)), so leave it "
    "out and shape the rows in the dataset",
    "sampler": "rows are drawn at random from the node's buffer, so leave it out",
    "batch_sampler": "rows are drawn at random from the node's buffer, so leave it out and set bs",
    "worker_init_fn": "each writer runs a copy of the dataset, so leave it out and set a writer up in the "
    "dataset's __iter__ (get_worker_info() says which writer it is)",
    "multiprocessing_context": "the loader forks its processes from a zygote of its own, so leave it out",
}


def _unknown_fields(given: dict[str, Any]) -> TypeError | None:
    """A TypeError naming each keyword that is not a field, its value and what to write instead (a torch
    DataLoader keyword, a misspelt field); None when every keyword is a field."""
    names = [f.name for f in fields(DataloaderConfig)]
    unknown = [key for key in given if key not in names]
    if not unknown:
        return None
    fixes = []
    for key in unknown:
        if key in _DATALOADER_NAMES:
            fix = f"{key} is torch DataLoader's keyword, not a field here: " + _DATALOADER_NAMES[key].format(
                value=repr(given[key])
            )
        elif close := difflib.get_close_matches(key, names, n=1):
            fix = f"{key} is not a field: did you mean {close[0]}={given[key]!r}?"
        else:
            fix = f"{key} is not a field: the fields are {', '.join(names)}"
        fixes.append(fix)
    shown = ", ".join(f"{key}={given[key]!r}" for key in unknown)
    return TypeError(f"DataloaderConfig({shown}) is invalid: {'; '.join(fixes)}")


@dataclass(frozen=True, kw_only=True)
class DataloaderConfig(ConfigFields):
    """Configuration of one :class:`~gigashuffle.MultiprocessShuffledDataloader`.

    ``bs`` is the output batch size per rank; ``shuffle_size`` the number of rows (slots) in the node-wide
    buffer; ``queue_name`` names the buffer and must be unique among the loaders that share a Redis server.
    ``num_readers=0`` makes a rank that only feeds its node's buffer (it yields no batches). ``seed`` is the
    base of every writer's seed (``seed + worker id``, as torch's DataLoader does); None draws one per job.
    ``pin_memory=True`` registers this rank's reader rings with CUDA so that host-to-device copies run at pinned
    speed; ``device="cuda:N"`` (or a ``torch.device``) also returns every batch already on that device (the rings are
    then pinned whatever ``pin_memory`` says). Both are checked against the machine when the loader is built.
    ``ring_depth`` is how many batches each reader keeps in flight; None picks 4 to 8 by batch size (see
    :func:`gigashuffle.shm.ring.ring_depth_for`).
    ``lock_stripes=N`` splits the node's slot table into N stripes, each with its own lock (NOTE [ Stripes ] in
    shm/stripes.py): the node's ceiling on small rows grows about N-fold, at more CPU per row (tiny 80-byte rows at
    1 writer + 1 reader: about a third more; docs/benchmarks.md). 1, the default, is one lock: below about 100M
    small rows/s per node it is the cheaper choice. Every rank of a node must give the same value.
    Batches that drop into a model: ``batch_format="dict"`` yields the one group of a chunk as a plain ``dict``
    instead of a one-element list (chunks with several groups are refused when the first batch arrives);
    ``index_key=False`` leaves ``INDEX_KEY`` out of every batch (it is needed with ``evict_on_read=False``);
    ``steps_per_epoch=N`` makes each ``iter(loader)`` yield N batches and ``len(loader)`` return N, for
    schedulers and frameworks that ask for a length (the stream goes on where the last epoch stopped).
    ``checkpoint_rows``: how ``state_dict()`` brings back the rows read and not yet trained on: ``"saved"`` saves
    the rows themselves; ``"positions"`` saves where they came from and the writers re-read them (NOTE
    [ Positions checkpoint ] in checkpoint/positions.py; needs a dataset that re-reads deterministically).
    ``first_mix_wait_s``: until the node's first read each writer copies only its share of ``min_mixing``, so that
    the first batches mix every writer of the node; a writer whose share is in waits this long for the others (a
    slow first download, a rank that starts late) before it fills on alone (NOTE [ First mix ] in
    procs/firstmix.py). 0 turns the wait off.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # Before the dataclass's __init__, whose own error for a keyword it does not know is a bare "unexpected
        # keyword argument": say what to write instead (bs for batch_size, ...). Pickling and copies call
        # __new__ without keywords.
        if (unknown := _unknown_fields(kwargs)) is not None:
            raise unknown
        return super().__new__(cls)

    @classmethod
    def from_env(cls, **fields: Any) -> DataloaderConfig:
        """A config whose rank fields come from torchrun's environment, for fields not given explicitly.

        Reads ``LOCAL_RANK``, ``RANK``, ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE``; a variable that is not set gives
        the single-process value (ranks 0, world sizes 1), so the same script also runs without torchrun. A value
        that is not a non-negative int (a positive one for the world sizes) raises ``ValueError`` naming the
        variable.
        """
        from_env: dict[str, Any] = {}
        for field, variable, default in RANK_ENV:
            if field in fields:
                continue
            value = _env_int(variable, field, least=1 if field.endswith("world_size") else 0)
            from_env[field] = default if value is None else value
        try:
            return cls(**fields, **from_env)
        except ValueError as exc:
            # The rank checks name the field; say where its value came from, since the caller never wrote it.
            seen = ", ".join(f"{v}={os.environ[v]!r}" for f, v, _ in RANK_ENV if f in from_env and v in os.environ)
            if not seen:
                raise
            raise ValueError(f"{exc} (from_env read {seen})") from exc

    def __post_init__(self) -> None:
        check(self)


__all__ = [
    "BATCH_FORMATS",
    "CHECKPOINT_ROWS",
    "MOST_STRIPES",
    "RANK_ENV",
    "REDIS_URL_ENV",
    "SEED_LIMIT",
    "DataloaderConfig",
    "redis_url_in_use",
]
