"""Where ``gigashuffle stats`` finds its servers and how it talks to them: the embedded servers of this machine or
the one named by ``--redis``, one client each, and the Redis failures a user can act on as :class:`CliError`.

Only the standard library at module level, as in ``tools/cli.py``: the command must start at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gigashuffle.tools.stats import Sample, sample

if TYPE_CHECKING:
    from gigashuffle.control.client import Client


class CliError(Exception):
    """A failure the user can act on, reported as one line on stderr and exit code 1, without a traceback."""


def embedded_servers() -> list[str]:
    """URLs of the embedded servers (one per node) that answer in this user's runtime directory."""
    from gigashuffle.control.embedded import answers
    from gigashuffle.host.rundir import runtime_dir

    return [f"unix://{path}" for path in sorted(runtime_dir().glob("redis-*.sock")) if answers(path)]


def _fixed_server(explicit: str | None) -> str | None:
    """The one server named by --redis or $GIGASHUFFLE_REDIS_URL; None: list the embedded servers."""
    from gigashuffle.config import redis_url_in_use

    try:
        return redis_url_in_use(explicit, "--redis")
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _no_embedded_server() -> str:
    from gigashuffle.host.rundir import runtime_dir

    return f"no embedded gigashuffle server answers in {runtime_dir()} (no loader of this user runs on this machine)"


def _root_cause(exc: BaseException) -> str:
    """The innermost error of a chain (e.g. ``Connection refused``), on one line: our retry wrappers around it
    add nothing a user can act on."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return " ".join(str(exc).split()) or type(exc).__name__


class _Servers:
    """The servers to list, with one client each kept across refreshes; Redis failures become :class:`CliError`.

    Without a fixed server, the embedded servers are found again at every refresh: they come and go with the
    loaders of their node, and ``--watch`` should follow them as ``top`` follows processes.
    """

    def __init__(self, fixed: str | None, timeout_s: float) -> None:
        self.fixed = fixed
        self.timeout_s = timeout_s
        self.urls: list[str] = []
        self.clients: dict[str, Client] = {}

    def refresh(self) -> None:
        if self.fixed is not None:
            self.urls = [self.fixed]
            return
        from gigashuffle.errors import GigashuffleError

        try:
            self.urls = embedded_servers()
        except (GigashuffleError, OSError) as exc:
            raise CliError(f"cannot read the runtime directory: {_root_cause(exc)}") from exc
        for gone in set(self.clients) - set(self.urls):
            self.clients.pop(gone).close()

    def _guard(self, url: str, call: Callable[[], Any]) -> Any:
        import redis

        from gigashuffle.errors import GigashuffleError

        try:
            return call()
        except (redis.RedisError, GigashuffleError, OSError) as exc:
            raise CliError(
                f"Redis at {url} failed: {_root_cause(exc)}; check that the server runs and that the URL is right "
                f"(--redis URL), or allow it longer than {self.timeout_s:g} s with --timeout SECONDS"
            ) from exc

    def sample(self) -> list[Sample]:
        from gigashuffle.control.client import connect

        samples = []
        for url in list(self.urls):
            try:
                if url not in self.clients:
                    connecting = functools.partial(connect, url, total_timeout_s=self.timeout_s)
                    self.clients[url] = self._guard(url, connecting)
                samples += self._guard(url, functools.partial(sample, self.clients[url], url))
            except CliError:
                if self.fixed is not None:
                    raise
                # An embedded server stops when the last loader of its node closes, maybe since refresh().
                self.urls.remove(url)
                client = self.clients.pop(url, None)
                if client is not None:
                    client.close()
        return samples

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
