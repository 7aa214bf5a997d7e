"""Run the ferrogrpc coordinator: ``python -m server --world-size N --port P``
(the same program as ``ferrogrpc coordinator``; see its ``--help``)."""

from __future__ import annotations

import sys

from ferrogrpc.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["coordinator", *sys.argv[1:]]))
