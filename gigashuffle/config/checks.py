"""The checks of a ``DataloaderConfig``'s values, run once when it is built.

Each fails with the field, the value and the fix, so that a misconfigured job fails at construction instead of
hanging in a child process later.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import TYPE_CHECKING

from gigashuffle.config.environment import _URL_FIX, _URL_SCHEMES

if TYPE_CHECKING:
    from gigashuffle.config.settings import ConfigFields

_QUEUE_NAME_RE = re.compile(r"^[A-Za-z0-9._\-/@+=]{1,200}$")
# '@' separates queue and node in every Redis key's hash tag (control/keys.py); a node id without it splits one
# way only.
_NODE_ID_RE = re.compile(r"^[A-Za-z0-9._\-/+=]{1,200}$")
_DEVICE_RE = re.compile(r"^(cpu|cuda)(:[0-9]+)?$")
SEED_LIMIT = 2**63
MOST_RING_DEPTH = 1024  # ring slots per reader (shm/slotqueue.py names a slot in 20 bits)
MOST_STRIPES = 16  # the most lock_stripes a config may ask for (the table's layout allows more: shm/journal.py)
BATCH_FORMATS = ("list", "dict")
# How a checkpoint brings its unconsumed rows back: NOTE [ Positions checkpoint ] in checkpoint/positions.py.
CHECKPOINT_ROWS = ("saved", "positions")
"""Seeds are in ``[0, SEED_LIMIT)``: every writer seed then fits torch's, numpy's (mod 2**32) and random's."""


def _fail(field: str, value: object, fix: str) -> ValueError:
    return ValueError(f"DataloaderConfig.{field}={value!r} is invalid: {fix}")


def check(config: ConfigFields) -> None:
    _check_types(config)
    _check_ranges(config)
    _check_ranks(config)
    _check_modes(config)
    _check_batches(config)
    _check_capacity(config)
    _check_redis(config)
    _check_device(config)


def _check_types(config: ConfigFields) -> None:
    for f in fields(config):
        value = getattr(config, f.name)
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


def _check_ranges(config: ConfigFields) -> None:
    if config.bs <= 0:
        raise _fail("bs", config.bs, "the output batch size must be a positive int")
    if config.shuffle_size <= 0:
        raise _fail("shuffle_size", config.shuffle_size, "the buffer needs a positive number of slots")
    if config.shuffle_size >= 2**31:  # the slot table journals slot ids as int32
        raise _fail(
            "shuffle_size", config.shuffle_size, "a node buffer holds at most 2**31 - 1 slots; use a smaller one"
        )
    if not _QUEUE_NAME_RE.match(config.queue_name):
        raise _fail(
            "queue_name",
            config.queue_name,
            "use 1-200 characters from letters, digits and ._-/@+= (no spaces, braces or colons), unique per loader",
        )
    if not 0.0 <= config.min_mixing <= 1.0 or math.isnan(config.min_mixing):
        raise _fail("min_mixing", config.min_mixing, "it is a fraction of shuffle_size: use a value in [0, 1]")
    for name in ("num_writers", "writer_max_retries"):
        if getattr(config, name) < 1:
            raise _fail(name, getattr(config, name), "use 1 or more")
    if config.num_readers < 0:
        raise _fail("num_readers", config.num_readers, "use 1 or more, or 0 for a rank that only feeds the buffer")
    if config.seed is not None and not 0 <= config.seed < SEED_LIMIT:
        raise _fail("seed", config.seed, "use an int in [0, 2**63), or None for a random seed per job")
    if config.ring_depth is not None and not 2 <= config.ring_depth <= MOST_RING_DEPTH:
        raise _fail(
            "ring_depth",
            config.ring_depth,
            f"readers need at least 2 batches in flight, and a ring of more than {MOST_RING_DEPTH} holds batches no "
            f"reader fills in time; use 2 to {MOST_RING_DEPTH}, or None (auto)",
        )
    stripes = config.lock_stripes
    if not 1 <= stripes <= MOST_STRIPES or (stripes > 1 and config.shuffle_size < stripes * config.bs * 4):
        raise _fail(
            "lock_stripes",
            config.lock_stripes,
            f"use 1 to {MOST_STRIPES}, with shuffle_size >= lock_stripes * bs * 4 (a stripe holds at least 4 "
            f"batches; shuffle_size={config.shuffle_size}, bs={config.bs}); 1 is one lock",
        )
    if config.max_restarts < 0:
        raise _fail("max_restarts", config.max_restarts, "use 0 (fail fast) or a positive budget")
    if not config.redis_timeout_s > 0:
        raise _fail("redis_timeout_s", config.redis_timeout_s, "use a positive number of seconds")
    if not 0 <= config.first_mix_wait_s < math.inf:
        raise _fail("first_mix_wait_s", config.first_mix_wait_s, "use a number of seconds >= 0 (0: no wait)")


