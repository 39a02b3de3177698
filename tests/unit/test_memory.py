"""``host.memory.available()`` reads the host's ``MemAvailable`` and every memory cgroup of the process up to its
mount's root, v1 and v2, from a directory laid out as / is (NOTE [ A buffer the node cannot hold ])."""

from __future__ import annotations

from pathlib import Path

from gigashuffle.host.memory import available

GIB = 1 << 30


def _host(root: Path, available_kib: int, cgroup: str) -> None:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(f"MemTotal: {4 * available_kib} kB\nMemAvailable: {available_kib} kB\n")
    (root / "proc/self/cgroup").write_text(cgroup)


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_without_a_cgroup_limit_the_host_figure_bounds(tmp_path: Path) -> None:
    _host(tmp_path, 8 * GIB // 1024, "0::/job\n")
    _write(tmp_path / "sys/fs/cgroup/job", memory_max="max\n", memory_current=f"{GIB}\n", memory_stat="")
    assert available(tmp_path) == (8 * GIB, "the host's MemAvailable")


def test_a_v2_limit_less_its_unreclaimable_usage_bounds_and_an_ancestor_counts(tmp_path: Path) -> None:
    _host(tmp_path, 64 * GIB // 1024, "0::/pod/job\n")
    cgroups = tmp_path / "sys/fs/cgroup"
    # The job's own limit leaves 10 - (5 - 2) = 7 GiB (2 GiB of its usage is page cache, active or not; shared
    # memory counts as anon) ...
    _write(cgroups / "pod/job", memory_max=f"{10 * GIB}\n", memory_current=f"{5 * GIB}\n",
           memory_stat=f"anon {3 * GIB}\nactive_file {GIB}\ninactive_file {GIB}\nshmem {GIB}\n")  # fmt: skip
    room, bound = available(tmp_path) or (0, "")
    assert room == 7 * GIB and bound.endswith("pod/job less its usage"), (room, bound)
    # ... and a pod limit above it that leaves less wins.
    _write(cgroups / "pod", memory_max=f"{6 * GIB}\n", memory_current=f"{2 * GIB}\n", memory_stat="")
    room, bound = available(tmp_path) or (0, "")
    assert room == 4 * GIB and bound.endswith("/pod less its usage"), (room, bound)


def test_a_v1_limit_counts_and_a_path_outside_the_namespace_falls_back_to_the_mount(tmp_path: Path) -> None:
    # A container sees its own cgroup at the mount's root: /proc/self/cgroup names the host's path.
    _host(tmp_path, 64 * GIB // 1024, "4:memory:/host/path/of/the/container\n1:cpu:/\n")
    _write(tmp_path / "sys/fs/cgroup/memory", memory_limit_in_bytes=f"{3 * GIB}\n",
           memory_usage_in_bytes=f"{2 * GIB}\n", memory_stat=f"total_inactive_file {GIB}\n")  # fmt: skip
    mount = tmp_path / "sys/fs/cgroup/memory"
    assert available(tmp_path) == (2 * GIB, f"the limit of memory cgroup {mount} less its usage")
    # The longest tail of the path found under the mount is the process's cgroup (a cgroup made inside the container).
    _write(mount / "the/container", memory_limit_in_bytes=f"{GIB}\n", memory_usage_in_bytes="0\n", memory_stat="")
    assert available(tmp_path) == (GIB, f"the limit of memory cgroup {mount}/the/container less its usage")
    (mount / "the/container/memory.limit_in_bytes").write_text("9223372036854771712\n")
    # v1's "no limit" is a page-rounded 2**63 - 1.
    (tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert available(tmp_path) == (64 * GIB, "the host's MemAvailable")


def test_this_host_has_a_figure_no_larger_than_its_memory() -> None:
    found = available()
    assert found is not None
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    assert 0 < found[0] <= total_kib * 1024
