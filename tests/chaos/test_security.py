"""Security: tampered metadata in Redis, attach attempts from another uid, and an unsafe runtime directory.

* Tampering: once the buffer is published, the queue's meta hash field ``layout`` or ``first_row`` is
  overwritten. Processes already attached never read it again, but every newcomer must refuse it with
  ``TamperedMetadataError``: a child respawned after a SIGKILL (its traceback reaches the trainer in
  ``WorkerDied``), or a fresh loader of another local rank of the same queue asking for a dummy batch.
* Another uid: as root, a ``setpriv --reuid=nobody`` process tries ``gigashuffle.procs.attach.attach()`` on a live
  attach socket. With the runtime dir at 0700 it cannot even connect; with the dir opened to 0711 and the socket
  to 0666 it connects, but the server checks SO_PEERCRED and closes without sending a file descriptor (a raw
  client that skips attach()'s own uid check shows that no fd arrives). The server then still serves its own uid.
* The runtime directory: one with mode 0755, owned by another uid, or a symlink is refused.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from chaos_datasets import ChaosDataset

import gigashuffle
from gigashuffle import GigashuffleError, MultiprocessShuffledDataloader, TamperedMetadataError, WorkerDied
from gigashuffle.host.rundir import runtime_dir
from gigashuffle.procs.attach import attach

REFUSE_LIMIT_S = 30.0
IS_ROOT = os.geteuid() == 0
HAVE_SETPRIV = shutil.which("setpriv") is not None


def _tamper(url: str, meta_key: str, field: str) -> None:
    with redis.Redis.from_url(url) as client:
        value = client.hget(meta_key, field)
        assert value is not None, f"{meta_key} has no {field}"
        # layout: a plausible forgery (same fields, a narrower dtype); first_row: one flipped byte
        forged = value.replace(b'"int64"', b'"int32"', 1) if field == "layout" else bytes([value[0] ^ 0xFF]) + value[1:]
        assert forged != value
        client.hset(meta_key, field, forged)


# A dummy batch of another rank starts a second trainer (about 15 s here): one seed per field.
@pytest.mark.parametrize(
    ("field", "newcomer", "seed"),
    [
        *((field, "respawned child", seed) for field in ("layout", "first_row") for seed in range(2)),
        ("layout", "dummy batch of another rank", 0),
        ("first_row", "dummy batch of another rank", 1),
    ],
)
def test_tampered_metadata_is_refused(chaos: Any, redis_url: str, field: str, newcomer: str, seed: int) -> None:
    rng = chaos.begin("tampered meta", f"{field}, {newcomer}", seed, redis_url)
    ranks: dict[str, Any] = {}
    if newcomer.startswith("dummy"):  # the other rank comes after the tampering: no wait for its first-mix share
        ranks = {"local_world_size": 2, "global_world_size": 2, "first_mix_wait_s": 0.0}
    cfg = chaos.config(bs=4, max_restarts=3, num_readers=1, **ranks)
    loader = chaos.loader(ChaosDataset(rows=8), cfg)
    consumer = chaos.consumer(loader)
    consumer.take(rng.randint(1, 20))
    _proc, info = chaos.find_victim(loader, rng.choice(("writer", "reader")), rng)
    _tamper(loader.redis_url, chaos.keys(cfg).meta, field)
    tampered = time.monotonic()

    if newcomer == "respawned child":
        os.kill(int(info["pid"]), signal.SIGKILL)
        end = tampered + REFUSE_LIMIT_S
        with pytest.raises(WorkerDied) as excinfo:
            while time.monotonic() < end:
                consumer.next()
        err: BaseException = excinfo.value
        text = excinfo.value.traceback_text
        assert excinfo.value.role == info["role"] and excinfo.value.pid != int(info["pid"]), "not the respawned one"
    else:
        other = chaos.loader(ChaosDataset(rows=8), chaos.config(bs=4, num_readers=1, global_rank=1, local_rank=1,
                                                                  **ranks))  # fmt: skip
        with chaos.deadline(REFUSE_LIMIT_S, "get_dummy_batch"), pytest.raises(GigashuffleError) as excinfo2:
            other.get_dummy_batch()
        err = excinfo2.value
        text = f"{err}\n{getattr(err, 'traceback_text', '')}"
        assert isinstance(err, (TamperedMetadataError, WorkerDied)), f"{type(err).__name__}: {err}"
        consumer.take(rng.randint(5, 20))  # the first loader's attached processes read on
    detect_s = time.monotonic() - tampered
    assert "TamperedMetadataError" in text or isinstance(err, TamperedMetadataError), text
    assert "fails its HMAC check" in text, text
    consumer.assert_unique()
    chaos.finish(f"error: {type(err).__name__} (TamperedMetadataError)", detect_s=detect_s, victim=info["role"])


_NOBODY_CLIENT = r"""
import json, socket, sys, types
pkg = types.ModuleType("gigashuffle"); pkg.__path__ = [sys.argv[2]]; sys.modules["gigashuffle"] = pkg
from gigashuffle.procs.attach import attach  # the real client, without the package's torch/redis imports
out = {"module": sys.modules["gigashuffle.procs.attach"].__file__}
try:
    info, fds = attach(sys.argv[1], timeout_s=5.0)
    out["attach"] = {"fds": len(fds)}
