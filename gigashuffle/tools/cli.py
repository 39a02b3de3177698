"""The ``gigashuffle`` command: ``demo``, ``stats`` and ``bench``.

Only the standard library is imported at module level: ``gigashuffle --help`` must answer at once, and torch
alone takes seconds to import. Each subcommand imports what it needs when it runs. The ``stats`` command lives in
:mod:`.statscommand` and :mod:`.statsservers`; its names stay importable from here.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from gigashuffle._version import __version__
from gigashuffle.tools.statscommand import (
    COLUMNS,
    DEFAULT_INTERVAL_S,
    DEFAULT_WATCH_S,
    format_table,
    stats,
    stats_parser,
)
from gigashuffle.tools.statsservers import CliError, embedded_servers


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


__all__ = [
    "COLUMNS",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_WATCH_S",
    "CliError",
    "build_parser",
    "demo_parser",
    "embedded_servers",
    "format_table",
    "main",
    "stats",
    "stats_parser",
]


if __name__ == "__main__":
    sys.exit(main())
