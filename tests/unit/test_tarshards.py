"""``sources.TarReader``: webdataset tar shards grouped and decoded as webdataset does (NOTE [ Tar shards ]), a
damaged shard refused with its file named, and ``Sharded`` over tar shards resuming exactly from any state."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset as wds

from gigashuffle import CheckpointError
from gigashuffle.sources import Chunked, Sharded, TarReader, missing_state_methods
from gigashuffle.sources.tarshards import index


def _npy(value: Any) -> bytes:
    out = io.BytesIO()
    np.save(out, np.asarray(value))
    return out.getvalue()


def _tar(path: Path, members: list[tuple[str, bytes | None]]) -> Path:
    """A tar of ``(name, data)`` members in this order; ``data=None`` makes a directory."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _ids_shard(path: Path, ids: range) -> Path:
    with wds.TarWriter(str(path)) as sink:
        for i in ids:
            sink.write({"__key__": f"{i:08d}", "id.cls": i, "x.npy": np.array([i, -i], dtype=np.float32)})
    return path


def _samples(path: Path) -> list[dict[str, Any]]:
    """Every sample of a shard as the transform sees it."""
    got: list[dict[str, Any]] = []
    n, read = TarReader(transform=lambda s: got.append(dict(s)) or {"n": 0})(str(path))
    read(0, n)
    return got


def test_members_group_into_samples_by_key_and_decode_by_extension(tmp_path: Path) -> None:
    path = _tar(tmp_path / "s.tar", [
        ("a.id.cls", b"7"), ("a.x.npy", _npy([1.5, 2.5])), ("a.meta.json", json.dumps({"k": [1]}).encode()),
        ("d", None), ("README", b"no extension: skipped"),
        ("d/b.ID.CLS", b" 8\n"), ("d/b.seg.x.npy", _npy([3])), ("d/b.txt", "héllo".encode()), ("d/b.bin", b"\x00\x01"),
        ("a.id.cls", b"9"),  # the key again, not next to its first members: a new sample, as webdataset does
    ])  # fmt: skip
    got = _samples(path)
    assert [s["__key__"] for s in got] == ["a", "d/b", "a"]
    assert all(s["__url__"] == str(path) for s in got)
    assert got[0]["id.cls"] == 7 and got[0]["meta.json"] == {"k": [1]}
    assert got[0]["x.npy"].tolist() == [1.5, 2.5] and isinstance(got[0]["x.npy"], np.ndarray)
    assert got[1]["id.cls"] == 8, "extensions are lower-cased"
    assert got[1]["seg.x.npy"].tolist() == [3] and got[1]["txt"] == "héllo" and got[1]["bin"] == b"\x00\x01"
    assert set(got[2]) == {"__key__", "__url__", "id.cls"}


def test_samples_and_values_are_webdatasets_own(tmp_path: Path) -> None:
    """A shard webdataset wrote reads back as webdataset's own ``.decode()`` reads it, in the same order."""
    path = tmp_path / "w.tar"
    with wds.TarWriter(str(path)) as sink:
        for i in range(6):
            sink.write({"__key__": f"k{i:03d}", "id.cls": i, "x.npy": np.arange(i, i + 3), "name.txt": f"n{i}"})
    theirs = list(wds.WebDataset(str(path), shardshuffle=False, empty_check=False).decode())
    mine = _samples(path)
    assert [s["__key__"] for s in mine] == [s["__key__"] for s in theirs]
    for m, t in zip(mine, theirs, strict=True):
        assert (m["id.cls"], m["name.txt"]) == (t["id.cls"], t["name.txt"])
        assert np.array_equal(m["x.npy"], t["x.npy"])


def test_rows_are_stacked_samples_with_the_transform_applied(tmp_path: Path) -> None:
    path = _ids_shard(tmp_path / "s.tar", range(10, 17))
    n, read = TarReader(transform=lambda s: {"id": s["id.cls"], "x": s["x.npy"]})(str(path))
    assert n == 7
    chunk = read(2, 5)
    assert chunk[0]["id"].tolist() == [12, 13, 14] and chunk[0]["x"].shape == (3, 2)
    assert chunk[0]["x"].dtype == torch.float32
    with pytest.raises(TypeError, match=r"'name.txt' is a str.*shard .*s2.tar"):
        _tar(tmp_path / "s2.tar", [("a.name.txt", b"x")])
        TarReader()(str(tmp_path / "s2.tar"))[1](0, 1)


