"""Training over rate-limited links (issue 31): gloo DDP beside ferrogrpc's
DDP (float32 and ``compression="int8"``) and DiLoCo, one rank per host.

    python -m client.bench --train-link 1gbit --what step
    python -m client.bench --train-link 100mbit --what lm

Each rank runs in a network namespace of its own (client/netlab.py), its
link shaped to RATE each way, so every byte crosses the shaped link.

``--what step``: the DDP step of bench_train's MLP (about 25.2M float32
parameters), one step of each implementation in turn, the order rotating:
torch's DistributedDataParallel on gloo, ferrogrpc's DDP in float32 and with
``compression="int8"``, and the model trained alone ("no communication",
the compute floor). Reported: the median step (slowest rank), as a multiple
of gloo DDP's, and the bytes each rank's link sent per step.

``--what lm``: the character-level language model of client/charlm.py
(1.85M parameters), each implementation trained for ``--steps`` steps from
the same start: gloo DDP, ferrogrpc DDP (float32 and int8), and DiLoCo
(``sync_every`` H = 50, AdamW inside, with and without fragments), and
the link's ceiling for DiLoCo ("raw TCP, DiLoCo's bytes": the model trained
alone while the bytes DiLoCo with ``--fragments`` sends cross the link at
the same steps on a plain socket, in the background: what the kernel's
work of moving them through this machine's shaped link costs any
implementation). Reported
per implementation: the wall time per step, the share of it spent
computing (the model trained alone, in the same run, over the
implementation's step: this also counts the CPU an exchange in the
background takes from the inner steps), the share not blocked on the
exchange (outside ``sync_gradients()`` or ``diloco.step()``), the bytes each
rank's link sent per step, and the held-out loss at the end (nats per
character; DiLoCo's after ``diloco.sync()``, outside the timed steps), and
the process CPU time per step. The implementations take turns, ``--block``
steps each, in an order that rotates; a DiLoCo exchange still in flight at
the end of its turn is waited for there, counted as blocked. Every rank's
final parameters are checked equal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from client.common import checkout_env, collect, rotated
from client.netlab import Link, network, tx_bytes

GLOO_PORT, FG_PORT = 29500, 29600
RAW_TCP = "raw TCP, DiLoCo's bytes"
LM_BATCH = 64
LM_LR = 2e-3


class _RawRing:
    """The ceiling of DiLoCo's "computing" share on this link and machine:
    a plain TCP connection to the next rank (and one from the previous),
    on which :meth:`kick` sends ``nbytes`` in the background while the
    previous rank's bytes are drained (each block answered with one byte),
    with no framing, checksum or reduction. The kernel's cost of moving
    bytes through the link is then all that the training loop loses."""

    def __init__(self, rank: int, world: int, master: str, nbytes: int) -> None:
        import queue
        import threading

        import torch.distributed as dist

        # This host's address on the link: the one that routes to rank 0.
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect((master, 9))
        address = probe.getsockname()[0]
        probe.close()
        server = socket.create_server((address, 0))
        endpoints: list[Any] = [None] * world
        dist.all_gather_object(endpoints, (address, server.getsockname()[1]))
        self._out = socket.create_connection(tuple(endpoints[(rank + 1) % world]))
        self._in, _ = server.accept()
        server.close()
        self._buffer = memoryview(bytearray(nbytes))
        self._kicks: queue.Queue[bool] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        threading.Thread(target=self._send, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()

    def _send(self) -> None:
        while self._kicks.get():
            self._out.sendall(self._buffer)
            # Done once the next rank has them all (not when they are
            # queued here): their bytes count in this turn.
            self._out.recv(1)
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def _drain(self) -> None:
        # A block at a time (MSG_WAITALL): one wake-up of this thread per
        # block, not one per burst of packets, each taking the interpreter's
        # lock from the training loop. The kernel's cost is the ceiling's,
        # not a Python reader's.
        block = memoryview(bytearray(len(self._buffer)))
        with contextlib.suppress(OSError):  # (closed: the run is over)
            while True:
                got = 0
                while got < len(block):
                    n = self._in.recv_into(block[got:], len(block) - got, socket.MSG_WAITALL)
                    if not n:
                        return
                    got += n
                self._in.sendall(b"k")

    def kick(self) -> None:
        with self._done:
            self._pending += 1
        self._kicks.put(True)

    def wait(self, timeout: float = 300.0) -> None:
        with self._done:
            if not self._done.wait_for(lambda: self._pending == 0, timeout):
                raise RuntimeError(f"raw TCP ring: a block not acknowledged within {timeout:g} s")

    def close(self) -> None:
        self._kicks.put(False)
        for sock in (self._out, self._in):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _setup() -> tuple[int, int, Any]:
    import torch
    import torch.distributed as dist

    import ferrogrpc as fg

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr = os.environ["MASTER_ADDR"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{addr}:{GLOO_PORT}", rank=rank, world_size=world
    )
    backend = fg.init_backend(rank, world, addr, FG_PORT)
    return rank, world, backend


def _step_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import ferrogrpc as fg
    from client.bench_train import build_model

    rank, world, backend = _setup()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=gen)
    y = torch.randn(args.batch, 1024, generator=gen)

    def model() -> nn.Module:
        built: nn.Module = build_model(4096, 1, io=1024)
        return built

    candidates: dict[str, tuple[nn.Module, Any]] = {
        "gloo DDP": (DistributedDataParallel(model()), None),
    }
    for name, compression in (("ferrogrpc DDP", None), ("ferrogrpc DDP int8", "int8")):
        ddp = fg.DDP(model(), backend, compression=compression)
        candidates[name] = (ddp, ddp.sync_gradients)
    candidates["no communication"] = (model(), None)
    if args.only:
        candidates = {n: c for n, c in candidates.items() if n in args.only}
    opts = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, (m, _) in candidates.items()}

    def step(name: str) -> tuple[float, int, float]:
        module, sync = candidates[name]
        dist.barrier()
        sent = tx_bytes()
        cpu = time.process_time()
        start = time.perf_counter()
        opts[name].zero_grad()
        nn.functional.mse_loss(module(x), y).backward()  # type: ignore[no-untyped-call]
        if sync is not None:
            sync()
        opts[name].step()
        wall = time.perf_counter() - start
        return wall, tx_bytes() - sent, time.process_time() - cpu

    for name in candidates:
        for _ in range(args.warmup):
            step(name)
    times: dict[str, list[float]] = {n: [] for n in candidates}
    sent: dict[str, list[int]] = {n: [] for n in candidates}
    cpu: dict[str, list[float]] = {n: [] for n in candidates}
    for i in range(args.steps):
        for name in rotated(list(candidates), i):
            t, b, c = step(name)
            times[name].append(t)
            sent[name].append(b)
            cpu[name].append(c)
    params = sum(p.numel() for p in next(iter(candidates.values()))[0].parameters())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "sent": sent, "cpu": cpu})
    if rank == 0:
        print("RESULT " + json.dumps({"params": params, "ranks": gathered}), flush=True)
    backend.close()
    dist.destroy_process_group()


def _lm_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import ferrogrpc as fg
    from client import charlm
    from ferrogrpc.wrappers.diloco_fragments import fragment_starting

    rank, world, backend = _setup()
    results: dict[str, Any] = {}

    @dataclasses.dataclass
    class Run:
        """One implementation's training, advanced a block at a time."""

        model: nn.Module
        inner: Any
        wrapped: Any
        after_step: Any
        # Waits for what is still in flight at the end of a turn (DiLoCo's
        # exchange, the raw ring's block), or None.
        settle: Any
        done: int = 0
        wall: float = 0.0
        cpu: float = 0.0
        blocked: float | None = 0.0
        sent: int = 0

        def advance(self, steps: int) -> None:
            """Train ``steps`` more steps, timed; a DiLoCo exchange still in
            flight at the end is waited for inside the time, as blocked (so
            that its bytes count here, not in the next implementation's
            block)."""
            dist.barrier()
            sent = tx_bytes()
            cpu = time.process_time()
            start = time.perf_counter()
            for step in range(self.done, self.done + steps):
                x, y = charlm.batch(rank, step, LM_BATCH, args.seed)
                self.inner.zero_grad()
                charlm.loss(self.wrapped, x, y).backward()  # type: ignore[no-untyped-call]
                waited = self.after_step()
                if waited is None or self.blocked is None:
                    self.blocked = None
                else:
                    self.blocked += waited
            if self.settle is not None:
                t = time.perf_counter()
                self.settle()
                if self.blocked is not None:
                    self.blocked += time.perf_counter() - t
            self.wall += time.perf_counter() - start
            self.cpu += time.process_time() - cpu
            self.sent += tx_bytes() - sent
            self.done += steps

    def finish(name: str, run: Run) -> None:
        """The held-out loss at the end, and whether every rank agrees."""
        if isinstance(run.wrapped, fg.DiLoCo):
            # The end of training: every rank the same model (each fragment
            # was last synced at another step, and local steps since).
            run.wrapped.sync()
        flat = torch.cat([p.detach().reshape(-1) for p in run.model.parameters()])
        copies = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(copies, flat)
        same = all(torch.equal(c, copies[0]) for c in copies)
        results[name] = {
            "step_s": run.wall / run.done,
            "cpu_step_s": run.cpu / run.done,
            "blocked": None if run.blocked is None else run.blocked / run.wall,
            "sent_per_step": run.sent / run.done,
            "loss": charlm.held_out_loss(run.model),
            "same": same,
        }

    # Each plan returns the model to call, what follows backward, which
    # returns the seconds it was blocked on the exchange (None: not
    # separable, gloo DDP's all-reduces run inside backward), and what ends
    # a turn (Run.settle).
    def local(model: nn.Module, inner: Any) -> tuple[Any, Any, Any]:
        def after() -> float:
            inner.step()
            return 0.0

        return model, after, None

    def gloo(model: nn.Module, inner: Any) -> tuple[Any, Any, Any]:
        def after() -> None:
            inner.step()

        return DistributedDataParallel(model), after, None

    def ddp(compression: str | None) -> Any:
        def build(model: nn.Module, inner: Any) -> tuple[Any, Any, Any]:
            wrapped = fg.DDP(model, backend, compression=compression)

            def after() -> float:
                t = time.perf_counter()
                wrapped.sync_gradients()
                waited = time.perf_counter() - t
                inner.step()
                return waited

            return wrapped, after, None

        return build

    def raw_tcp(model: nn.Module, inner: Any) -> tuple[Any, Any, Any]:
        """The model alone, while the bytes of DiLoCo with ``--fragments``
        cross the link at the same steps on a plain socket (_RawRing)."""
        width = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5}[args.diloco_compression]
        elements = sum(p.numel() for p in model.parameters())
        # A ring all-reduce sends 2(n-1)/n of the fragment.
        nbytes = max(1, int(2 * (world - 1) / world * elements * width / args.fragments))
        ring = _RawRing(rank, world, os.environ["MASTER_ADDR"], nbytes)
        rings.append(ring)
        count = [0]

        def after() -> float:
            inner.step()
            count[0] += 1
            if fragment_starting(count[0], args.sync_every, args.fragments) is not None:
                ring.kick()
            return 0.0

        return model, after, ring.wait

    def diloco(fragments: int, compression: str | None) -> Any:
        def build(model: nn.Module, inner: Any) -> tuple[Any, Any, Any]:
            d = fg.DiLoCo(
                model,
                backend,
                inner,
                sync_every=args.sync_every,
                outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum,
                fragments=fragments,
                compression=compression,
            )

            def after() -> float:
                inner.step()
                t = time.perf_counter()
                d.step()
                return time.perf_counter() - t

            return d, after, d.state_dict  # (waits for the exchange in flight)

        return build

    plans: dict[str, Any] = {
        "no communication": local,
        "gloo DDP": gloo,
        "ferrogrpc DDP": ddp(None),
        "ferrogrpc DDP int8": ddp("int8"),
    }
    h = args.sync_every
    for fragments in (1, args.fragments):
        plans[f"DiLoCo H={h} F={fragments} {args.diloco_compression}"] = diloco(
            fragments, None if args.diloco_compression == "fp32" else args.diloco_compression
        )
    plans[RAW_TCP] = raw_tcp
    rings: list[_RawRing] = []
    names = args.only or list(plans)
    runs: dict[str, Run] = {}
    for name in names:
        model = charlm.build(args.seed)
        inner = torch.optim.AdamW(model.parameters(), lr=LM_LR)
        runs[name] = Run(model, inner, *plans[name](model, inner))
    # The implementations take turns, a block of steps each, in an order
    # that rotates: the shared machine's slow and fast spells fall on all.
    # A turn ends a step before a multiple of the block (a multiple of H by
    # default): DiLoCo's exchange then in flight started tau - 1 steps
    # earlier and is due at the next step, so the wait at the end of the
    # turn is what the next step would have waited anyway.
    done, turn = 0, 0
    while done < args.steps:
        end = min(args.steps, (turn + 1) * args.block - (1 if args.block > 1 else 0))
        for name in rotated(names, turn):
            runs[name].advance(end - done)
        done, turn = end, turn + 1
    for name in names:
        finish(name, runs[name])
    for ring in rings:
        ring.close()
    if rank == 0:
        print("RESULT " + json.dumps({"results": results}), flush=True)
    backend.close()
    dist.destroy_process_group()


