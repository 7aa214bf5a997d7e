"""Joining: from settings to the connected parts of one rank.

:func:`join` binds the transport (whose stream intake holds early arrivals
until the rank knows who it is), opens this rank's shared segment, joins the
rendezvous with its address, nonce and host key, and then builds what the
rank needs: its identity, the job table, the failure policy, the same-host
plane connected to the host's other ranks, and the lane context. The peer is
built from these parts (peer.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Iterable, Sequence

import grpc

from ..algorithms.context import RankContext
from ..algorithms.exchange_plan import SMALL_BYTES
from ..algorithms.jobs import JobTable
from ..algorithms.mailboxes import Mailboxes
from ..control.rendezvous import Rendezvous, RendezvousResult, StoreRendezvous
from ..env import Settings
from ..errors import FerroGrpcError, Identity
from ..failure.policy import FailurePolicy
from ..lifecycle import Lifecycle
from ..observe.observer import Observer
from ..observe.setup import attach as attach_sinks
from ..options import ChunkPolicy
from ..samehost.plane import LocalPlane, host_key
from ..samehost.segment import Spare
from ..samehost.topology import Topology
from ..transport.grpc_streams import HEADER_ROOM, GrpcTransport
from ..transport.streams import Transport
from .allocator import tune_for
from .intake import Intake, Session, credential

# The most joiners a member connects to ahead of their admission.
AHEAD_MAX = 8


def message_limit(policy: ChunkPolicy) -> int:
    """The longest message a peer with ``policy`` sends or accepts over gRPC:
    its largest chunk (the policy resolves the chunk size by world size,
    which may not be known yet: the larger of both) or a small collective's
    message, plus a header. A longer one is refused by gRPC from its length
    prefix, before it is buffered."""
    largest = max(policy.resolve(2)[0], policy.resolve(3)[0], SMALL_BYTES)
    return largest + HEADER_ROOM


@dataclasses.dataclass
class Ahead:
    """What an elastic backend prepares for its next epoch, which takes it:
    a shared segment made ahead (see [Note: a segment made ahead] in
    samehost/segment.py), and channels already connecting to the joiners
    that epoch may admit, by address (see [Note: connecting ahead] in
    transport/grpc_streams.py)."""

    spare: Spare
    channels: dict[str, grpc.aio.Channel] = dataclasses.field(default_factory=dict)
    # The last epoch's peer, closing while this one forms: awaited once the
    # rendezvous is done, before anything of this epoch that the last one's
    # close must precede (its observer's metrics place).
    closing: asyncio.Future[None] | None = None

    # Closes of channels to joiners that no longer wait, running.
    _closing: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)

    def take_channels(self) -> dict[str, grpc.aio.Channel]:
        channels, self.channels = self.channels, {}
        return channels

    def connect(self, transport: GrpcTransport, addresses: Sequence[str]) -> None:
        """On the loop: open channels (at most AHEAD_MAX) to the joiners that
        wait, at ``addresses``, for the epoch that admits them; close those
        to joiners that no longer wait. Measured with ``client.bench
        --elastic`` at 100 MB, three members on the 2-core VM: a member's
        first message to the joiner left 0.9-8.7 ms after it began, against
        5.7-14 ms; the members' pause was 0.088-0.115 s against
        0.086-0.138 (six runs each, alternated)."""
        channels = self.channels
        gone = [channels.pop(a) for a in list(channels) if a not in addresses]
        if gone:
            self._closing.add(asyncio.ensure_future(close_channels(gone)))
            self._closing = {t for t in self._closing if not t.done()}
        for address in addresses[:AHEAD_MAX]:
            if address not in channels:
                channels[address] = transport.channel_ahead(address)

    async def last_closed(self) -> None:
        """Wait for the last epoch's peer to be closed (raises what its
        close raised)."""
        closing, self.closing = self.closing, None
        if closing is not None:
            await closing


async def close_channels(channels: Iterable[grpc.aio.Channel]) -> None:
    for channel in channels:
        await channel.close(None)


@dataclasses.dataclass
class Parts:
    """One rank's connected parts, ready to build a peer from."""

    ctx: RankContext
    jobs: JobTable
    # The peer's lifecycle: JOINING until open() (see [Note: peer lifecycle]).
    life: Lifecycle
    rendezvous: Rendezvous
    address: str
    topology: Topology
    plane: LocalPlane | None
    intake: Intake
    result: RendezvousResult
    linger: float
    # Every rank's credential, by rank (intake.credential).
    credentials: list[str]
    # What this rank saw (observe/): the flight recorder, and any sinks.
    observer: Observer

    def open(self) -> None:
        """JOINING -> OPEN: let incoming streams through, now that the rank
        knows who everyone is."""
        me = self.ctx.identity
        self.life.open(me)
        self.intake.open(
            Session(
                me.rank,
                me.world_size,
                self.credentials,
                self.jobs,
                self.ctx.failure,
                linger=self.linger,
                senders=self.topology.senders_to(me.rank),
            )
        )
        self.ctx.transport.connect(self.result.addresses)

    async def close(self) -> None:
        """Release the parts (CLOSING -> CLOSED; a start that failed closes
        them from JOINING)."""
        self.life.begin_close()
        if self.plane is not None:
            await self.plane.close()
        await self.ctx.transport.close()
        await self.rendezvous.close()
        self.life.end_close()
        self.observer.close()  # once: a start that failed closes it here


