"""``DataloaderConfig``: every knob of a loader, validated once, in the training process.

Each invalid value raises ``ValueError``/``TypeError`` naming the field, the value and the fix, so that a
misconfigured job fails at construction instead of hanging in a child process later.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import torch

_QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9._\-/@+=]{1,200}$")
# '@' separates queue and node in every Redis key's hash tag (control/keys.py); a node id without it splits one
# way only.
_NODE_ID_RE = re.compile(r"^[A-Za-z0-9._\-/+=]{1,200}$")
_URL_SCHEMES = ("redis://", "rediss://", "unix://")
_URL_FIX = "use redis://host:port/db, rediss://... or unix:///path/to.sock"
REDIS_URL_ENV = "GIGASHUFFLE_REDIS_URL"
_DEVICE_RE = re.compile(r"^(cpu|cuda)(:[0-9]+)?$")
SEED_LIMIT = 2**63
MOST_STRIPES = 16  # the most lock_stripes a config may ask for (the table's layout allows more: shm/journal.py)
BATCH_FORMATS = ("list", "dict")
# How a checkpoint brings its unconsumed rows back: NOTE [ Positions checkpoint ] in checkpoint/positions.py.
CHECKPOINT_ROWS = ("saved", "positions")
"""Seeds are in ``[0, SEED_LIMIT)``: every writer seed then fits torch's, numpy's (mod 2**32) and random's."""


# The rank fields and the variables torchrun (and torch.distributed's other launchers) sets for them, with the
# value a process started by hand has.
RANK_ENV: tuple[tuple[str, str, int], ...] = (
    ("local_rank", "LOCAL_RANK", 0),
    ("global_rank", "RANK", 0),
    ("local_world_size", "LOCAL_WORLD_SIZE", 1),
    ("global_world_size", "WORLD_SIZE", 1),
)


def redis_url_in_use(explicit: str | None, where: str = "redis_url") -> str | None:
    """The one Redis a loader or the CLI is pointed at: ``explicit`` (a config's URL, or ``--redis``), else
    ``$GIGASHUFFLE_REDIS_URL``; None means the embedded server. A URL of another scheme is a ValueError that says
    where it came from."""
    if explicit:
        url = explicit
    elif env_url := os.environ.get(REDIS_URL_ENV):
        where, url = REDIS_URL_ENV, env_url
    else:
        return None
    if not url.startswith(_URL_SCHEMES):
        unset = ", or unset it to use the embedded server" if where == REDIS_URL_ENV else ""
        raise ValueError(f"{where} {url!r} is invalid: {_URL_FIX}{unset}")
    return url


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


def _fail(field: str, value: object, fix: str) -> ValueError:
    return ValueError(f"DataloaderConfig.{field}={value!r} is invalid: {fix}")


