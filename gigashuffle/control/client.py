"""Redis connections with a bounded retry policy, for a plain server or a Redis Cluster (detected).

Retries come from redis-py's own ``Retry`` object; our backoff policy (``DeadlineBackoff``) bounds how long one
call keeps retrying rather than how often, so a refused connection and a server that hangs both end after about
``redis_timeout_s``. Retries are safe for our calls: each is idempotent for a retried call (the heartbeat records
absolute counts, and its SET finds its own token; see NOTE [ Heartbeat ] in ``control/session.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, TypeAlias, cast

import redis
from redis.backoff import AbstractBackoff
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from gigashuffle.control.lua import STALE_MARK
from gigashuffle.errors import QueueStateLostError, RedisUnavailableError

Client: TypeAlias = "redis.Redis | RedisCluster"

_MAX_SOCKET_TIMEOUT_S = 5.0  # far longer than any of our calls takes; a paused server is ridden out by retries


class DeadlineBackoff(AbstractBackoff):
    """Exponential backoff (from ``base_s``, capped at ``cap_s``) that gives up once a call has been failing for
    ``budget_s`` seconds, by raising a ``ConnectionError`` from ``compute``, which ``Retry`` lets through.

    redis-py copies the retry policy into each connection, and a connection serves one call at a time, so the
    clock (started by ``reset()``, which ``Retry`` calls as each call begins) needs no lock.
    """

    def __init__(self, budget_s: float, cap_s: float = 1.0, base_s: float = 0.02) -> None:
        self.budget_s = budget_s
        self.cap_s = cap_s
        self.base_s = base_s
        self._started = time.monotonic()

    def reset(self) -> None:
        self._started = time.monotonic()

    def compute(self, failures: int) -> float:
        elapsed = time.monotonic() - self._started
        if elapsed >= self.budget_s:
            raise RedisConnectionError(f"still failing after {elapsed:.1f} s of retries (budget {self.budget_s} s)")
        return float(min(self.cap_s, self.base_s * 2**failures, self.budget_s - elapsed))


def _retry(total_s: float, cluster: bool = False) -> Retry:
    # -1: no count limit, the backoff's deadline ends it. A cluster client loops over range(retries) itself, so
    # it gets a count that the deadline still cuts short.
    return Retry(DeadlineBackoff(total_s), retries=max(3, int(total_s)) if cluster else -1)


def connect(url: str, total_timeout_s: float = 30.0) -> Client:
    """A client for ``url``; a server with cluster mode enabled gets a cluster client."""
    options: dict[str, Any] = {
        # A hung server costs at most one socket timeout beyond the budget: keep that a fraction of it.
        "socket_timeout": min(_MAX_SOCKET_TIMEOUT_S, max(0.5, total_timeout_s / 4)),
        "socket_connect_timeout": min(2.0, max(0.5, total_timeout_s / 4)),
        "retry": _retry(total_timeout_s),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    client = redis.Redis.from_url(url, **options)
    with translate_errors(url):
        cluster = url.startswith(("redis://", "rediss://")) and client.info("cluster").get("cluster_enabled")
    if cluster:
        client.close()
        options.pop("retry_on_error")
        options["retry"] = _retry(total_timeout_s, cluster=True)
        return _ClusterClient.from_url(url, **options)
    return client


class _ClusterClient(RedisCluster):
    """``RedisCluster.close()`` leaves the node pools of a ``from_url`` client connected; disconnect them too."""

    def close(self) -> None:
        super().close()
        self.disconnect_connection_pools()  # type: ignore[no-untyped-call]


def address(client: Client) -> str:
    """Where ``client`` connects (a unix socket path or host:port), for error messages."""
    if isinstance(client, RedisCluster):
        node = client.get_default_node()  # type: ignore[no-untyped-call]
        return f"{node.host}:{node.port}" if node is not None else "a Redis Cluster"
    kwargs = client.connection_pool.connection_kwargs
    return str(kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}")


@contextlib.contextmanager
def translate_errors(where: str = "") -> Iterator[None]:
    """Turn redis-py's errors into gigashuffle's, once the retry budget is spent; ``where`` names the server."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise RedisUnavailableError(
            f"Redis at {where or 'the configured URL'} did not answer within the retry budget ({exc}); "
            "check that the server runs and is reachable, or raise DataloaderConfig.redis_timeout_s"
        ) from exc
    except ResponseError as exc:
        if STALE_MARK in str(exc):
            raise QueueStateLostError(
                f"the queue's state in Redis is gone or belongs to a newer session ({exc}); Redis was restarted "
                "without persistence, flushed, or another job reset this queue"
            ) from exc
        raise


def run_script(script: Script, keys: list[str], args: list[Any], where: str = "") -> Any:
    """Run a registered Lua script, with gigashuffle's errors (see ``translate_errors``).

    redis-py's ``Script`` answers NOSCRIPT (a server restarted with an empty script cache) by loading the script
    and calling EVALSHA once more; a server restarted between that load and that call (the chaos suite's Redis
    restarts hit it) answers NOSCRIPT again. EVAL with the script's text needs no cache, so it is the fallback."""
    with translate_errors(where):
        try:
            return script(keys=keys, args=args)
        except NoScriptError:
            text = cast(str, script.script)  # every script here is registered from a str constant
            return script.registered_client.eval(text, len(keys), *keys, *args)
