"""The ``ferrogrpc`` command: demo, bench, launch, coordinator, status."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ferrogrpc",
        description="DDP and FSDP training over asyncio gRPC ring collectives.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="all_reduce benchmark against gloo (see --help)", add_help=False)
    sub.add_parser(
        "demo", help="train locally with DDP and FSDP and check equivalence", add_help=False
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from client.bench import main as bench_main

        return bench_main(rest)
    if command == "demo":
        from client.demo import main as demo_main

        return demo_main(rest)
    parser.parse_args(argv)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
