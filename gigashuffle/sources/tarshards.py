"""Webdataset tar shards for ``Sharded``, read with the standard library's ``tarfile`` only.

NOTE [ Tar shards ]
A webdataset shard is an uncompressed tar file whose members group into samples by key, as webdataset groups them:
a member's key is its name up to the first dot of its base name and its extension the rest (``d/0007.x.npy``: key
``d/0007``, extension ``x.npy``, lower-cased); consecutive members with one key are one sample; a member without
an extension, and anything that is not a regular file, is skipped. A sample is ``{"__key__": key, "__url__": path,
extension: value, ...}`` with values decoded by the extension's last part as webdataset's default decoders do for
these: ``npy`` -> numpy array, ``cls``/``cls2``/``class``/``count``/``index``/``inx``/``id`` -> int,
``txt``/``text``/``transcript`` -> str, ``json``/``jsn`` -> parsed JSON; any other extension stays ``bytes``
(nothing is unpickled). ``TarReader(transform=...)`` maps each sample to the fields of a row, which are stacked as
:class:`gigashuffle.sources.Chunked` stacks samples (default: every field not starting with ``__``).

Opening a shard lists its members once (headers only) and keeps each sample's member offsets, so ``read(start,
stop)`` seeks straight to samples ``[start, stop)``: a resumed cursor (NOTE [ Shard cursor ]) costs no re-read of
the samples before it, and the row count of a shard is its number of samples, the same on every read, which is
what makes a checkpoint of a ``Sharded`` over tar shards exact. A shard that does not list cleanly to its
end-of-archive block (truncated, a damaged header, compressed) raises ``ValueError`` naming the file: tarfile alone
would take a damaged header for the end of the archive and silently drop the samples after it.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from gigashuffle.sources.stacking import Chunk, default_fields, stack

Member = tuple[str, str, int, int]  # (member name, extension, offset of its data, size)
Sample = tuple[str, list[Member]]  # (key, its members)
ReadRows = Callable[[int, int], Chunk]

_INTS = frozenset({"cls", "cls2", "class", "count", "index", "inx", "id"})
_TEXTS = frozenset({"txt", "text", "transcript"})
_JSONS = frozenset({"json", "jsn"})


class TarReader:
    """Reads webdataset tar shards for :class:`~gigashuffle.sources.shards.Sharded`: one row per sample (NOTE [ Tar
    shards ]). ``transform`` maps a sample dict to the row's fields; ``fields`` picks which fields to stack."""

    def __init__(
        self,
        transform: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
        fields: Sequence[str] | None = None,
    ) -> None:
        if transform is not None and not callable(transform):
            raise TypeError(f"TarReader: transform={transform!r} must be callable: sample dict -> dict of fields")
        self.transform = transform
        self.fields = tuple(fields) if fields is not None else None

    def __call__(self, path: str) -> tuple[int, ReadRows]:
        samples = index(path)

        def read(start: int, stop: int) -> Chunk:
            with open(path, "rb") as file:
                rows = [self._row(path, file, samples[i]) for i in range(start, stop)]
            keys = self.fields if self.fields is not None else default_fields(rows[0])
            try:
                return stack(rows, keys, who="TarReader")
            except (KeyError, TypeError) as exc:
                raise type(exc)(f"{exc.args[0]} (shard {path}, samples {start}..{stop - 1})") from exc

        return len(samples), read

    def _row(self, path: str, file: BinaryIO, sample: Sample) -> Mapping[str, Any]:
        key, members = sample
        decoded: dict[str, Any] = {"__key__": key, "__url__": path}
        for name, ext, offset, size in members:
            file.seek(offset)
            data = file.read(size)
            if len(data) != size:
                raise ValueError(f"TarReader: shard {path} ends inside member {name!r}: the file is truncated")
            decoded[ext] = _decode(path, name, ext, data)
        return self.transform(decoded) if self.transform is not None else decoded


def index(path: str) -> list[Sample]:
    """The samples of tar shard ``path`` in file order, each with its members' data offsets (headers only)."""
    size = os.path.getsize(path)
    try:
        with tarfile.open(path, mode="r:") as tar:
            members = tar.getmembers()
            end = tar.offset  # where listing stopped: the end-of-archive block of an intact file
            with open(path, "rb") as file:
                file.seek(end)
                trailer = file.read(tarfile.BLOCKSIZE)
    except tarfile.ReadError as exc:
        raise ValueError(
            f"TarReader: shard {path} is not a readable uncompressed tar file ({exc}); is it truncated, damaged or "
            "compressed? Re-create the shard (webdataset's TarWriter or `tar cf`)"
        ) from exc
    if trailer != bytes(tarfile.BLOCKSIZE):
        raise ValueError(
            f"TarReader: shard {path} has no end-of-archive block where its members end (byte {end} of {size}): the "
            "file is truncated or a member header is damaged, and the samples after it would be lost; re-create it"
        )
    samples: list[Sample] = []
    for member in members:
        if not member.isfile():
            continue
        key, ext = _split(member.name)
        if key is None:
            continue
        if not samples or samples[-1][0] != key:
            samples.append((key, []))
        elif any(m[1] == ext for m in samples[-1][1]):
            raise ValueError(f"TarReader: shard {path} has two members {key}.{ext} in one sample")
        samples[-1][1].append((member.name, ext, member.offset_data, member.size))
    return samples


def _split(name: str) -> tuple[str | None, str]:
    """(key, extension) of a member name, as webdataset splits it; (None, "") for a name without an extension."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem or not ext:
        return None, ""
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _decode(path: str, name: str, ext: str, data: bytes) -> Any:
    kind = ext.rpartition(".")[2]
    try:
        if kind == "npy":
            return np.load(io.BytesIO(data), allow_pickle=False)
        if kind in _INTS:
            return int(data)
        if kind in _TEXTS:
            return data.decode("utf-8")
        if kind in _JSONS:
            return json.loads(data)
    except (ValueError, UnicodeDecodeError, OSError, EOFError) as exc:
        raise ValueError(f"TarReader: member {name!r} of shard {path} cannot be decoded as .{kind}: {exc}") from exc
    return data