@pytest.mark.parametrize("damage", ["cut_in_member", "cut_at_header", "bad_header", "gzip"])
def test_a_damaged_shard_is_refused_with_its_file_named(tmp_path: Path, damage: str) -> None:
    path = _ids_shard(tmp_path / "s.tar", range(40))
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    if damage == "cut_in_member":
        path.write_bytes(data[: members[30].offset_data + 3])
    elif damage == "cut_at_header":  # ends cleanly after a member: tarfile alone would list 20 members, no error
        path.write_bytes(data[: members[20].offset])
    elif damage == "bad_header":  # tarfile alone would stop listing there and drop every sample after it
        path.write_bytes(data[: members[20].offset + 100] + b"\xff" * 8 + data[members[20].offset + 108 :])
    else:
        import gzip

        path.write_bytes(gzip.compress(data))
    with pytest.raises(ValueError, match=rf"TarReader: shard {path}"):
        TarReader()(str(path))


def test_an_undecodable_member_names_the_member_and_the_shard(tmp_path: Path) -> None:
    path = _tar(tmp_path / "s.tar", [("a.x.npy", _npy([1])), ("b.x.npy", b"not numpy"), ("c.id.cls", b"seven")])
    _, read = TarReader()(str(path))
    read(0, 1)
    with pytest.raises(ValueError, match=rf"member 'b.x.npy' of shard {path} cannot be decoded as .npy"):
        read(1, 2)
    with pytest.raises(ValueError, match=r"member 'c.id.cls' .* as .cls"):
        read(2, 3)
    _tar(tmp_path / "dup.tar", [("a.x.npy", _npy([1])), ("a.x.npy", _npy([2]))])
    with pytest.raises(ValueError, match=r"dup.tar has two members a.x.npy in one sample"):
        index(str(tmp_path / "dup.tar"))


def test_sharded_tar_shards_resume_exactly_from_any_state(tmp_path: Path) -> None:
    """Every state a writer reports between chunks resumes to exactly the rows after it, pass after pass."""
    shards = [str(_ids_shard(tmp_path / f"s{k}.tar", range(100 * k, 100 * k + n))) for k, n in enumerate([5, 0, 9])]
    reader = TarReader(transform=lambda s: {"id": s["id.cls"]})

    def source() -> Sharded:
        return Sharded(shards, reader, rows=2, pass_field="pass")

    def rows(s: Sharded, passes: int) -> list[tuple[int, int]]:
        out = []
        for _ in range(passes):
            out += [(i, p) for c in s for i, p in zip(c[0]["id"].tolist(), c[0]["pass"].tolist(), strict=True)]
        return out

    whole = rows(source(), 2)
    assert sorted(i for i, p in whole if p == 0) == [*range(5), *range(200, 209)]
    first = source()
    states, seen = [(0, first.state_dict())], 0
    for chunk in first:  # the state between chunks, as a writer takes it
        seen += len(chunk[0]["id"])
        states.append((seen, first.state_dict()))
    for at, state in states:
        again = source()
        again.load_state_dict(state)
        assert rows(again, 2)[: len(whole) - at] == whole[at:], f"resumed after {at} rows"


def test_a_webdataset_pipeline_in_chunked_cannot_checkpoint_and_the_error_names_the_tar_reader(
    tmp_path: Path,
) -> None:
    pipeline = wds.WebDataset(str(tmp_path / "s-{0..1}.tar"), nodesplitter=None, shardshuffle=False).decode()
    why = missing_state_methods(Chunked(pipeline, rows=4))
    assert why is not None and "webdataset pipeline" in why and "Sharded(shards, TarReader(" in why
    with pytest.raises(CheckpointError, match=r"webdataset pipeline .*TarReader"):
        Chunked(pipeline, rows=4).state_dict()
