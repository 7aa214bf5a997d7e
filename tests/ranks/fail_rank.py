"""For launcher tests: rank 1 exits 3 after a moment; others wait forever
(or, with 'sleep', every rank sleeps until signalled)."""

from __future__ import annotations

import os
import signal
import sys
import time

rank = int(os.environ["RANK"])
mode = sys.argv[1] if len(sys.argv) > 1 else "fail"
if mode == "sleep":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
# One write per line: the ranks share the launcher's stdout, and under
# PYTHONUNBUFFERED print() writes the text and its newline separately, so two
# ranks' lines could interleave ("rank 0 ...rank 1 ...\n\n") and a reader
# counting lines would wait forever.
sys.stdout.write(f"rank {rank} of {os.environ['WORLD_SIZE']} port {os.environ['MASTER_PORT']}\n")
sys.stdout.flush()
if mode == "sleep":
    time.sleep(60)
    sys.exit(0)
if rank == 1:
    time.sleep(0.5)
    sys.exit(3)
time.sleep(60)