def _check_ranks(config: ConfigFields) -> None:
    if config.local_world_size < 1:
        raise _fail("local_world_size", config.local_world_size, "use LOCAL_WORLD_SIZE from torchrun (>= 1)")
    if config.global_world_size < config.local_world_size:
        raise _fail(
            "global_world_size",
            config.global_world_size,
            f"it must be >= local_world_size={config.local_world_size}; use WORLD_SIZE from torchrun",
        )
    if not 0 <= config.local_rank < config.local_world_size:
        raise _fail("local_rank", config.local_rank, f"use a value in [0, {config.local_world_size})")
    if not 0 <= config.global_rank < config.global_world_size:
        raise _fail("global_rank", config.global_rank, f"use a value in [0, {config.global_world_size})")
    if config.node_id is not None and not _NODE_ID_RE.match(config.node_id):
        raise _fail(
            "node_id",
            config.node_id,
            "use 1-200 letters, digits and ._-/+= only ('@' separates the queue from the node in Redis keys)",
        )


def _check_modes(config: ConfigFields) -> None:
    if not config.fill_once:
        return
    if not config.evict_on_read:
        raise _fail("evict_on_read", False, "fill_once=True never evicts; leave evict_on_read=True")
    if config.num_readers != 1:
        raise _fail("num_readers", config.num_readers, "fill_once=True yields one ordered pass: use 1")
    if config.min_mixing != 1:
        raise _fail("min_mixing", config.min_mixing, "fill_once=True waits for a full buffer: use 1")


def _check_batches(config: ConfigFields) -> None:
    if config.batch_format not in BATCH_FORMATS:
        raise _fail(
            "batch_format",
            config.batch_format,
            "use 'list' (a list of one dict per group, as the dataset's chunks) or 'dict' (the one group's dict)",
        )
    if not config.index_key and not config.evict_on_read:
        raise _fail("index_key", False, "evict_on_read=False needs the slot indices to evict(): leave index_key=True")
    if config.checkpoint_rows not in CHECKPOINT_ROWS:
        raise _fail(
            "checkpoint_rows",
            config.checkpoint_rows,
            "use 'saved' (a checkpoint holds the unconsumed rows) or 'positions' (it holds where they came from "
            "and the writers re-read them; the dataset must re-read the same rows after load_state_dict)",
        )
    if config.steps_per_epoch is not None and config.steps_per_epoch < 1:
        raise _fail("steps_per_epoch", config.steps_per_epoch, "use a positive number of batches, or None")
    if config.steps_per_epoch is not None and config.fill_once:
        raise _fail(
            "steps_per_epoch",
            config.steps_per_epoch,
            "a fill_once pass has its own length (shuffle_size // local_world_size // bs): leave it None",
        )


def _check_capacity(config: ConfigFields) -> None:
    need = config.bs * config.local_world_size
    if config.shuffle_size < need:
        raise _fail(
            "shuffle_size",
            config.shuffle_size,
            f"every local rank needs a batch from the node buffer: use >= bs * local_world_size = {need}",
        )
    if config.fill_once:
        return
    # Every other reader of the node may hold one batch of slots while this one waits for the mixing
    # threshold; the threshold must still be reachable then, or the node deadlocks.
    held_by_others = max(config.readers_per_node - 1, 0) * config.bs
    if config.min_full_slots + held_by_others > config.shuffle_size:
        # Rounded down to the 3 decimals shown, so that the value suggested is itself accepted.
        most = (config.shuffle_size - held_by_others) * 1000 // config.shuffle_size / 1000
        raise _fail(
            "min_mixing",
            config.min_mixing,
            f"with {config.readers_per_node} readers on the node each holding bs={config.bs} slots, "
            f"{config.min_full_slots} full slots can never be reached in a buffer of {config.shuffle_size}; "
            f"use min_mixing <= {max(most, 0):.3f} or a larger shuffle_size",
        )


def _check_redis(config: ConfigFields) -> None:
    url = config.redis_url
    if url is not None and not url.startswith(_URL_SCHEMES):
        raise _fail("redis_url", url, _URL_FIX)
    legacy = (config.redis_host, config.redis_port, config.redis_db)
    if url is not None and any(v is not None for v in legacy):
        raise _fail("redis_url", url, "give either redis_url or redis_host/redis_port/redis_db, not both")
    if config.redis_port is not None and not 0 < config.redis_port < 65536:
        raise _fail("redis_port", config.redis_port, "use a TCP port in 1..65535")
    if config.redis_db is not None and config.redis_db < 0:
        raise _fail("redis_db", config.redis_db, "use a database number >= 0")


def _check_device(config: ConfigFields) -> None:
    # Only the spelling is checked here (no torch import: the CLI builds configs); whether this machine has the
    # device is checked when the loader is built (gigashuffle.trainer.pinning).
    value = config.device
    if value is None:
        return
    kind = type(value)
    if kind.__module__ == "torch" and kind.__name__ == "device":
        value = str(value)
    elif not isinstance(value, str):
        raise TypeError(f"DataloaderConfig.device={config.device!r} must be a str, a torch.device or None")
    if not _DEVICE_RE.match(value):
        raise _fail("device", config.device, "use 'cpu', 'cuda' or 'cuda:N' (or None to keep batches where they are)")