def _run(args: argparse.Namespace, link: Link | None) -> Any:
    """The worker on one rank per host, the hosts' links shaped to ``link``."""
    names = [f"rank{r}" for r in range(args.world_size)]
    with network(names, link) as net:
        hosts = list(net.hosts.values())
        env = checkout_env(
            OMP_NUM_THREADS="1",
            WORLD_SIZE=str(args.world_size),
            MASTER_ADDR=hosts[0].address,
            MASTER_PORT=str(FG_PORT),
        )
        cmd = [sys.executable, "-m", "client.bench_train_link", "--worker", *args.forward]
        procs = [
            subprocess.Popen(
                host.run(*cmd),
                # gloo finds its address through the interface, not the hostname.
                env={**env, "RANK": str(r), "GLOO_SOCKET_IFNAME": host.device},
                stdout=subprocess.PIPE,
                text=True,
            )
            for r, host in enumerate(hosts)
        ]
        try:
            return collect(procs, args.timeout, "bench_train_link")
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()


def _report_step(data: dict[str, Any], link: Link, world: int, steps: int) -> None:
    ranks = data["ranks"]
    names = list(ranks[0]["times"])
    slowest = {n: [max(r["times"][n][i] for r in ranks) for i in range(steps)] for n in names}
    med = {n: statistics.median(v) for n, v in slowest.items()}
    print(
        f"# DDP step, MLP {data['params'] / 1e6:.1f}M float32 params, world {world}, "
        f"link {link}: median of {steps} interleaved steps (slowest rank)"
    )
    print(
        f"{'implementation':<22} {'step s':>8} {'x gloo':>7} {'MB sent/step':>13} "
        f"{'CPU s/rank':>11}"
    )
    for n in names:
        mb = statistics.median(ranks[0]["sent"][n]) / 1e6
        # The process CPU time of a step (every thread: gRPC's, rounding),
        # the median over steps of the ranks' mean: with as many ranks as
        # cores, a step cannot take less.
        cpu = statistics.median(
            statistics.fmean(r["cpu"][n][i] for r in ranks) for i in range(steps)
        )
        ratio = f"{med[n] / med['gloo DDP']:7.2f}" if "gloo DDP" in med else f"{'-':>7}"
        print(f"{n:<22} {med[n]:8.3f} {ratio} {mb:13.1f} {cpu:11.3f}")


