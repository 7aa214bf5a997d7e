"""A checkout's ``python -m server --world-size N --port P``: the same program
as ``ferrogrpc coordinator`` (which a pip install provides; the docs name that
one), kept for the checkout's tests, benchmarks and demos."""

from __future__ import annotations

import sys

from ferrogrpc.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["coordinator", *sys.argv[1:]]))
