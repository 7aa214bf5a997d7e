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
print(f"rank {rank} of {os.environ['WORLD_SIZE']} port {os.environ['MASTER_PORT']}", flush=True)
if mode == "sleep":
    time.sleep(60)
    sys.exit(0)
if rank == 1:
    time.sleep(0.5)
    sys.exit(3)
time.sleep(60)
