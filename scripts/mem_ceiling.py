"""The memory-bandwidth ceiling of this machine, for the same-host path:
memcpy (``dst.copy_(src)``) and a 3-stream add (``torch.add(a, b,
out=c)``), float32, single-threaded, on tensors far larger than the caches;
once in one process, and once in two processes at the same time (both cores
streaming, as two ranks do). Reports GB/s of bytes written.

    python scripts/mem_ceiling.py --mib 64
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch


def measure(mib: int, iters: int) -> dict[str, float]:
    torch.set_num_threads(1)
    n = mib * (1 << 20) // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    out: dict[str, float] = {}
    for name, op in (("memcpy", lambda: c.copy_(a)), ("add", lambda: torch.add(a, b, out=c))):
        op()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        out[name] = n * 4 / statistics.median(times) / 1e9
    return out


def _child(args: tuple[int, int]) -> dict[str, float]:
    return measure(*args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args()
    one = measure(args.mib, args.iters)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        two = pool.map(_child, [(args.mib, args.iters)] * 2)
    for name in ("memcpy", "add"):
        pair = ", ".join(f"{r[name]:.2f}" for r in two)
        print(
            f"{name:>6} {args.mib} MiB float32: one process {one[name]:.2f} GB/s; "
            f"two at once {pair} GB/s each (sum {sum(r[name] for r in two):.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