def _env_int(variable: str, field: str, least: int) -> int | None:
    raw = os.environ.get(variable)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = least - 1  # reported below with the raw text
    if value < least:
        raise ValueError(
            f"environment variable {variable}={raw!r} (for DataloaderConfig.{field}) is invalid: it must be an int "
            f">= {least}, as torchrun sets it; unset it, fix the launcher, or pass {field}= to from_env explicitly"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class DataloaderConfig:
    """Configuration of one :class:`~gigashuffle.MultiprocessShuffledDataloader`.

    ``bs`` is the output batch size per rank; ``shuffle_size`` the number of rows (slots) in the node-wide
    buffer; ``queue_name`` names the buffer and must be unique among the loaders that share a Redis server.
    ``num_readers=0`` makes a rank that only feeds its node's buffer (it yields no batches). ``seed`` is the
    base of every writer's seed (``seed + worker id``, as torch's DataLoader does); None draws one per job.
    ``pin_memory=True`` registers this rank's reader rings with CUDA so that host-to-device copies run at pinned
    speed; ``device="cuda:N"`` (or a ``torch.device``) also returns every batch already on that device (the rings are
    then pinned whatever ``pin_memory`` says). Both are checked against the machine when the loader is built.
    ``ring_depth`` is how many batches each reader keeps in flight; None picks 4 to 8 by batch size (see
    :func:`gigashuffle.shm.buffer.ring_depth_for`).
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

    bs: int
    shuffle_size: int
    queue_name: str
    min_mixing: float = 0.5
    num_writers: int = 2
    num_readers: int = 2
    writer_max_retries: int = 100
    fill_once: bool = False
    evict_on_read: bool = True
    local_rank: int = 0
    global_rank: int = 0
    local_world_size: int = 1
    global_world_size: int = 1
    redis_url: str | None = None
    redis_host: str | None = None
    redis_port: int | None = None
    redis_db: int | None = None
    max_restarts: int = 3
    ring_depth: int | None = None
    lock_stripes: int = 1
    node_id: str | None = None
    redis_timeout_s: float = 30.0
    seed: int | None = None
    pin_memory: bool = False
    device: str | torch.device | None = None
    batch_format: str = "list"
    index_key: bool = True
    steps_per_epoch: int | None = None
    checkpoint_rows: str = "saved"
    first_mix_wait_s: float = 10.0

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
        self._check_types()
        self._check_ranges()
        self._check_ranks()
        self._check_modes()
        self._check_batches()
        self._check_capacity()
        self._check_redis()
        self._check_device()

    @property
    def node(self) -> str:
        """Which node's buffer this rank shares: ranks with the same node share one buffer per queue.

        Defaults to ``global_rank // local_world_size``, which is torchrun's node rank for the homogeneous jobs
        torchrun launches, so two simulated nodes on one machine (``--node-rank 0/1``) stay apart.
        """
        if self.node_id is not None:
            return self.node_id
        return f"n{self.global_rank // self.local_world_size}"

    @property
    def min_full_slots(self) -> int:
        """Full slots a reader needs before it may take a batch (the mixing threshold)."""
        # round() drops float noise: 0.07 * 100 is 7.000000000000001, which must need 7 slots, not 8.
        return max(self.bs, math.ceil(round(self.min_mixing * self.shuffle_size, 9)))

    @property
    def readers_per_node(self) -> int:
        return self.local_world_size * self.num_readers

    @property
    def delivers_once(self) -> bool:
        """Whether each row is delivered once (not ``fill_once``, ``evict_on_read``): the one mode whose checkpoints
        save the rows read and not delivered (NOTE [ Checkpoint cut ] in checkpoint/cut.py); the others save only
        the datasets' positions."""
        return not self.fill_once and self.evict_on_read

    def _check_types(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("min_mixing", "redis_timeout_s", "first_mix_wait_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"DataloaderConfig.{f.name}={value!r} must be a number")
            elif f.type in ("int", "int | None") and value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"DataloaderConfig.{f.name}={value!r} must be an int")
            elif f.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"DataloaderConfig.{f.name}={value!r} must be True or False")
            elif f.type in ("str", "str | None") and value is not None and not isinstance(value, str):
                raise TypeError(f"DataloaderConfig.{f.name}={value!r} must be a str")

    def _check_ranges(self) -> None:
        if self.bs <= 0:
            raise _fail("bs", self.bs, "the output batch size must be a positive int")
        if self.shuffle_size <= 0:
            raise _fail("shuffle_size", self.shuffle_size, "the buffer needs a positive number of slots")
        if self.shuffle_size >= 2**31:  # the slot table journals slot ids as int32
            raise _fail(
                "shuffle_size", self.shuffle_size, "a node buffer holds at most 2**31 - 1 slots; use a smaller one"
            )
        if not _QUEUE_NAME_RE.match(self.queue_name):
            raise _fail(
                "queue_name",
                self.queue_name,
                "use 1-200 characters from letters, digits and ._-/@+= (no spaces, braces or colons), "
                "unique per loader",
            )
        if not 0.0 <= self.min_mixing <= 1.0 or math.isnan(self.min_mixing):
            raise _fail("min_mixing", self.min_mixing, "it is a fraction of shuffle_size: use a value in [0, 1]")
        for name in ("num_writers", "writer_max_retries"):
            if getattr(self, name) < 1:
                raise _fail(name, getattr(self, name), "use 1 or more")
        if self.num_readers < 0:
            raise _fail("num_readers", self.num_readers, "use 1 or more, or 0 for a rank that only feeds the buffer")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise _fail("seed", self.seed, "use an int in [0, 2**63), or None for a random seed per job")
        if self.ring_depth is not None and self.ring_depth < 2:
            raise _fail(
                "ring_depth", self.ring_depth, "readers need at least 2 batches in flight; use >= 2, or None (auto)"
            )
        stripes = self.lock_stripes
        if not 1 <= stripes <= MOST_STRIPES or (stripes > 1 and self.shuffle_size < stripes * self.bs * 4):
            raise _fail(
                "lock_stripes",
                self.lock_stripes,
                f"use 1 to {MOST_STRIPES}, with shuffle_size >= lock_stripes * bs * 4 (a stripe holds at least 4 "
                f"batches; shuffle_size={self.shuffle_size}, bs={self.bs}); 1 is one lock",
            )
        if self.max_restarts < 0:
            raise _fail("max_restarts", self.max_restarts, "use 0 (fail fast) or a positive budget")
        if not self.redis_timeout_s > 0:
            raise _fail("redis_timeout_s", self.redis_timeout_s, "use a positive number of seconds")
        if not 0 <= self.first_mix_wait_s < math.inf:
            raise _fail("first_mix_wait_s", self.first_mix_wait_s, "use a number of seconds >= 0 (0: no wait)")

    def _check_ranks(self) -> None:
        if self.local_world_size < 1:
            raise _fail("local_world_size", self.local_world_size, "use LOCAL_WORLD_SIZE from torchrun (>= 1)")
        if self.global_world_size < self.local_world_size:
            raise _fail(
                "global_world_size",
                self.global_world_size,
                f"it must be >= local_world_size={self.local_world_size}; use WORLD_SIZE from torchrun",
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise _fail("local_rank", self.local_rank, f"use a value in [0, {self.local_world_size})")
        if not 0 <= self.global_rank < self.global_world_size:
            raise _fail("global_rank", self.global_rank, f"use a value in [0, {self.global_world_size})")
        if self.node_id is not None and not _NODE_ID_RE.match(self.node_id):
            raise _fail(
                "node_id",
                self.node_id,
                "use 1-200 letters, digits and ._-/+= only ('@' separates the queue from the node in Redis keys)",
            )

    def _check_modes(self) -> None:
        if not self.fill_once:
            return
        if not self.evict_on_read:
            raise _fail("evict_on_read", False, "fill_once=True never evicts; leave evict_on_read=True")
        if self.num_readers != 1:
            raise _fail("num_readers", self.num_readers, "fill_once=True yields one ordered pass: use 1")
        if self.min_mixing != 1:
            raise _fail("min_mixing", self.min_mixing, "fill_once=True waits for a full buffer: use 1")

    def _check_batches(self) -> None:
        if self.batch_format not in BATCH_FORMATS:
            raise _fail(
                "batch_format",
                self.batch_format,
                "use 'list' (a list of one dict per group, as the dataset's chunks) or 'dict' (the one group's dict)",
            )
        if not self.index_key and not self.evict_on_read:
            raise _fail(
                "index_key", False, "evict_on_read=False needs the slot indices to evict(): leave index_key=True"
            )
        if self.checkpoint_rows not in CHECKPOINT_ROWS:
            raise _fail(
                "checkpoint_rows",
                self.checkpoint_rows,
                "use 'saved' (a checkpoint holds the unconsumed rows) or 'positions' (it holds where they came from "
                "and the writers re-read them; the dataset must re-read the same rows after load_state_dict)",
            )
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise _fail("steps_per_epoch", self.steps_per_epoch, "use a positive number of batches, or None")
        if self.steps_per_epoch is not None and self.fill_once:
            raise _fail(
                "steps_per_epoch",
                self.steps_per_epoch,
                "a fill_once pass has its own length (shuffle_size // local_world_size // bs): leave it None",
            )

    def _check_capacity(self) -> None:
        need = self.bs * self.local_world_size
        if self.shuffle_size < need:
            raise _fail(
                "shuffle_size",
                self.shuffle_size,
                f"every local rank needs a batch from the node buffer: use >= bs * local_world_size = {need}",
            )
        if self.fill_once:
            return
        # Every other reader of the node may hold one batch of slots while this one waits for the mixing
        # threshold; the threshold must still be reachable then, or the node deadlocks.
        held_by_others = max(self.readers_per_node - 1, 0) * self.bs
        if self.min_full_slots + held_by_others > self.shuffle_size:
            # Rounded down to the 3 decimals shown, so that the value suggested is itself accepted.
            most = (self.shuffle_size - held_by_others) * 1000 // self.shuffle_size / 1000
            raise _fail(
                "min_mixing",
                self.min_mixing,
                f"with {self.readers_per_node} readers on the node each holding bs={self.bs} slots, "
                f"{self.min_full_slots} full slots can never be reached in a buffer of {self.shuffle_size}; "
                f"use min_mixing <= {max(most, 0):.3f} or a larger shuffle_size",
            )

    def _check_redis(self) -> None:
        url = self.redis_url
        if url is not None and not url.startswith(_URL_SCHEMES):
            raise _fail("redis_url", url, _URL_FIX)
        legacy = (self.redis_host, self.redis_port, self.redis_db)
        if url is not None and any(v is not None for v in legacy):
            raise _fail("redis_url", url, "give either redis_url or redis_host/redis_port/redis_db, not both")
        if self.redis_port is not None and not 0 < self.redis_port < 65536:
            raise _fail("redis_port", self.redis_port, "use a TCP port in 1..65535")
        if self.redis_db is not None and self.redis_db < 0:
            raise _fail("redis_db", self.redis_db, "use a database number >= 0")

    def _check_device(self) -> None:
        # Only the spelling is checked here (no torch import: the CLI builds configs); whether this machine has the
        # device is checked when the loader is built (gigashuffle.trainer.pinning).
        value = self.device
        if value is None:
            return
        kind = type(value)
        if kind.__module__ == "torch" and kind.__name__ == "device":
            value = str(value)
        elif not isinstance(value, str):
            raise TypeError(f"DataloaderConfig.device={self.device!r} must be a str, a torch.device or None")
        if not _DEVICE_RE.match(value):
            raise _fail("device", self.device, "use 'cpu', 'cuda' or 'cuda:N' (or None to keep batches where they are)")

    def legacy_redis_url(self) -> str | None:
        """The seed's redis_host/redis_port/redis_db spelled as a URL, when any of them was given."""
        if all(v is None for v in (self.redis_host, self.redis_port, self.redis_db)):
            return None
        host = self.redis_host or "localhost"
        return f"redis://{host}:{self.redis_port or 6379}/{self.redis_db or 0}"
