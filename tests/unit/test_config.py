"""DataloaderConfig validation: every invalid value fails at construction, naming the field, the value and a fix."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import re
from typing import Any

import pytest

from gigashuffle import DataloaderConfig

BASE: dict[str, Any] = {"bs": 4, "shuffle_size": 64, "queue_name": "train"}
FILL_ONCE: dict[str, Any] = {**BASE, "fill_once": True, "num_readers": 1, "min_mixing": 1.0}
TWO_LOCAL: dict[str, Any] = {**BASE, "local_world_size": 2, "global_world_size": 2}


def make(**overrides: Any) -> DataloaderConfig:
    return DataloaderConfig(**{**BASE, **overrides})


# (overrides on top of BASE, exception type, field, value named in the message, a fragment of the fix)
INVALID: list[tuple[dict[str, Any], type[Exception], str, object, str]] = [
    ({"bs": 0}, ValueError, "bs", 0, "positive"),
    ({"bs": -3}, ValueError, "bs", -3, "positive"),
    ({"shuffle_size": 0}, ValueError, "shuffle_size", 0, "positive number of slots"),
    ({"shuffle_size": 2**31}, ValueError, "shuffle_size", 2**31, "at most 2**31 - 1 slots"),
    ({"queue_name": ""}, ValueError, "queue_name", "", "1-200 characters"),
    ({"queue_name": "has space"}, ValueError, "queue_name", "has space", "no spaces, braces or colons"),
    ({"queue_name": "a:b"}, ValueError, "queue_name", "a:b", "no spaces, braces or colons"),
    ({"queue_name": "x{tag}"}, ValueError, "queue_name", "x{tag}", "no spaces, braces or colons"),
    ({"queue_name": "q" * 201}, ValueError, "queue_name", "q" * 201, "1-200 characters"),
    ({"queue_name": "bad\nname"}, ValueError, "queue_name", "bad\nname", "letters, digits"),
    ({"min_mixing": -0.1}, ValueError, "min_mixing", -0.1, "[0, 1]"),
    ({"min_mixing": 1.5}, ValueError, "min_mixing", 1.5, "[0, 1]"),
    ({"min_mixing": math.inf}, ValueError, "min_mixing", math.inf, "[0, 1]"),
    ({"num_writers": 0}, ValueError, "num_writers", 0, "1 or more"),
    ({"num_readers": -1}, ValueError, "num_readers", -1, "0 for a rank that only feeds the buffer"),
    ({"seed": -1}, ValueError, "seed", -1, "[0, 2**63)"),
    ({"seed": 2**63}, ValueError, "seed", 2**63, "or None for a random seed per job"),
    ({"seed": True}, TypeError, "seed", True, "must be an int"),
    ({"seed": 1.5}, TypeError, "seed", 1.5, "must be an int"),
    ({"writer_max_retries": 0}, ValueError, "writer_max_retries", 0, "1 or more"),
    ({"ring_depth": 1}, ValueError, "ring_depth", 1, "use 2 to 1024"),
    ({"ring_depth": 1025}, ValueError, "ring_depth", 1025, "use 2 to 1024"),
    ({"max_restarts": -1}, ValueError, "max_restarts", -1, "fail fast"),
    ({"redis_timeout_s": 0}, ValueError, "redis_timeout_s", 0, "positive number of seconds"),
    ({"redis_timeout_s": -1.0}, ValueError, "redis_timeout_s", -1.0, "positive number of seconds"),
    ({"first_mix_wait_s": -0.5}, ValueError, "first_mix_wait_s", -0.5, "seconds >= 0"),
    ({"first_mix_wait_s": float("inf")}, ValueError, "first_mix_wait_s", float("inf"), "seconds >= 0"),
    # modes
    ({**FILL_ONCE, "evict_on_read": False}, ValueError, "evict_on_read", False, "fill_once=True never evicts"),
    ({**FILL_ONCE, "num_readers": 2}, ValueError, "num_readers", 2, "fill_once=True yields one ordered pass"),
    ({**FILL_ONCE, "min_mixing": 0.5}, ValueError, "min_mixing", 0.5, "fill_once=True waits for a full buffer"),
    # batches
    ({"batch_format": "tuple"}, ValueError, "batch_format", "tuple", "use 'list'"),
    ({"batch_format": 1}, TypeError, "batch_format", 1, "must be a str"),
    ({"evict_on_read": False, "index_key": False}, ValueError, "index_key", False, "leave index_key=True"),
    ({"index_key": 0}, TypeError, "index_key", 0, "must be True or False"),
    ({"steps_per_epoch": 0}, ValueError, "steps_per_epoch", 0, "positive number of batches"),
    ({"steps_per_epoch": 2.5}, TypeError, "steps_per_epoch", 2.5, "must be an int"),
    ({**FILL_ONCE, "steps_per_epoch": 3}, ValueError, "steps_per_epoch", 3, "a fill_once pass has its own length"),
    # capacity
    ({**TWO_LOCAL, "shuffle_size": 7}, ValueError, "shuffle_size", 7, "bs * local_world_size = 8"),
    ({"bs": 8, "shuffle_size": 7}, ValueError, "shuffle_size", 7, "bs * local_world_size = 8"),
    # ranks
    ({"local_world_size": 0}, ValueError, "local_world_size", 0, "LOCAL_WORLD_SIZE"),
    ({**TWO_LOCAL, "global_world_size": 1}, ValueError, "global_world_size", 1, ">= local_world_size=2"),
    ({"local_rank": -1}, ValueError, "local_rank", -1, "[0, 1)"),
    ({**TWO_LOCAL, "local_rank": 2}, ValueError, "local_rank", 2, "[0, 2)"),
    ({"global_rank": 1}, ValueError, "global_rank", 1, "[0, 1)"),
    ({"global_rank": -1}, ValueError, "global_rank", -1, "[0, 1)"),
    ({"node_id": "a b"}, ValueError, "node_id", "a b", "letters, digits"),
    # queue "a@b" on node "c" and queue "a" on node "b@c" would share every Redis key
    ({"node_id": "b@c"}, ValueError, "node_id", "b@c", "separates the queue from the node"),
    # redis
    ({"redis_url": "http://localhost:6379"}, ValueError, "redis_url", "http://localhost:6379", "redis://host:port/db"),
    ({"redis_url": "localhost:6379"}, ValueError, "redis_url", "localhost:6379", "unix:///path/to.sock"),
    (
        {"redis_url": "redis://localhost:6379/0", "redis_host": "localhost"},
        ValueError,
        "redis_url",
        "redis://localhost:6379/0",
        "not both",
    ),
    ({"redis_url": "redis://h/0", "redis_db": 0}, ValueError, "redis_url", "redis://h/0", "not both"),
    ({"redis_port": 0}, ValueError, "redis_port", 0, "1..65535"),
    ({"redis_port": 65536}, ValueError, "redis_port", 65536, "1..65535"),
    ({"redis_db": -1}, ValueError, "redis_db", -1, ">= 0"),
    # types: bool is an int subclass and must still be refused where an int is meant
    ({"bs": True}, TypeError, "bs", True, "must be an int"),
    ({"shuffle_size": False}, TypeError, "shuffle_size", False, "must be an int"),
    ({"num_writers": True}, TypeError, "num_writers", True, "must be an int"),
    ({"redis_port": True}, TypeError, "redis_port", True, "must be an int"),
    ({"bs": 4.0}, TypeError, "bs", 4.0, "must be an int"),
    ({"bs": "4"}, TypeError, "bs", "4", "must be an int"),
    ({"min_mixing": True}, TypeError, "min_mixing", True, "must be a number"),
    ({"min_mixing": "0.5"}, TypeError, "min_mixing", "0.5", "must be a number"),
    ({"redis_timeout_s": None}, TypeError, "redis_timeout_s", None, "must be a number"),
    ({"first_mix_wait_s": "10"}, TypeError, "first_mix_wait_s", "10", "must be a number"),
    ({"fill_once": 1}, TypeError, "fill_once", 1, "must be True or False"),
    ({"evict_on_read": "yes"}, TypeError, "evict_on_read", "yes", "must be True or False"),
    ({"queue_name": 5}, TypeError, "queue_name", 5, "must be a str"),
    ({"redis_url": b"redis://x"}, TypeError, "redis_url", b"redis://x", "must be a str"),
]


@pytest.mark.parametrize(
    ("overrides", "exc_type", "field", "value", "fix"),
    INVALID,
    ids=[f"{case[2]}={case[3]!r}"[:60] for case in INVALID],
)
def test_invalid_value_names_field_value_and_fix(
    overrides: dict[str, Any], exc_type: type[Exception], field: str, value: object, fix: str
) -> None:
    with pytest.raises(exc_type) as info:
        make(**overrides)
    message = str(info.value)
    assert f"DataloaderConfig.{field}={value!r}" in message
    assert fix in message


def test_nan_min_mixing_is_refused() -> None:
    with pytest.raises(ValueError, match=r"DataloaderConfig\.min_mixing=nan is invalid: .*\[0, 1\]"):
        make(min_mixing=math.nan)


def test_value_and_type_errors_are_distinct_classes() -> None:
    # A wrong type must not be reported as a ValueError (callers and docs tell the two apart).
    with pytest.raises(TypeError) as info:
        make(bs=True)
    assert not isinstance(info.value, ValueError)


def _deadlock_suggestion(message: str) -> float:
    match = re.search(r"use min_mixing <= ([0-9.]+)", message)
    assert match, message
    return float(match.group(1))


@pytest.mark.parametrize(
    ("overrides", "readers"),
    [
        ({"bs": 4, "shuffle_size": 16, "num_readers": 2, "min_mixing": 1.0}, 2),
        ({**TWO_LOCAL, "bs": 4, "shuffle_size": 40, "num_readers": 2, "min_mixing": 0.95}, 4),
        ({"bs": 8, "shuffle_size": 100, "num_readers": 4, "min_mixing": 0.9}, 4),
        # 26/30 = 0.8666...: a suggestion rounded up to 0.867 would need 27 slots and be refused in turn.
        ({"bs": 4, "shuffle_size": 30, "num_readers": 2, "min_mixing": 1.0}, 2),
        # 7/25 = 0.28 exactly, but 0.28 * 25 is 7.000000000000001 in floating point.
        ({"bs": 6, "shuffle_size": 25, "num_readers": 4, "min_mixing": 0.5}, 4),
    ],
)
def test_min_mixing_that_would_deadlock_suggests_a_working_value(overrides: dict[str, Any], readers: int) -> None:
    with pytest.raises(ValueError) as info:
        make(**overrides)
    message = str(info.value)
    assert f"DataloaderConfig.min_mixing={overrides['min_mixing']!r}" in message
    assert f"with {readers} readers on the node" in message
    assert "or a larger shuffle_size" in message
    suggested = _deadlock_suggestion(message)
    # The fix the message proposes must itself be accepted, and the threshold must still be reachable then.
    fixed = make(**{**overrides, "min_mixing": suggested})
    held_by_others = (fixed.readers_per_node - 1) * fixed.bs
    assert fixed.min_full_slots + held_by_others <= fixed.shuffle_size


def test_deadlock_boundary_is_exact() -> None:
    # 2 readers of bs=4 in 16 slots: the other reader may hold 4, so at most 12 full slots are reachable.
    assert make(bs=4, shuffle_size=16, num_readers=2, min_mixing=0.75).min_full_slots == 12
    with pytest.raises(ValueError, match="min_mixing"):
        make(bs=4, shuffle_size=16, num_readers=2, min_mixing=0.76)


@pytest.mark.parametrize(("min_mixing", "shuffle_size", "slots"), [(0.07, 100, 7), (0.28, 25, 7), (0.3, 10, 3)])
def test_min_full_slots_ignores_float_noise(min_mixing: float, shuffle_size: int, slots: int) -> None:
    cfg = make(bs=1, shuffle_size=shuffle_size, num_readers=1, min_mixing=min_mixing)
    assert cfg.min_full_slots == slots


def test_fill_once_skips_the_deadlock_check() -> None:
    # One ordered pass waits for the whole buffer; there is no other reader to hold slots.
    cfg = make(**FILL_ONCE)
    assert cfg.min_full_slots == cfg.shuffle_size


@pytest.mark.parametrize(
    "kwargs",
    [
        # The seed's original call style: host/port/db rather than a URL.
        {"bs": 32, "shuffle_size": 4096, "queue_name": "train", "redis_host": "localhost", "redis_port": 6379},
        {"bs": 32, "shuffle_size": 4096, "queue_name": "train", "redis_host": "redis.svc", "redis_db": 3},
        {"bs": 1, "shuffle_size": 1, "queue_name": "q", "num_readers": 1, "min_mixing": 0.0},
        {
            "bs": 2,
            "shuffle_size": 8,
            "queue_name": "val/epoch-1@node+x=y",
            "fill_once": True,
            "num_readers": 1,
            "min_mixing": 1,
        },
        {"bs": 4, "shuffle_size": 64, "queue_name": "q", "redis_url": "unix:///run/redis.sock"},
        {"bs": 4, "shuffle_size": 64, "queue_name": "q", "redis_url": "rediss://cache:6380/2"},
        {
            "bs": 16,
            "shuffle_size": 1024,
            "queue_name": "q",
            "local_rank": 3,
            "global_rank": 11,
            "local_world_size": 4,
            "global_world_size": 16,
            "num_readers": 3,
            "num_writers": 5,
            "evict_on_read": False,
        },
        {"bs": 4, "shuffle_size": 64, "queue_name": "q" * 200, "node_id": "host-a.example"},
    ],
)
def test_valid_configs_are_accepted(kwargs: dict[str, Any]) -> None:
    cfg = DataloaderConfig(**kwargs)
    for key, value in kwargs.items():
        assert getattr(cfg, key) == value


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bs = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        DataloaderConfig(4, 64, "q")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("given", "fixes"),
    [
        ({"batch_size": 32}, ["DataloaderConfig(batch_size=32) is invalid", "use bs=32"]),
        ({"num_workers": 4}, ["DataloaderConfig(num_workers=4) is invalid", "num_writers=4", "num_readers=4"]),
        ({"shuffle": True}, ["DataloaderConfig(shuffle=True) is invalid", "shuffle_size"]),
        ({"prefetch_factor": 4}, ["DataloaderConfig(prefetch_factor=4) is invalid", "ring_depth=4"]),
        ({"drop_last": True}, ["DataloaderConfig(drop_last=True) is invalid", "every batch has bs rows"]),
        ({"shufle_size": 128}, ["DataloaderConfig(shufle_size=128) is invalid", "did you mean shuffle_size=128?"]),
        ({"zzz": 1}, ["DataloaderConfig(zzz=1) is invalid", "the fields are bs, shuffle_size, queue_name"]),
        (
            {"batch_size": 32, "num_workers": 4},
            ["DataloaderConfig(batch_size=32, num_workers=4) is invalid", "use bs=32", "num_writers=4"],
        ),
    ],
)
def test_a_torch_dataloader_keyword_names_the_field_to_use(given: dict[str, Any], fixes: list[str]) -> None:
    base = {k: v for k, v in BASE.items() if k != "bs"}  # batch_size instead of bs: the error is about batch_size
    with pytest.raises(TypeError) as refused:
        DataloaderConfig(**base, **given)
    for fix in fixes:
        assert fix in str(refused.value), str(refused.value)
    with pytest.raises(TypeError) as from_env:
        DataloaderConfig.from_env(**base, **given)
    assert str(from_env.value) == str(refused.value)


def test_pin_memory_is_a_field_as_in_torch_and_copies_still_work() -> None:
    cfg = make(pin_memory=True)
    assert cfg.pin_memory is True
    assert dataclasses.replace(cfg, bs=8).bs == 8
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert copy.deepcopy(cfg) == cfg


@pytest.mark.parametrize(
    ("ranks", "node"),
    [
        ({}, "n0"),
        ({"local_rank": 1, "global_rank": 5, "local_world_size": 4, "global_world_size": 8}, "n1"),
        ({"local_rank": 3, "global_rank": 3, "local_world_size": 4, "global_world_size": 8}, "n0"),
        ({"local_rank": 0, "global_rank": 4, "local_world_size": 4, "global_world_size": 8}, "n1"),
        ({"global_rank": 7, "global_world_size": 8}, "n7"),
        ({"global_rank": 5, "local_world_size": 4, "global_world_size": 8, "local_rank": 1, "node_id": "h1"}, "h1"),
    ],
)
def test_node_groups_ranks_of_one_machine(ranks: dict[str, Any], node: str) -> None:
    assert make(shuffle_size=256, **ranks).node == node


def test_derived_thresholds() -> None:
    cfg = make(bs=4, shuffle_size=64, min_mixing=0.3, num_readers=3, local_world_size=2, global_world_size=2)
    assert cfg.min_full_slots == math.ceil(0.3 * 64)
    assert cfg.readers_per_node == 6
    # The batch size is a floor: a reader always needs a whole batch of full slots.
    assert make(bs=4, shuffle_size=64, min_mixing=0.0).min_full_slots == 4


@pytest.mark.parametrize(
    ("legacy", "url"),
    [
        ({}, None),
        ({"redis_host": "cache"}, "redis://cache:6379/0"),
        ({"redis_port": 6380}, "redis://localhost:6380/0"),
        ({"redis_db": 2}, "redis://localhost:6379/2"),
        ({"redis_db": 0}, "redis://localhost:6379/0"),
        ({"redis_host": "10.0.0.5", "redis_port": 7000, "redis_db": 15}, "redis://10.0.0.5:7000/15"),
    ],
)
def test_legacy_redis_url(legacy: dict[str, Any], url: str | None) -> None:
    assert make(**legacy).legacy_redis_url() == url


def test_redis_url_alone_has_no_legacy_url() -> None:
    cfg = make(redis_url="redis://127.0.0.1:1234/0")
    assert cfg.redis_url == "redis://127.0.0.1:1234/0"
    assert cfg.legacy_redis_url() is None


def test_a_writer_only_rank_and_explicit_seeds_are_accepted() -> None:
    assert make(num_readers=0).num_readers == 0
    assert make(**TWO_LOCAL, num_readers=0, min_mixing=1.0).readers_per_node == 0
    assert make(seed=0).seed == 0
    assert make(seed=2**63 - 1).seed == 2**63 - 1
    assert make().seed is None


TORCHRUN_VARS = ("LOCAL_RANK", "RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_from_env_reads_torchrun_variables(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in zip(TORCHRUN_VARS, ("1", "5", "4", "8"), strict=True):
        clean_env.setenv(name, value)
    cfg = DataloaderConfig.from_env(**{**BASE, "shuffle_size": 256})
    ranks = (cfg.local_rank, cfg.global_rank, cfg.local_world_size, cfg.global_world_size)
    assert ranks == (1, 5, 4, 8)
    assert cfg.node == "n1"
    assert (cfg.bs, cfg.queue_name) == (BASE["bs"], BASE["queue_name"])


def test_from_env_without_variables_is_a_single_process(clean_env: pytest.MonkeyPatch) -> None:
    assert DataloaderConfig.from_env(**BASE) == make()


def test_from_env_explicit_fields_win(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LOCAL_RANK", "not-even-an-int")  # never read: the caller gave local_rank
    clean_env.setenv("RANK", "3")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    clean_env.setenv("WORLD_SIZE", "4")
    cfg = DataloaderConfig.from_env(**BASE, local_rank=0, global_rank=2)
    assert (cfg.local_rank, cfg.global_rank, cfg.local_world_size, cfg.global_world_size) == (0, 2, 2, 4)


def test_from_env_reads_only_missing_variables(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("WORLD_SIZE", "3")
    clean_env.setenv("RANK", "2")
    cfg = DataloaderConfig.from_env(**BASE)
    # No LOCAL_* variables: one process per node, as for a launcher that sets only RANK and WORLD_SIZE.
    assert (cfg.local_rank, cfg.global_rank, cfg.local_world_size, cfg.global_world_size) == (0, 2, 1, 3)


@pytest.mark.parametrize(
    ("variable", "raw", "field"),
    [
        ("LOCAL_RANK", "abc", "local_rank"),
        ("RANK", "", "global_rank"),
        ("RANK", "-1", "global_rank"),
        ("LOCAL_WORLD_SIZE", "0", "local_world_size"),
        ("WORLD_SIZE", "2.0", "global_world_size"),
    ],
)
def test_from_env_malformed_variable_names_variable_value_and_fix(
    clean_env: pytest.MonkeyPatch, variable: str, raw: str, field: str
) -> None:
    clean_env.setenv(variable, raw)
    with pytest.raises(ValueError) as info:
        DataloaderConfig.from_env(**BASE)
    message = str(info.value)
    assert f"environment variable {variable}={raw!r}" in message
    assert f"DataloaderConfig.{field}" in message
    assert f"pass {field}= to from_env" in message


def test_from_env_inconsistent_ranks_say_where_they_came_from(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "4")
    clean_env.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError) as info:
        DataloaderConfig.from_env(**BASE)
    message = str(info.value)
    assert "DataloaderConfig.global_rank=4 is invalid: use a value in [0, 4)" in message
    assert "from_env read RANK='4', WORLD_SIZE='4'" in message


def test_from_env_still_validates_other_fields(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"DataloaderConfig\.bs=0 is invalid"):
        DataloaderConfig.from_env(**{**BASE, "bs": 0})
    with pytest.raises(TypeError, match="required"):
        DataloaderConfig.from_env(bs=4)


def test_ring_depth_defaults_to_automatic_and_takes_a_depth_of_2_or_more() -> None:
    assert DataloaderConfig(bs=4, shuffle_size=64, queue_name="q").ring_depth is None
    assert DataloaderConfig(bs=4, shuffle_size=64, queue_name="q", ring_depth=2).ring_depth == 2
    with pytest.raises(ValueError, match=r"ring_depth.*None \(auto\)"):
        DataloaderConfig(bs=4, shuffle_size=64, queue_name="q", ring_depth=0)


def test_only_the_mode_that_delivers_each_row_once_saves_rows_at_a_checkpoint() -> None:
    def mode(**settings: Any) -> bool:
        return DataloaderConfig(bs=4, shuffle_size=64, queue_name="q", **settings).delivers_once

    assert mode() and not mode(evict_on_read=False)
    assert not mode(fill_once=True, num_readers=1, min_mixing=1.0)


def test_lock_stripes_defaults_to_one_lock_and_names_its_bounds() -> None:
    assert DataloaderConfig(bs=4, shuffle_size=64, queue_name="q").lock_stripes == 1
    assert DataloaderConfig(bs=4, shuffle_size=64, queue_name="q", lock_stripes=4).lock_stripes == 4
    for bad, why in ((0, "use 1 to 16"), (17, "use 1 to 16"), (5, r"shuffle_size=64, bs=4")):
        with pytest.raises(ValueError, match=rf"DataloaderConfig\.lock_stripes={bad} is invalid: .*{why}"):
            DataloaderConfig(bs=4, shuffle_size=64, queue_name="q", lock_stripes=bad)
