"""One rank of two that all-reduces twice, says so, then sleeps until
stopped: with ``own`` as its argument, it sets a SIGTERM handler of its
own first (which exits 3)."""

import os
import signal
import sys
import time

import torch

import ferrogrpc as fg

if sys.argv[1:] == ["own"]:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(3))
backend = fg.init_backend()
for _ in range(2):
    backend.all_reduce(torch.ones(4))
print("ready", flush=True)
time.sleep(120)