except Exception as exc:
    out["attach"] = {"error": f"{type(exc).__name__}: {exc}"}
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a raw client: no uid check of its own
sock.settimeout(5.0)
try:
    sock.connect(sys.argv[1])
    data, anc, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
    out["raw"] = {"bytes": len(data), "fds": sum(len(d) // 4 for lvl, kind, d in anc if kind == socket.SCM_RIGHTS)}
except Exception as exc:
    out["raw"] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""


@pytest.fixture
def readable_package() -> Iterator[str]:
    """A copy of the package that ``nobody`` can read: the checkout may lie under a 0700 directory (``mktemp -d``,
    a 0750 home), where the other uid could not import it and the test would fail for a reason unrelated to what
    it checks. The client imports only the attach module and its few pure-Python imports from it."""
    base = tempfile.mkdtemp(prefix="gs-nobody-")
    try:
        target = Path(base) / "gigashuffle"
        shutil.copytree(Path(gigashuffle.__file__).parent, target, ignore=shutil.ignore_patterns("__pycache__"))
        for folder, _dirs, files in os.walk(base):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        yield str(target)
    finally:
        shutil.rmtree(base, ignore_errors=True)


_AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@functools.cache
def _python_for_nobody() -> str:
    """An interpreter (3.11 or newer) that ``nobody`` can run, in isolated mode: the client needs the standard library
    and the package copy only. The real one first, not a venv's link to it (a venv inside the checkout lies under the
    same 0700 directory); then the system's, for an interpreter whose shared library lies under a private home
    (pyenv's 3.12 links libpython from its own tree)."""
    tried = []
    for candidate in (sys.executable, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if candidate is None:
            continue
        python = os.path.realpath(candidate)
        done = subprocess.run(
            [*_AS_NOBODY, python, "-I", "-c", "import sys; sys.exit(sys.version_info < (3, 11))"],
            capture_output=True, text=True, timeout=60, cwd="/", check=False,
        )  # fmt: skip
        if done.returncode == 0:
            return python
        tried.append(f"{python}: exit {done.returncode} {done.stderr.strip()[-200:]}")
    pytest.skip(f"no Python 3.11+ that uid nobody can run here ({'; '.join(tried)})")


def _as_nobody(path: str, package: str) -> dict[str, Any]:
    done = subprocess.run(
        [*_AS_NOBODY, _python_for_nobody(), "-I", "-c", _NOBODY_CLIENT, path, package],
        capture_output=True, text=True, timeout=60, cwd="/", check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # The code under test, not another checkout's (a venv's editable install would have resolved the import).
    assert result["module"].startswith(package + os.sep), result
    return result


@pytest.mark.skipif(not (IS_ROOT and HAVE_SETPRIV), reason="needs root and setpriv to act as another uid")
@pytest.mark.parametrize("seed", range(2))
def test_other_uid_cannot_attach(chaos: Any, redis_url: str, readable_package: str, seed: int) -> None:
    rng = chaos.begin("attach from another uid", "nobody vs a live attach socket", seed, redis_url)
    loader = chaos.loader(ChaosDataset(rows=8), chaos.config(bs=4))
    consumer = chaos.consumer(loader)
    consumer.take(rng.randint(1, 20))
    _proc, info = chaos.find_victim(loader, rng.choice(("owner", "writer", "reader")), rng)
    path = Path(info["attach"])
    assert path.parent == chaos.runtime_dir
    started = time.monotonic()

    closed = _as_nobody(str(path), readable_package)  # the runtime dir is 0700: nobody cannot reach the socket at all
    assert "Permission denied" in closed["attach"].get("error", ""), closed
    assert "Permission denied" in closed["raw"].get("error", ""), closed

    dir_mode, sock_mode = os.stat(path.parent).st_mode & 0o777, os.stat(path).st_mode & 0o777
    try:
        os.chmod(path.parent, 0o711)
        os.chmod(path, 0o666)
        # Reachable now: the server's SO_PEERCRED check is all that is left.
        opened = _as_nobody(str(path), readable_package)
    finally:
        os.chmod(path, sock_mode)
        os.chmod(path.parent, dir_mode)
    assert "AttachError" in opened["attach"].get("error", ""), opened
    assert opened["raw"].get("fds", 0) == 0 and opened["raw"].get("bytes", 0) == 0, f"the server sent {opened}"
    refused_s = time.monotonic() - started

    _info, fds = attach(path)  # the same server still serves its own uid
    try:
        assert fds
    finally:
        for fd in fds:
            os.close(fd)
    consumer.take(rng.randint(5, 20))
    consumer.assert_unique()
    chaos.finish("refused (no fd sent)", detect_s=refused_s, closed_dir=closed, opened_dir=opened,
                 modes=[oct(dir_mode), oct(sock_mode)])  # fmt: skip


@pytest.mark.parametrize("case", ["mode 0755", "owned by another uid", "a symlink to a private dir"])
def test_runtime_dir_refuses_unsafe_directory(chaos: Any, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    chaos.begin("unsafe runtime dir", case, 0, None)
    base = Path(tempfile.mkdtemp(prefix="gs-unsafe-"))
    try:
        target = base / "rt"
        if case == "mode 0755":
            target.mkdir(mode=0o700)
            os.chmod(target, 0o755)
        elif case == "owned by another uid":
            if not IS_ROOT:
                pytest.skip("needs root to chown")
            target.mkdir(mode=0o700)
            os.chown(target, 65534, 65534)
        else:
            private = base / "private"
            private.mkdir(mode=0o700)
            target.symlink_to(private)
        monkeypatch.setenv("GIGASHUFFLE_RUNTIME_DIR", str(target))
        started = time.monotonic()
        with pytest.raises(GigashuffleError) as direct:
            runtime_dir()
        with pytest.raises(GigashuffleError) as excinfo:
            MultiprocessShuffledDataloader(ChaosDataset(), chaos.config(redis_url="redis://127.0.0.1:1/0"))
        took = time.monotonic() - started
        for err in (direct.value, excinfo.value):
            assert str(target) in str(err) and "0700" in str(err), str(err)
        if case == "mode 0755":
            assert "mode 755" in str(excinfo.value), str(excinfo.value)
        assert not list(target.glob("*")), "nothing may be created in a refused directory"
    finally:
        shutil.rmtree(base, ignore_errors=True)
    chaos.finish("error: GigashuffleError (refused)", detect_s=took, message=str(excinfo.value)[:300])