async def join(
    s: Settings,
    rank: int | None,
    world_size: int | None,
    rendezvous: Rendezvous | None,
    transport: Transport | None,
    bind_host: str,
    port: int,
    advertise_host: str | None,
    ahead: Ahead | None = None,
) -> Parts:
    """Bind, join the rendezvous and connect the host's shared memory, with
    what ``ahead`` holds (a segment, channels) where it is ready. Releases
    whatever it bound if anything fails (cancellation included)."""
    tune_for(s)
    if transport is None:
        transport = GrpcTransport(
            f"{bind_host}:{port}",
            advertise_host,
            max_message_bytes=message_limit(s.chunk_policy),
            tls=s.tls,
            token=s.token,
            window=s.grpc_window,
            ahead=ahead.take_channels() if ahead is not None else None,
        )
    if rendezvous is None:
        r, w, addr, mport = s.merged(rank=rank, world_size=world_size).require_rendezvous()
        rendezvous = StoreRendezvous(
            r,
            w,
            addr,
            mport,
            s.timeouts.connect,
            agent_store=s.agent_store,
            attempt=s.restart_count,
        )
    life = Lifecycle()
    mailboxes = Mailboxes()
    intake = Intake(mailboxes)
    nonce = secrets.token_hex(16)
    plane = LocalPlane(nonce, ahead.spare if ahead is not None else None) if s.shm else None
    try:
        address = await transport.start(intake)
        result = await rendezvous.exchange(
            rank, world_size, address, nonce, host_key(plane is not None)
        )
        if ahead is not None:
            await ahead.last_closed()
        me = Identity(result.rank, result.world_size, list(result.addresses))
        # What proves a rank from here on: derived from the token, so that the
        # nonces the rendezvous published are not enough.
        credentials = [credential(s.token, n) for n in result.nonces]
        mine = credential(s.token, nonce)
        hosts = result.hosts if len(result.hosts) == me.world_size else []
        topology = Topology.from_keys(hosts or [""] * me.world_size)
        jobs = JobTable(me.world_size)
        observer = Observer(me, s.flight_dir)
        # The metrics port's offset: LOCAL_RANK where a launcher set it (it
        # tells ranks apart even when each is a host of its own, shared
        # memory off), else the rank's place among its host's ranks.
        place = s.local_rank if s.local_rank is not None else topology.local_index(me.rank)
        attach_sinks(observer, s, place)

        def on_break(err: FerroGrpcError) -> None:
            jobs.cancel_all(err)
            observer.broke(err)

        failure = FailurePolicy(
            me,
            transport,
            nonce=mine,
            life=life,
            on_break=on_break,
            name_of=jobs.name_of,
            refusal_of=jobs.refused,
            on_refusal=jobs.note_refusal,
        )
        if plane is not None:
            local = topology.local(me.rank)
            if len(local) > 1:
                await plane.connect(
                    me,
                    local,
                    result.nonces,
                    s.timeouts.connect,
                    failure.from_report,
                    proofs=credentials,
                    proof=mine,
                )
            else:
                await plane.close()
                plane = None
    except BaseException:
        if plane is not None:
            await plane.close()
        await transport.close()
        await rendezvous.close()
        raise
    ctx = RankContext(
        me,
        transport,
        mailboxes,
        failure,
        s.timeouts,
        s.checksum,
        nonce=mine,
        stats=observer.stats,
        packing=s.packing,
    )
    return Parts(
        ctx,
        jobs,
        life,
        rendezvous,
        address,
        topology,
        plane,
        intake,
        result,
        s.timeouts.collective,
        credentials,
        observer,
    )
