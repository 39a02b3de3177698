"""Multi-rank proof: real torchrun jobs (gloo, CPU) sharing one shuffle buffer per node.

Each test launches ``torchrun_job.py`` with ``python -m torch.distributed.run`` in its own session and kills
that session's processes in a ``finally``; the job's rank 0 checks the invariants (no row read twice across all
ranks, no torn row, ``num_workers == WORLD_SIZE * num_writers``, rows stay on their node, the ranks of a node
share its buffer) and writes a JSON result that the test asserts and reports (``-s`` shows it; it is also
appended to ``/tmp/gigashuffle-torchrun-report.txt``).

Two "nodes" on one machine are two torchrun agents with ``--nnodes=2 --node-rank=0/1`` and a static
rendezvous on 127.0.0.1: gigashuffle tells them apart by ``node = global_rank // local_world_size``.

Jobs are tiny (bs 8, shuffle_size 256, 1 writer + 1 reader per rank, 100 batches per rank); every wait has a
deadline and nothing asserts on timing beyond "the job ended before its deadline".
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis
from leaks import assert_no_leaks, snapshot
from redis_servers import LOOPBACK, free_port, wait_until
from timing import startup_deadline

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(420)]

JOB = Path(__file__).with_name("torchrun_job.py")
REPORT = Path("/tmp/gigashuffle-torchrun-report.txt")
BATCHES = 100
# Start-up is most of a job: 2 agents, 4 ranks and 4 zygotes import torch on 2 cores.
JOB_DEADLINE_S = startup_deadline(240.0, startups=120)
JOB_ARGS = ["--bs", "8", "--shuffle-size", "256", "--num-writers", "1", "--num-readers", "1"]


# -- launching and killing ---------------------------------------------------------------------------------------
@dataclass
class Agent:
    """One torchrun agent (a simulated node) running in its own session."""

    node_rank: int
    proc: subprocess.Popen[bytes]
    log: Path
    rank_log_dir: Path

    def tail(self, lines: int = 40) -> str:
        """The agent's own last lines, then each rank's last lines of stderr and stdout (its traceback)."""
        parts = [
            f"--- torchrun agent of node {self.node_rank} (exit {self.proc.poll()}): {self.log}",
            _tail(self.log, lines),
        ]
        # torchrun --log-dir D --tee 3 writes D/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log
        for stream in sorted(self.rank_log_dir.glob("*/attempt_*/*/std*.log")):
            local_rank = stream.parent.name
            parts.append(f"--- node {self.node_rank} local rank {local_rank} {stream.name}: {stream}")
            parts.append(_tail(stream, lines))
        return "\n".join(parts)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _logs(agents: list[Agent]) -> str:
    return "\n".join(a.tail() for a in agents)


@contextlib.contextmanager
def _logs_on_timeout(agents: list[Agent]) -> Iterator[None]:
    """A missed deadline shows what every rank printed so far."""
    try:
        yield
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\n{_logs(agents)}") from exc


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GIGASHUFFLE_REDIS_URL", None)  # the tests choose embedded vs external explicitly
    env.pop("GIGASHUFFLE_TEST_REDIS_URL", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _launch(
    tmp: Path,
    job_args: list[str],
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    nproc: int = 2,
    master_port: int | None = None,
) -> Agent:
    rank_log_dir = tmp / f"ranks-node{node_rank}"
    if nnodes == 1:
        rdzv = ["--standalone"]
    else:
        assert master_port is not None
        rdzv = [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--rdzv-backend=static",
            f"--master-addr={LOOPBACK}",
            f"--master-port={master_port}",
        ]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rdzv,
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.2",
        # Each rank's own stdout and stderr in a file (and on the agent's console): a failure shows the rank's
        # traceback, not only the agent's "exitcode 1" summary.
        f"--log-dir={rank_log_dir}",
        "--tee=3",
        str(JOB),
        *job_args,
    ]
    log = tmp / f"agent-{node_rank}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env(), start_new_session=True
        )
    return Agent(node_rank, proc, log, rank_log_dir)


def _kill_tree(agent: Agent) -> None:
    """SIGKILL the agent's session and every descendant (embedded servers run in sessions of their own)."""
    try:
        descendants = psutil.Process(agent.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(agent.proc.pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        agent.proc.wait(timeout=10)


@contextlib.contextmanager
def _agents() -> Iterator[list[Agent]]:
    started: list[Agent] = []
    try:
        yield started
    finally:
        for agent in started:
            _kill_tree(agent)


def _wait_all(agents: list[Agent], deadline: float) -> list[int]:
    while any(a.proc.poll() is None for a in agents):
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchrun job did not end before its deadline\n{_logs(agents)}")
        time.sleep(0.1)
    return [a.proc.returncode for a in agents]


def _loader_processes(queue: str) -> list[str]:
    """Every process on the machine titled as a gigashuffle loader process of ``queue``."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if cmdline.startswith("gigashuffle ") and f" {queue} " in f"{cmdline} ":
                found.append(f"{proc.info['pid']}: {cmdline}")
    return found


def _sockets(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_socket())


def _queue_name(label: str) -> str:
    return f"tr-{label}-{uuid.uuid4().hex[:8]}"


# -- results ---------------------------------------------------------------------------------------------------
def _report(title: str, wall_s: float, result: dict | None, extra: str = "") -> None:
    lines = [f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {title}: test wall {wall_s:.1f}s"]
    if result is not None:
        lines[0] += (
            f", rank0 wall {result['rank0_wall_s']:.1f}s, {result['total_rows']} rows, {result['unique_ids']} unique"
        )
        for r in result["ranks"]:
            lines.append(
                f"    rank {r['rank']} (node {r['node']}): {r['batches']} batches, {r['rows']} rows "
                f"({r['rows_from_other_ranks_of_node']} written by another rank of the node), "
                f"construct {r['construct_s']:.2f}s, read {r['read_s']:.2f}s, {r['redis_url']}"
            )
    if extra:
        lines.append(f"    {extra}")
    text = "\n".join(lines)
    print("\n" + text)
    with open(REPORT, "a") as f:
        f.write(text + "\n")


def _assert_result(path: Path, agents: list[Agent], queue: str, world: int, local_world: int) -> dict:
    assert path.exists(), "rank 0 wrote no result:\n" + _logs(agents)
    result = json.loads(path.read_text())
    assert result["ok"], f"{result['errors']}\n{_logs(agents)}"
    assert result["world_size"] == world
    assert result["local_world_size"] == local_world
    assert [r["rank"] for r in result["ranks"]] == list(range(world))
    # A rank reads at least BATCHES, and on until it has seen rows of every writer of its node (torchrun_job.py).
    assert all(r["batches"] >= BATCHES for r in result["ranks"])
    assert all(r["num_workers"] == [world * result["num_writers"]] for r in result["ranks"])
    assert result["unique_ids"] == result["total_rows"] == sum(r["batches"] for r in result["ranks"]) * 8
    for r in result["ranks"]:
        assert r["node"] == f"n{r['rank'] // local_world}"
        assert r["key_tag"] == f"gigashuffle:{{{queue}@{r['node']}}}"
    return result


def _wait_ready(hold: Path, world: int, agents: list[Agent], deadline: float) -> list[dict]:
    def ready() -> bool:
        if any(a.proc.poll() is not None for a in agents):
            raise AssertionError(f"a torchrun agent ended before every rank was ready:\n{_logs(agents)}")
        return all((hold / f"ready-{r}").exists() for r in range(world))

    with _logs_on_timeout(agents):
        wait_until(
            ready,
            timeout_s=max(1.0, deadline - time.monotonic()),
            what="every rank to read its batches",
            interval_s=0.1,
        )
    return [json.loads((hold / f"ready-{r}").read_text()) for r in range(world)]


# -- the tests -------------------------------------------------------------------------------------------------
def test_one_node_two_ranks_embedded(tmp_path: Path, runtime_dir: Path) -> None:
    """1 node x 2 ranks on the embedded default: both ranks use one private server and one buffer."""
    queue = _queue_name("1x2")
    out, hold = tmp_path / "result.json", tmp_path / "hold"
    hold.mkdir()
    before = snapshot(runtime_dir=runtime_dir, shm_pattern=f"*{queue}*")
    t0 = time.monotonic()
    with _agents() as agents:
        agents.append(
            _launch(
                tmp_path,
                ["--queue", queue, "--out", str(out), "--batches", str(BATCHES), "--hold-dir", str(hold), *JOB_ARGS],
            )
        )
        ready = _wait_ready(hold, 2, agents, t0 + JOB_DEADLINE_S)
        sockets_while_open = _sockets(runtime_dir)
        (hold / "release").touch()
        codes = _wait_all(agents, t0 + JOB_DEADLINE_S)
    wall = time.monotonic() - t0
    assert codes == [0], agents[0].tail()
    result = _assert_result(out, agents, queue, world=2, local_world=2)
    server = runtime_dir / "redis-n0.sock"
    assert {r["redis_url"] for r in result["ranks"]} == {f"unix://{server}"}
    assert "redis-n0.sock" in sockets_while_open
    assert {r["meta_owner"] for r in ready} and len({r["meta_owner"] for r in ready}) == 1  # one buffer
    assert {k.split("}")[0] for r in ready for k in r["keys"] if "{" in k} == {f"gigashuffle:{{{queue}@n0"}
    assert sum(r["rows_from_other_ranks_of_node"] for r in result["ranks"]) > 0
    assert_no_leaks(before, deadline_s=15.0, runtime_dir=runtime_dir, shm_pattern=f"*{queue}*")
    assert _loader_processes(queue) == []
    _report("1 node x 2 ranks, embedded Redis", wall, result, f"sockets while open: {sockets_while_open}")


def test_two_nodes_one_external_redis(tmp_path: Path, runtime_dir: Path, redis_url: str) -> None:
    """2 nodes x 2 ranks on one Redis: each node has its own keys (@n0, @n1) and its own buffer."""
    queue = _queue_name("2x2ext")
    out, hold = tmp_path / "result.json", tmp_path / "hold"
    hold.mkdir()
    port = free_port()
    args = [
        "--queue",
        queue,
        "--out",
        str(out),
        "--batches",
        str(BATCHES),
        "--redis-url",
        redis_url,
        "--hold-dir",
        str(hold),
        *JOB_ARGS,
    ]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    before = snapshot(client, f"gigashuffle:{{{queue}@*", runtime_dir, shm_pattern=f"*{queue}*")
    t0 = time.monotonic()
    try:
        with _agents() as agents:
            for node_rank in (0, 1):
                agents.append(_launch(tmp_path, args, nnodes=2, node_rank=node_rank, master_port=port))
            ready = _wait_ready(hold, 4, agents, t0 + JOB_DEADLINE_S)
            # Inspect Redis while every loader is open: the keys of the two nodes carry @n0 and @n1.
            keys = sorted(client.scan_iter(match=f"gigashuffle:{{{queue}@*"))
            tags = {k.split("}")[0] + "}" for k in keys}
            owners = {node: client.hget(f"gigashuffle:{{{queue}@{node}}}:meta", "owner") for node in ("n0", "n1")}
            procs = {node: client.hgetall(f"gigashuffle:{{{queue}@{node}}}:procs") for node in ("n0", "n1")}
            (hold / "release").touch()
            codes = _wait_all(agents, t0 + JOB_DEADLINE_S)
        wall = time.monotonic() - t0
        assert codes == [0, 0], _logs(agents)
        result = _assert_result(out, agents, queue, world=4, local_world=2)
        assert tags == {f"gigashuffle:{{{queue}@n0}}", f"gigashuffle:{{{queue}@n1}}"}, keys
        for node, ranks in (("n0", {0, 1}), ("n1", {2, 3})):
            # Each node's buffer was created by a writer of that node, and only that node's processes joined it.
            assert int(owners[node].split(".")[0]) in ranks, owners  # proc ids are "<rank>.<role><i>.<pid>"
            assert {json.loads(v)["rank"] for v in procs[node].values()} == ranks, procs[node]
            assert {r["meta_owner"] for r in ready if r["node"] == node} == {owners[node]}
            assert {k.split("}")[0] for r in ready if r["node"] == node for k in r["keys"]} >= {
                f"gigashuffle:{{{queue}@{node}"
            }
        assert owners["n0"] != owners["n1"]
        assert {r["redis_url"] for r in result["ranks"]} == {redis_url}
        # The last trainer of each node deletes its node's keys; nothing of the queue is left in Redis.
        assert_no_leaks(
            before,
            deadline_s=15.0,
            redis_client=client,
            key_pattern=f"gigashuffle:{{{queue}@*",
            runtime_dir=runtime_dir,
            shm_pattern=f"*{queue}*",
        )
        assert _loader_processes(queue) == []
        _report(
            "2 nodes x 2 ranks, one external Redis", wall, result, f"{len(keys)} keys while open, tags {sorted(tags)}"
        )
    finally:
        client.close()


def test_two_nodes_embedded_one_server_per_node(tmp_path: Path, runtime_dir: Path) -> None:
    """2 nodes x 2 ranks on the embedded default: one private server per node (redis-n0.sock, redis-n1.sock)."""
    queue = _queue_name("2x2emb")
    out, hold = tmp_path / "result.json", tmp_path / "hold"
    hold.mkdir()
    port = free_port()
    args = ["--queue", queue, "--out", str(out), "--batches", str(BATCHES), "--hold-dir", str(hold), *JOB_ARGS]
    before = snapshot(runtime_dir=runtime_dir, shm_pattern=f"*{queue}*")
    t0 = time.monotonic()
    with _agents() as agents:
        for node_rank in (0, 1):
            agents.append(_launch(tmp_path, args, nnodes=2, node_rank=node_rank, master_port=port))
        ready = _wait_ready(hold, 4, agents, t0 + JOB_DEADLINE_S)
        sockets_while_open = _sockets(runtime_dir)
        servers_answer = {}
        for node in ("n0", "n1"):
            with redis.Redis(unix_socket_path=str(runtime_dir / f"redis-{node}.sock"), socket_timeout=5) as c:
                servers_answer[node] = sorted(k.decode() for k in c.scan_iter(match="gigashuffle:{*"))
        (hold / "release").touch()
        codes = _wait_all(agents, t0 + JOB_DEADLINE_S)
    wall = time.monotonic() - t0
    assert codes == [0, 0], _logs(agents)
    result = _assert_result(out, agents, queue, world=4, local_world=2)
    assert {"redis-n0.sock", "redis-n1.sock"} <= set(sockets_while_open)
    for r in result["ranks"]:
        assert r["redis_url"] == f"unix://{runtime_dir}/redis-{r['node']}.sock"
    # Each node's server holds only its own node's keys.
    for node, keys in servers_answer.items():
        assert keys and {k.split("}")[0] for k in keys} == {f"gigashuffle:{{{queue}@{node}"}, keys
    assert len({r["meta_owner"] for r in ready}) == 2
    assert_no_leaks(before, deadline_s=15.0, runtime_dir=runtime_dir, shm_pattern=f"*{queue}*")
    assert _sockets(runtime_dir) == []
    assert _loader_processes(queue) == []
    _report("2 nodes x 2 ranks, embedded Redis per node", wall, result, f"sockets while open: {sockets_while_open}")


@pytest.mark.parametrize(
    "victim",
    [
        "other_rank",
        "server_starter",
    ],
)
def test_killed_rank_ends_job_and_leaves_nothing(tmp_path: Path, runtime_dir: Path, victim: str) -> None:
    """SIGKILL one rank mid-run: the job fails within a bound and no process, socket or shm entry remains."""
    queue = _queue_name(f"kill-{victim.replace('_', '')}")
    out, pids = tmp_path / "result.json", tmp_path / "pids"
    pids.mkdir()
    args = [
        "--queue",
        queue,
        "--out",
        str(out),
        "--batches",
        "0",
        "--pid-dir",
        str(pids),
        "--max-seconds",
        str(JOB_DEADLINE_S),
        *JOB_ARGS,
    ]
    before = snapshot(runtime_dir=runtime_dir, shm_pattern=f"*{queue}*")
    shm_before = set(os.listdir("/dev/shm"))
    t0 = time.monotonic()
    with _agents() as agents:
        agents.append(_launch(tmp_path, args))

        def both_iterate() -> bool:
            if agents[0].proc.poll() is not None:
                raise AssertionError(f"the job ended before both ranks iterated:\n{_logs(agents)}")
            return all((pids / f"rank-{r}.json").exists() for r in (0, 1))

        with _logs_on_timeout(agents):
            wait_until(both_iterate, timeout_s=JOB_DEADLINE_S, what="both ranks to iterate", interval_s=0.1)
        infos = [json.loads((pids / f"rank-{r}.json").read_text()) for r in (0, 1)]
        starters = [i for i in infos if i["started_embedded_server"]]
        assert len(starters) == 1, infos
        chosen = starters[0] if victim == "server_starter" else next(i for i in infos if i not in starters)
        loaders_running = _loader_processes(queue)
        sockets_running = _sockets(runtime_dir)
        t_kill = time.monotonic()
        os.kill(chosen["pid"], signal.SIGKILL)
        # torchrun's own grace for the surviving ranks is 30 s (SIGTERM, then SIGKILL).
        codes = _wait_all(agents, t_kill + 90.0)
        t_end = time.monotonic()
        log = agents[0].tail(60)
    wall = t_end - t0
    assert codes[0] != 0, log
    assert not out.exists()
    assert len(loaders_running) == 6, loaders_running  # a zygote, a writer and a reader per rank
    # Nothing of the job is left: no loader process, no socket in the runtime dir, no /dev/shm entry.
    leftovers_deadline = time.monotonic() + 15.0
    while (_loader_processes(queue) or _sockets(runtime_dir)) and time.monotonic() < leftovers_deadline:
        time.sleep(0.1)
    left_procs, left_sockets = _loader_processes(queue), _sockets(runtime_dir)
    left_shm = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if "gigashuffle" in n or queue in n)
    _report(
        f"killed rank {chosen['rank']} ({victim}) of 1 node x 2 ranks, embedded Redis",
        wall,
        None,
        f"job exit {codes[0]} {t_end - t_kill:.1f}s after the kill; sockets while running {sockets_running}; "
        f"left: processes {left_procs}, sockets {left_sockets}, shm {left_shm}",
    )
    assert left_procs == []
    assert left_sockets == [], left_sockets
    assert left_shm == []
    assert_no_leaks(before, deadline_s=5.0, runtime_dir=runtime_dir, shm_pattern=f"*{queue}*")


def test_example_training_script_runs_and_resumes(tmp_path: Path, runtime_dir: Path) -> None:
    """The README's torchrun example, as users run it: trains, checkpoints, and resumes from the checkpoint."""
    example = Path(__file__).parents[2] / "examples" / "train_torchrun.py"
    common = ["--queue", _queue_name("example"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--shuffle-size", "512"]
    t0 = time.monotonic()
    for run, extra in (("train", ["--steps", "20"]), ("resume", ["--steps", "30", "--resume"])):
        out = tmp_path / run
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
               f"--log-dir={out / 'ranks'}", "--tee=3", str(example), *common, *extra]  # fmt: skip
        with open(out / "agent.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env(),
                                    start_new_session=True, cwd=tmp_path)  # fmt: skip
        agent = Agent(0, proc, out / "agent.log", out / "ranks")
        with _agents() as agents:
            agents.append(agent)
            codes = _wait_all(agents, time.monotonic() + JOB_DEADLINE_S)
        text = (out / "agent.log").read_text(errors="replace")
        assert codes == [0], agent.tail()
        assert "held-out after" in text, agent.tail()
        if run == "resume":
            assert "resumed at step 20" in text, agent.tail()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]
    _report("examples/train_torchrun.py, 1 node x 2 ranks, train then resume", time.monotonic() - t0, None)
