"""A trainer's link to the control plane: which Redis, the client, the embedded server if ours, and the session.

One object opens them in order and closes them in reverse, so a loader that fails half-built and one that closes
normally undo the same things the same way (NOTE [ Shutdown ] in trainer/teardown.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gigashuffle.config import DataloaderConfig, redis_url_in_use
from gigashuffle.control import embedded
from gigashuffle.control.client import Client, connect
from gigashuffle.control.session import NodeSession, leave_at_close


def resolve_redis(config: DataloaderConfig) -> tuple[str, embedded.EmbeddedServer | None]:
    """The Redis to use: ``redis_url``, the seed's host/port/db, ``$GIGASHUFFLE_REDIS_URL``, else the node's
    embedded server (started, or joined, here: the second value is our hold on it)."""
    url = redis_url_in_use(config.redis_url or config.legacy_redis_url())
    if url:
        return url, None
    server = embedded.acquire(config.node)
    return server.url, server


@dataclass
class ControlLink:
    url: str
    server: embedded.EmbeddedServer | None  # held by this loader: released at close
    client: Client
    session: NodeSession

    @classmethod
    def open(cls, config: DataloaderConfig) -> ControlLink:
        """Resolve the server, connect, and join the node session; on any failure undo what was done."""
        url, server = resolve_redis(config)
        client: Client | None = None
        try:
            client = connect(url, config.redis_timeout_s)
            return cls(url, server, client, NodeSession(client, config))
        except BaseException:
            if client is not None:
                client.close()
            if server is not None:
                embedded.release(server)
            raise

    def close(self) -> None:
        """Leave the session (a client of its own with a short budget), close the client, release the server."""
        try:
            leave_at_close(self.session, self.url, self.server)
        finally:
            self.client.close()
            if self.server is not None:
                embedded.release(self.server)
