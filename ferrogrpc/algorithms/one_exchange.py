"""Small collectives in one exchange: every rank sends its data to every
other rank, and each computes the result itself.

Below ``SMALL_BYTES`` (and up to ``SMALL_WORLD`` ranks) a collective's cost
is its latency, not its bytes: a ring needs ``2(n-1)`` steps, each a round of
messages, while one exchange is a single round. For an all-gather and a
reduce-scatter the bound is on one rank's part, not the whole tensor, except
where several hosts hold several ranks each (see ``exchange_plan.is_small``). A rank
sends one message to each other rank (over the host's shared-memory sockets
to ranks on its host, over its long-lived gRPC link to the others: no new
stream per collective), receives one from each, and reduces the values in
rank order, so every rank computes bitwise the same result. Every message carries the sender's
descriptor, checked as a ring's stream is, and a checksum when it crosses
gRPC.

The pure part (which collectives are small, what goes where, how the
result is computed) is in exchange_plan.py; this module moves the bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from ..errors import FerroGrpcError
from ..failure.watchdog import Watchdog
from ..samehost.plane import SMALL, LocalPlane, split_small
from ..transport.wire import bytes_view
from ..v1 import collective_pb2 as pb
from .context import RankContext
from .exchange_plan import finish, mismatch, plan, wrong_size
from .jobs import Job
from .links import Links, check_part, send_parts


class SmallRunner:
    """Runs one small collective (see the module docstring)."""

    def __init__(
        self,
        ctx: RankContext,
        links: Links,
        plane: LocalPlane | None,
        local: Sequence[int],
        job: Job,
    ) -> None:
        self.ctx = ctx
        self.links = links
        self.plane = plane
        self.local = set(local) if plane is not None else set()
        self.job = job
        me = ctx.identity
        self.me = me
        self.watch = Watchdog(me, ctx.transport, ctx.timeouts.idle, job.name, job.seq)
        self.desc = job.descriptor.SerializeToString()
        # Messages over gRPC go in parts of at most a chunk.
        self.part = max(1, job.descriptor.chunk_elems) * job.buffer.element_size()
        # A wire dtype applies where bytes cross gRPC: then every rank's
        # contribution is rounded to it, its own and its host's included, so
        # that every rank reduces the same values.
        all_local = plane is not None and len(self.local) == me.world_size
        self.wire = None if all_local else job.wire

    async def run(self) -> None:
        job, ctx = self.job, self.ctx
        try:
            await self.watch.guard_here(self._main())
        except BaseException as exc:
            if self.plane is not None and self.local:
                cause = ctx.failure.cause(exc, job.name, job.seq, self.watch.first_failure)
                # No rounds here: a refusal leaves the plane as it was.
                if not ctx.failure.plane_survives(cause, mid_round=False):
                    self.plane.abort(ctx.failure.abort_message(cause))
            raise

    # ----------------------------------------------------------- messages

    async def _send(self, dst: int, data: torch.Tensor) -> None:
        if self.wire is not None:
            data = data.to(self.wire)
        view = bytes_view(data)
        if dst in self.local:
            assert self.plane is not None
            self.plane.send_small(dst, self.job.seq, self.desc, view)
            return
        ctx, job = self.ctx, self.job
        header = pb.ChunkHeader(group=ctx.group, seq=job.seq, src_rank=self.me.rank)
        header.kind = job.kind  # type: ignore[assignment]
        header.descriptor.CopyFrom(job.descriptor)
        await send_parts(ctx, self.links, self.watch, dst, header, view, self.part)

    def _mismatch(self, src: int, theirs: pb.Descriptor, what: str) -> FerroGrpcError:
        return mismatch(self.me, self.job, src, theirs, what)

    def _sizes(self, src: int, got: int, expected: int) -> FerroGrpcError:
        return wrong_size(self.me, self.job, src, got, expected)

    async def _receive(self, src: int, nbytes: int) -> memoryview:
        job = self.job
        what = f"{job.name}#{job.seq} from"
        if src in self.local:
            assert self.plane is not None
            kind, payload = await self.watch.wait(
                f"r{src}", src, what, self.plane.first(src, job.seq)
            )
            if kind != SMALL:
                raise self._mismatch(
                    src, pb.Descriptor.FromString(payload), "ran it through shared segments"
                )
            desc, data = split_small(payload)
            if desc != self.desc:
                raise self._mismatch(src, pb.Descriptor.FromString(desc), "disagrees")
            if data.nbytes != nbytes:
                raise self._sizes(src, data.nbytes, nbytes)
            self.ctx.stats.local(src, data.nbytes)
            return data
        ctx = self.ctx
        parts = []
        for part in range(max(1, -(-nbytes // self.part))):
            key = (ctx.group, job.seq, part, src)
            box = ctx.mailboxes.get(key)
            try:
                if box.arrived.done():
                    header, item = box.arrived.result()
                else:
                    header, item = await self.watch.wait(
                        f"r{src}", src, what, asyncio.shield(box.arrived)
                    )
            finally:
                ctx.mailboxes.drop(key)
            if not isinstance(item, memoryview):
                err = self._mismatch(src, header.descriptor, "ran it as a ring")
                if not box.done.done():
                    box.done.set_exception(err)  # fail its stream with the cause
                    box.done.exception()
                raise err
            if header.descriptor != job.descriptor:
                raise self._mismatch(src, header.descriptor, "disagrees")
            size = min(self.part, nbytes - part * self.part)
            if header.offset != nbytes or item.nbytes != max(size, 0):
                raise self._sizes(src, header.offset, nbytes)
            check_part(ctx, self.me, job.name, job.seq, src, header, item)
            parts.append(item)
        data = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
        ctx.stats.received(src, data.nbytes)
        return data

    async def _exchange(
        self, outgoing: dict[int, torch.Tensor], expect: dict[int, int]
    ) -> dict[int, memoryview]:
        """Send ``outgoing[r]`` to every other rank r and receive ``expect[r]``
        bytes from each; return what each sent. Ranks on this host are sent to
        at once (a socket write); a failed gRPC send fails the exchange at
        once, like a failed receive."""
        got: dict[int, memoryview] = {}
        if not self.local:
            # Every message crosses gRPC: send each, then take each, in this
            # task (tasks cost more than the messages). No send waits on a
            # receive: every rank's intake reads its links as they arrive.
            for dst, data in outgoing.items():
                await self._send(dst, data)
            # All the senders are probed while any is awaited: a rank gone
            # (whose link took this rank's message before it noticed) is
            # named while an earlier rank is only late.
            what = f"{self.job.name}#{self.job.seq} from"
            with self.watch.awaiting({f"r{src}": (src, what) for src in outgoing}):
                for src in outgoing:
                    got[src] = await self._receive(src, expect[src])
            return got

        async def receive(src: int) -> None:
            got[src] = await self._receive(src, expect[src])

        remote = [dst for dst in outgoing if dst not in self.local]
        for dst in outgoing:
            if dst in self.local:
                await self._send(dst, outgoing[dst])
        async with asyncio.TaskGroup() as tg:
            for dst in remote:
                tg.create_task(self._send(dst, outgoing[dst]))
            for src in outgoing:
                tg.create_task(receive(src))
        return got

    # --------------------------------------------------------- algorithms

    async def _main(self) -> None:
        job, me = self.job, self.me
        buf, stage = job.buffer, job.stage
        if stage is not None:
            await stage.ready(0, buf.numel())
        outgoing, expect = plan(job, me.rank, me.world_size, self.wire)
        got = await self._exchange(outgoing, expect)
        done = finish(job, me.rank, me.world_size, got, self.wire)
        if stage is not None:
            stage.final(*done)
