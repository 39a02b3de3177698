"""NOTE [ Seeds ] in procs/seeds.py: where a job's base seed comes from, and each writer's seed on each start."""

from __future__ import annotations

from typing import Any

from gigashuffle import DataloaderConfig
from gigashuffle.procs.seeds import RESTART_COUNT_ENV, RUN_ID_ENV, base_seed, writer_seed


def config(**overrides: Any) -> DataloaderConfig:
    return DataloaderConfig(**{"bs": 2, "shuffle_size": 16, "queue_name": "seeds", **overrides})


def test_an_explicit_seed_wins_over_everything() -> None:
    assert base_seed(config(seed=42), "gen", {RUN_ID_ENV: "job-1"}) == (42, "DataloaderConfig.seed")


def test_torchrun_run_id_makes_every_rank_and_node_agree() -> None:
    env = {RUN_ID_ENV: "4f0c-job", RESTART_COUNT_ENV: "0"}
    seeds = {
        base_seed(config(global_rank=r, global_world_size=4, local_rank=r % 2, local_world_size=2), f"gen{r}", env)[0]
        for r in range(4)
    }
    assert len(seeds) == 1, "ranks on different nodes (different session generations) must agree"
    seed = seeds.pop()
    assert 0 <= seed < 2**63
    assert base_seed(config(), "gen", {**env, RESTART_COUNT_ENV: "1"})[0] != seed, "an elastic restart replays"
    assert base_seed(config(), "gen", {**env, RUN_ID_ENV: "other-job"})[0] != seed
    assert base_seed(config(queue_name="eval"), "gen", env)[0] != seed, "two loaders of a job share streams"


def test_without_a_run_id_the_node_session_decides() -> None:
    for env in ({}, {RUN_ID_ENV: "none"}):  # "none": torchrun's static rendezvous default, the same for every job
        seed, origin = base_seed(config(), "generation-a", env)
        assert seed == base_seed(config(global_rank=1, local_rank=1, local_world_size=2, global_world_size=2),
                                 "generation-a", env)[0]  # fmt: skip
        assert seed != base_seed(config(), "generation-b", env)[0]
        assert "session of node 'n0'" in origin


def test_writer_seeds_are_torchs_on_the_first_start_and_never_collide() -> None:
    num_workers = 6
    assert [writer_seed(1000, w, num_workers, 0) for w in range(num_workers)] == list(range(1000, 1006))
    seen = {writer_seed(1000, w, num_workers, start) for w in range(num_workers) for start in range(5)}
    assert len(seen) == num_workers * 5, "a respawned writer must not reuse any writer's stream"
    assert writer_seed(2**63 - 1, 1, num_workers, 0) == 0  # wraps into [0, 2**63)
