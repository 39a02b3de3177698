"""Redis connections with a bounded retry policy, for a plain server or a Redis Cluster (detected).

Retries come from redis-py's own ``Retry``/``ExponentialBackoff`` objects. They are safe for our scripts because
every slot transition is idempotent for a retried call (see NOTE [ Slot states ] in ``scripts.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, TypeAlias

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .errors import QueueStateLostError, RedisUnavailableError
from .scripts import STALE_MARK

Client: TypeAlias = "redis.Redis | RedisCluster"

_SOCKET_TIMEOUT_S = 5.0  # longer than a Lua call ever takes; a paused server is ridden out by retries
_BACKOFF_CAP_S = 1.0


def _retry(total_s: float) -> Retry:
    # Each attempt can take up to the socket timeout plus the backoff; size the count to the total budget.
    attempts = max(2, math.ceil(total_s / (_BACKOFF_CAP_S + 0.5)))
    return Retry(ExponentialBackoff(cap=_BACKOFF_CAP_S, base=0.02), attempts)


def connect(url: str, total_timeout_s: float = 30.0) -> Client:
    """A client for ``url``; a server with cluster mode enabled gets a cluster client."""
    options: dict[str, Any] = {
        "socket_timeout": _SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 2.0,
        "retry": _retry(total_timeout_s),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    client = redis.Redis.from_url(url, **options)
    with translate_errors(url):
        cluster = url.startswith(("redis://", "rediss://")) and client.info("cluster").get("cluster_enabled")
    if cluster:
        client.close()
        options.pop("retry_on_error")
        return _ClusterClient.from_url(url, **options)
    return client


class _ClusterClient(RedisCluster):
    """``RedisCluster.close()`` leaves the node pools of a ``from_url`` client connected; disconnect them too."""

    def close(self) -> None:
        super().close()
        self.disconnect_connection_pools()  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def translate_errors(url: str = "") -> Iterator[None]:
    """Turn redis-py's errors into gigashuffle's, once the retry budget is spent."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise RedisUnavailableError(
            f"Redis at {url or 'the configured URL'} did not answer within the retry budget ({exc}); "
            "check that the server runs and is reachable, or raise DataloaderConfig.redis_timeout_s"
        ) from exc
    except ResponseError as exc:
        if STALE_MARK in str(exc):
            raise QueueStateLostError(
                f"the queue's state in Redis is gone or belongs to a newer session ({exc}); Redis was restarted "
                "without persistence, flushed, or another job reset this queue"
            ) from exc
        raise


def close(client: Client) -> None:
    """Close every pooled connection of ``client`` (plain or cluster)."""
    client.close()
