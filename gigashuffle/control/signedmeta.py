"""The buffer's metadata in Redis: plain JSON and raw bytes, authenticated with an HMAC.

Nothing here is unpickled. The HMAC (keyed by the node secret in the private runtime directory) covers the
session generation too, so metadata replayed from another session or written by another user is refused.
"""

from __future__ import annotations

from gigashuffle.errors import TamperedMetadataError
from gigashuffle.host.secret import sign, verify
from gigashuffle.schema import Layout

_SIGNED = ("layout", "slots", "first_row", "owner", "nbytes")


def signed_meta(secret: bytes, generation: str, fields: dict[str, bytes]) -> dict[str, bytes | str]:
    signature = sign(secret, generation.encode(), *(fields[name] for name in _SIGNED))
    return {**fields, "hmac": signature}


def verified_layout(secret: bytes, generation: str, meta: dict[str, bytes], queue: str) -> Layout:
    """The layout from ``meta`` once its HMAC checks out; ``TamperedMetadataError`` otherwise."""
    missing = [name for name in (*_SIGNED, "hmac") if name not in meta]
    if missing or not verify(secret, meta["hmac"], generation.encode(), *(meta[n] for n in _SIGNED)):
        raise TamperedMetadataError(
            f"the buffer metadata of queue {queue!r} in Redis fails its HMAC check"
            f"{' (missing ' + ', '.join(missing) + ')' if missing else ''}: it was not written by a gigashuffle "
            "process of this user on this machine in this session, or it was modified; refusing to use it"
        )
    return Layout.from_json(meta["layout"])


def unsigned_fields(meta: dict[str, bytes]) -> dict[str, bytes]:
    """The fields of verified ``meta`` without its HMAC, to sign again under another generation (a rejoin)."""
    return {name: value for name, value in meta.items() if name != "hmac"}


def same_buffer(fields: dict[str, bytes], other: dict[str, bytes]) -> bool:
    """Whether two copies of metadata describe one buffer (its owner names the process that allocated it)."""
    return all(fields.get(name) == other.get(name) for name in _SIGNED)