def _report_lm(
    data: dict[str, Any], link: Link, world: int, steps: int, args: argparse.Namespace
) -> None:
    results = data["results"]
    floor = results.get("no communication", {}).get("step_s")
    print(
        f"# char LM (client/charlm.py), world {world}, link {link}, {steps} steps, "
        f"batch {LM_BATCH}/rank, seed {args.seed}, AdamW lr {LM_LR}, "
        f"DiLoCo outer lr {args.outer_lr} momentum {args.outer_momentum}"
    )
    print(
        f"{'implementation':<28} {'step s':>8} {'computing':>9} {'unblocked':>9} "
        f"{'MB sent/step':>13} {'x fewer':>8} {'loss':>7} {'same':>5} {'CPU s/step':>10}"
    )
    ddp_bytes = results.get("ferrogrpc DDP", {}).get("sent_per_step")
    for n, r in results.items():
        share = f"{floor / r['step_s']:9.0%}" if floor else f"{'':>9}"
        free = f"{1 - r['blocked']:9.0%}" if r["blocked"] is not None else f"{'n/a':>9}"
        fewer = f"{ddp_bytes / r['sent_per_step']:8.1f}" if ddp_bytes and r["sent_per_step"] else ""
        print(
            f"{n:<28} {r['step_s']:8.4f} {share} {free} {r['sent_per_step'] / 1e6:13.3f} "
            f"{fewer:>8} {r['loss']:7.4f} {r['same']!s:>5} {r['cpu_step_s']:10.4f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--link", default="1gbit", help="RATE[,RTT]: 1gbit, 100mbit, ...")
    parser.add_argument("--what", choices=["step", "lm"], default="step")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="step: 5; lm: 300")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=5)
    parser.add_argument(
        "--block", type=int, default=250, help="lm: the steps each implementation runs per turn"
    )
    parser.add_argument(
        "--diloco-compression", choices=["fp32", "bf16", "int8", "int4"], default="bf16"
    )
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument(
        "--seed", type=int, default=0, help="lm: the model's initial weights and the batches"
    )
    parser.add_argument("--only", nargs="*", help="only these implementations")
    parser.add_argument("--json", help="also write the ranks' figures to this file")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (5 if args.what == "step" else 300)
    if args.steps < 1 or args.block < 1:
        parser.error("--steps and --block must be at least 1")
    if args.worker:
        (_step_worker if args.what == "step" else _lm_worker)(args)
        return 0
    args.forward = [
        *("--what", args.what, "--steps", str(args.steps), "--warmup", str(args.warmup)),
        *("--batch", str(args.batch), "--sync-every", str(args.sync_every)),
        *("--fragments", str(args.fragments), "--diloco-compression", args.diloco_compression),
        *("--block", str(args.block), "--seed", str(args.seed)),
        *("--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)),
        *(("--only", *args.only) if args.only else ()),
    ]
    link = Link.parse(args.link)
    # A SIGTERM (timeout, a CI's cancel) unwinds, so the namespaces go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data = _run(args, link)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f)
    if args.what == "step":
        _report_step(data, link, args.world_size, args.steps)
    else:
        _report_lm(data, link, args.world_size, args.steps, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
