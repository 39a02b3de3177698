"""The ``gigashuffle`` command: ``demo``, ``stats`` and ``bench``.

Only the standard library is imported at module level: ``gigashuffle --help`` must answer at once, and torch
alone takes seconds to import. Each subcommand imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from gigashuffle._version import __version__
from gigashuffle.tools.stats import (
    Sample,
    needs_second_record,
    prometheus_text,
    sample,
    short_generation,
    with_rates,
)

if TYPE_CHECKING:
    from gigashuffle.control.client import Client

COLUMNS = ["queue", "node", "size", "full", "empty", "in_flight", "ranks", "processes", "written_per_s",
           "read_per_s", "lock_busy_pct", "generation"]  # fmt: skip
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: what top does between refreshes
DEFAULT_WATCH_S = 2.0
DEFAULT_INTERVAL_S = 5.0  # 2.5 heartbeats (HEARTBEAT_S in control/session.py): a second record comes by then


class CliError(Exception):
    """A failure the user can act on, reported as one line on stderr and exit code 1, without a traceback."""


# ------------------------------------------------------------------------------------------------ stats


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


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    rows = [{**r, "generation": short_generation(r["generation"])} for r in rows]

    widths = {c: max([len(c), *(len(cell(r[c])) for r in rows)]) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip()]
    lines += ["  ".join(cell(r[c]).ljust(widths[c]) for c in COLUMNS).rstrip() for r in rows]
    if not rows:
        lines.append("(no gigashuffle queues on this server)")
    return "\n".join(lines)


def _show(rows: list[dict[str, Any]], urls: list[str], args: argparse.Namespace, out: TextIO, frame: int) -> None:
    if args.prometheus:
        if args.watch is not None and frame:
            out.write("\n")  # one exposition per refresh, a blank line between them
        out.write(prometheus_text(rows))
    elif args.json:
        # One document per refresh; under --watch one compact line each (JSON Lines), so a pipe can parse it.
        out.write(json.dumps(rows, separators=(",", ":")) + "\n" if args.watch else json.dumps(rows, indent=2) + "\n")
    else:
        if args.watch is not None:
            if out.isatty():
                out.write(_CLEAR)
            elif frame:
                out.write("\n")
            stamp = time.strftime("%H:%M:%S")
            where = ", ".join(urls) or _no_embedded_server()
            out.write(f"gigashuffle stats  {stamp}  every {args.watch:g} s  {where}\n")
        out.write(format_table(rows) + "\n")
    out.flush()


def stats_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--redis",
        "--redis-url",
        dest="redis",
        metavar="URL",
        default=None,
        help="the server to list (default: $GIGASHUFFLE_REDIS_URL, else every node's embedded server on this machine)",
    )
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="print JSON (under --watch: one line per refresh)")
    shape.add_argument(
        "--prometheus",
        action="store_true",
        help="print the Prometheus text format (gigashuffle_node_rows_per_second{server,queue,node} etc.; the "
        "per-rank figures are each trainer's loader.metrics().to_prometheus())",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="SECONDS",
        help="rates are taken between two of a node's counter records, made every 2 s; in a job's first seconds "
        f"the first frame waits up to SECONDS for a second one (default {DEFAULT_INTERVAL_S:g}; 0: never waits)",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=DEFAULT_WATCH_S,
        default=None,
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C, like top",
    )
    parser.add_argument("--count", type=int, default=None, metavar="N", help="stop after N refreshes (with --watch)")
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="how long Redis may not answer (default 5)"
    )
    return parser


def _end_on_sigint() -> threading.Event:
    """Ctrl-C ends a watch: an event the loop checks, set by our own handler.

    Python's default handler only raises KeyboardInterrupt, which a library call may swallow (an exception in a
    ``__del__`` or a finalizer is only printed) or which never comes when SIGINT was ignored by whoever started
    us; then a watch would refresh forever. The handler is installed explicitly, and the loop checks the event.
    """
    interrupted = threading.Event()

    def handle(_signum: int, _frame: Any) -> None:
        interrupted.set()

    signal.signal(signal.SIGINT, handle)
    return interrupted


def _first_samples(servers: _Servers, wait_s: float) -> list[Sample]:
    """The first frame's samples, once every queue has two counter records or after ``wait_s`` (NOTE [ Stats rates ]
    in tools/stats.py): the first frame shows rates too, in the first seconds of a job as well."""
    samples = servers.sample()
    deadline = time.monotonic() + wait_s
    while needs_second_record(samples) and time.monotonic() < deadline:
        time.sleep(0.1)
        samples = servers.sample()
    return samples


def stats(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    if args.watch is not None and not args.watch > 0:
        raise CliError(f"--watch {args.watch:g} is invalid: use a positive number of seconds")
    if args.count is not None and args.count < 1:
        raise CliError(f"--count {args.count} is invalid: use 1 or more refreshes")
    if not args.timeout > 0:
        raise CliError(f"--timeout {args.timeout:g} is invalid: use a positive number of seconds")
    watching = args.watch is not None
    servers = _Servers(_fixed_server(args.redis), args.timeout)
    interrupted = _end_on_sigint() if watching else threading.Event()
    try:
        servers.refresh()
        # A Prometheus scraper asks whether or not a loader runs: no server is an exposition without samples.
        if not servers.urls and not watching and not args.prometheus:
            raise CliError(
                f"{_no_embedded_server()}; pass --redis URL for another server, or set GIGASHUFFLE_REDIS_URL"
            )
        previous: list[Sample] = []
        first = _first_samples(servers, args.interval)
        count = args.count if watching else 1
        frame = 0
        while True:
            if frame:
                servers.refresh()
            current = servers.sample() if frame else first
            _show(with_rates(current, previous), servers.urls, args, out, frame)
            frame += 1
            if (count is not None and frame >= count) or interrupted.is_set():
                return 0
            previous = current
            if interrupted.wait(args.watch):
                return 0
    except KeyboardInterrupt:
        return 0 if watching else 130  # Ctrl-C is how a watch ends; anywhere else it interrupts
    finally:
        servers.close()


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gigashuffle",
        description="A node-wide shared-memory shuffle buffer for PyTorch training, coordinated through Redis.",
        epilog="`gigashuffle <command> --help` shows the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"gigashuffle {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    # demo and bench parse their own options (and answer their own --help), in modules that import torch.
    commands.add_parser(
        "demo", add_help=False, help="run a real loader on the embedded Redis for a few seconds and report"
    )
    commands.add_parser(
        "bench", add_help=False, help="loader vs copy floor vs torch DataLoader; --json for machine-readable output"
    )
    stats_command = commands.add_parser(
        "stats",
        help="list every queue and node: slot counts, ranks, processes, rows/s (--watch, --json, --prometheus)",
        description="List every gigashuffle queue and node on this machine's embedded servers or on --redis URL.",
    )
    stats_parser(stats_command).set_defaults(parser=stats_command)
    return parser


def demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gigashuffle demo",
        description="Run a real loader (2 writers, 2 readers) on the embedded Redis over synthetic image-like rows "
        "for a few seconds, then report its start-up, throughput and shuffle quality. Progress goes to stderr.",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to read batches (default 5)")
    parser.add_argument("--queue", default=None, help="queue name (default: demo-<unix time>)")
    return parser


def _bench(argv: list[str]) -> int:
    """``gigashuffle bench``: its options and a missing extra are handled before torch is imported."""
    from gigashuffle.tools.bench.options import build_parser as bench_parser
    from gigashuffle.tools.bench.options import missing_extra

    bench_parser().parse_args(argv)  # --help and bad options answer at once
    if (missing := missing_extra()) is not None:
        print(missing, file=sys.stderr)
        return 1
    from gigashuffle.tools.bench.runner import main as bench_main

    return bench_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "demo":
        demo_args = demo_parser().parse_args(rest)  # --help answers before torch is imported
        from gigashuffle.tools.demo import run

        run(demo_args.seconds, demo_args.queue or f"demo-{int(time.time())}")
        return 0
    if args.command == "bench":
        return _bench(rest)
    if rest:
        args.parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return stats(args)
    except CliError as exc:
        print(f"gigashuffle {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
