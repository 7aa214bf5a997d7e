"""``ferrogrpc demo``: for now, a short all_reduce benchmark against gloo."""

from __future__ import annotations

from client.bench import main as bench_main


def main(argv: list[str] | None = None) -> int:
    return bench_main(
        ["--world-sizes", "2", "--min-size", "1M", "--max-size", "64M", *(argv or [])]
    )
