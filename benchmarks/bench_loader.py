"""Loader throughput, start-up, memory and Redis traffic against the copy floor and a DataLoader.

Every workload is measured once, in ``setup_cache`` (module level, so all classes share one run), by
:func:`gigashuffle.bench.runner.run_workload`; the ``track_*`` benchmarks only read figures from it.
``GIGASHUFFLE_ASV_SECONDS`` sets the timed seconds per implementation (default 3, which keeps a full
``asv run`` at about a minute per workload on 2 cores).
"""

from __future__ import annotations

import math
import os
from typing import Any

from gigashuffle.bench.runner import run_workload
from gigashuffle.bench.workloads import WORKLOADS

Cache = dict[str, dict[str, Any]]

SECONDS = float(os.environ.get("GIGASHUFFLE_ASV_SECONDS", "3"))
WORKLOAD_NAMES = list(WORKLOADS)
IMPLS = ["loader", "copy_floor", "dataloader"]
NAN = math.nan


def setup_cache() -> Cache:
    return {name: run_workload(name, seconds=SECONDS) for name in WORKLOAD_NAMES}


setup_cache.timeout = 1200  # type: ignore[attr-defined]


def _figure(value: Any) -> float:
    return NAN if value is None else float(value)


class SamplesPerSecond:
    params = (WORKLOAD_NAMES, IMPLS)
    param_names = ("workload", "impl")
    unit = "samples/s"

    def track_rate(self, cache: Cache, workload: str, impl: str) -> float:
        return _figure(cache[workload][impl]["samples_per_s"])


class MegabytesPerSecond:
    params = (WORKLOAD_NAMES, IMPLS)
    param_names = ("workload", "impl")
    unit = "MB/s"

    def track_rate(self, cache: Cache, workload: str, impl: str) -> float:
        return _figure(cache[workload][impl]["mb_per_s"])


class LoaderRatios:
    """The loader's rate over each baseline's, and its start-up over ``python -c 'import torch'``."""

    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    unit = "ratio"

    def track_vs_copy_floor(self, cache: Cache, workload: str) -> float:
        return _figure(cache[workload].get("loader_vs_floor"))

    def track_vs_dataloader(self, cache: Cache, workload: str) -> float:
        return _figure(cache[workload].get("loader_vs_dataloader"))

    def track_startup_vs_import_torch(self, cache: Cache, workload: str) -> float:
        return _figure(cache[workload]["loader"]["startup_vs_import_torch"])


class StartUp:
    """Seconds from constructing the loader to its dummy batch, and of a bare ``import torch``."""

    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    unit = "seconds"

    def track_loader_startup(self, cache: Cache, workload: str) -> float:
        return _figure(cache[workload]["loader"]["startup_s"])

    def track_import_torch(self, cache: Cache, workload: str) -> float:
        return _figure(cache[workload]["loader"]["import_torch_s"])


class ChildMemory:
    """USS and shared bytes of the loader's child processes, after the timed window."""

    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    unit = "bytes"

    def _children(self, cache: Cache, workload: str) -> list[dict[str, Any]]:
        children: list[dict[str, Any]] = cache[workload]["loader"]["children"]
        return children

    def track_total_uss(self, cache: Cache, workload: str) -> float:
        return float(sum(child["uss"] for child in self._children(cache, workload)))

    def track_max_uss(self, cache: Cache, workload: str) -> float:
        return float(max((child["uss"] for child in self._children(cache, workload)), default=NAN))

    def track_max_shared(self, cache: Cache, workload: str) -> float:
        return float(max((child["shared"] for child in self._children(cache, workload)), default=NAN))


class RedisCommands:
    params = (WORKLOAD_NAMES,)
    param_names = ("workload",)
    unit = "commands/batch"

    def track_commands_per_batch(self, cache: Cache, workload: str) -> float:
        return _figure(cache[workload]["loader"]["redis_cmds_per_batch"])


class ShuffleQuality:
    """Mean displacement over that of an ideal buffer of shuffle_size (1.0 = as mixed as ideal)."""

    params = (WORKLOAD_NAMES, ["loader", "dataloader"])
    param_names = ("workload", "impl")
    unit = "ratio"

    def track_displacement_ratio(self, cache: Cache, workload: str, impl: str) -> float:
        quality = cache[workload][impl].get("quality")
        return NAN if not quality else _figure(quality["displacement_ratio"])
