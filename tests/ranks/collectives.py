"""A rank program: env:// rendezvous, then every collective through the
blocking Backend, checked against float64 references. Prints OK on success."""

from __future__ import annotations

import os
import sys
import threading

import torch

import ferrogrpc as fg


def inputs(rank: int, n: int, numel: int, seed: int) -> torch.Tensor:
    return torch.randn(
        numel, generator=torch.Generator().manual_seed(seed * 97 + rank), dtype=torch.float64
    )


def main() -> None:
    backend = fg.init_backend()
    rank, world = backend.rank, backend.world_size
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    with backend:
        for seed, numel in enumerate([0, 1, 5, 1000, 262_147]):
            all_inputs = [inputs(r, world, numel, seed) for r in range(world)]
            ref = torch.stack(all_inputs).sum(0)
            t = all_inputs[rank].clone()
            assert backend.all_reduce(t) is t
            torch.testing.assert_close(t, ref, atol=1e-10, rtol=1e-10)
            t32 = all_inputs[rank].float()
            backend.all_reduce(t32, "mean")
            torch.testing.assert_close(t32.double(), ref / world, atol=1e-5, rtol=1e-5)
            gathered = backend.all_gather(all_inputs[rank])
            for r in range(world):
                assert torch.equal(gathered[r], all_inputs[r])
            part = backend.reduce_scatter(all_inputs[rank])
            torch.testing.assert_close(
                part, torch.tensor_split(ref, world)[rank], atol=1e-10, rtol=1e-10
            )
            b = all_inputs[rank].clone()
            backend.broadcast(b, root=world - 1)
            assert torch.equal(b, all_inputs[world - 1])
        # Async handles, issued from a second thread (as autograd hooks do),
        # waited on from this one.
        works: list[fg.Work[torch.Tensor]] = []
        tensors = [torch.full((1000 + i,), float(rank + i)) for i in range(8)]

        def issue() -> None:
            for t in tensors:
                works.append(backend.all_reduce(t, async_op=True))

        thread = threading.Thread(target=issue)
        thread.start()
        thread.join()
        for i, work in enumerate(works):
            out = work.wait(timeout=60)
            assert out is tensors[i]
            expected = sum(float(r + i) for r in range(world))
            assert bool((out == expected).all()), (i, out[:3])
            assert work.is_completed()
        backend.barrier()
    backend.close()  # idempotent
    print(f"OK rank {rank}/{world}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        print(f"FAILED: {exc!r}", flush=True)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    # Closed already: end now, without torch's exit-time destructors (0.7 s
    # of CPU a process, which the suite would pay hundreds of times).
    os._exit(0)
