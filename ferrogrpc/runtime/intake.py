"""Stream intake: where incoming streams and abort notices enter a rank.

The :class:`Intake` is the transport's :class:`StreamHandler` from the moment
the server listens. Until the rendezvous has told this rank who it is and who
the others are, it holds what arrives (a fast neighbour's first stream);
then it checks every stream's opening message (a descriptor, the group, the
claimed sender's place in the ring and session nonce, a sequence number
still expected) and parks the stream in the :class:`Mailboxes` for the
collective that will consume it. Abort notices are authenticated the same
way and handed to the failure policy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from ..algorithms.jobs import JobTable
from ..algorithms.mailboxes import P2P_KEY, Mailboxes, MailboxKey, copy_refusal
from ..errors import ProtocolError
from ..failure.policy import FailurePolicy
from ..transport import wire
from ..transport.streams import InStream, Replayed
from ..v1 import collective_pb2 as pb

# [Note: the opening message]
# A stream opens with a header carrying a descriptor and the sender's
# credential (about a hundred bytes). A ring's opening also carries its first
# chunk where that is the sender's own data, ready at once (ring.py's
# _send): a separate descriptor would leave the link idle until gRPC
# reported its write done, every collective. The intake judges the header
# alone (only in wire.encode's layout; a header longer than
# FIRST_MESSAGE_MAX is refused unparsed; before the rendezvous, so is a
# first chunk longer than that), then hands the collective a stream whose
# first read returns that message again, to be checked and consumed as its
# first chunk. A received opening is never forwarded as it is (ring.py's
# _consume): it carries the left neighbour's credential.
FIRST_MESSAGE_MAX = 4096


def credential(token: str | None, nonce: str) -> str:
    """What a rank presents to prove it is the rank that published ``nonce``
    at rendezvous: on its streams, links, aborts and same-host hello. With a
    shared token, HMAC-SHA256(token, nonce), so that whoever reads the
    rendezvous store (which holds the nonces) still cannot forge it; without
    one, the nonce itself."""
    if not token:
        return nonce
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class Session:
    """What the rendezvous told this rank, and the parts of it that judge
    incoming streams."""

    rank: int
    world_size: int
    # Each rank's credential (see credential()).
    nonces: Sequence[str]
    jobs: JobTable
    failure: FailurePolicy
    # How long a stream may wait for its collective to consume it.
    linger: float
    # The ranks that may stream to this one (topology.senders_to); empty:
    # the left neighbour in the ring only.
    senders: frozenset[int] = frozenset()


class Intake:
    """The rank's StreamHandler (see the module docstring)."""

    def __init__(self, mailboxes: Mailboxes, group: int = 0) -> None:
        self.mailboxes = mailboxes
        self.group = group
        self._session: asyncio.Future[Session] = asyncio.get_running_loop().create_future()

    def open(self, session: Session) -> None:
        """The rendezvous is done: judge and deliver what arrives."""
        self._session.set_result(session)

    def _verify_nonce(self, s: Session, rank: int, nonce: str, what: str, origin: str) -> None:
        if not s.nonces:
            return  # a group built by hand, without nonces
        expected = s.nonces[rank] if 0 <= rank < len(s.nonces) else ""
        if not hmac.compare_digest(expected.encode(), nonce.encode()):
            raise ProtocolError(
                f"{what} from {origin} claims to be rank {rank} but does not carry rank {rank}'s "
                "session credential; refused"
            )

    async def handle_stream(self, stream: Replayed, origin: str) -> None:
        # Judged before anything else (before the rendezvous is even done):
        # a stream that does not open with a descriptor is refused (see
        # [Note: the opening message]).
        first = await stream.read()
        if not first:
            raise ProtocolError(f"stream from {origin} is empty")
        try:
            header, payload = wire.decode_opening(first, FIRST_MESSAGE_MAX)
        except ProtocolError as exc:
            raise ProtocolError(
                f"stream from {origin} opens with {exc.message}; a stream opens with a descriptor"
            ) from None
        if not header.HasField("descriptor"):
            raise ProtocolError(f"stream from {origin} does not start with a descriptor")
        if payload.nbytes and header.descriptor.kind == pb.LINK:
            raise ProtocolError(f"link from {origin} opens with a payload")
        if payload.nbytes > FIRST_MESSAGE_MAX and not self._session.done():
            # Held until the rendezvous is done, an opening stays as small as
            # a bare one: no collective of any size can have started on
            # another rank yet (each first waits for this one in its ring
            # check), so a first chunk this big comes from no member.
            raise ProtocolError(
                f"stream from {origin} opens with a {payload.nbytes}-byte chunk before this "
                "rank's rendezvous is done; refused"
            )
        if payload.nbytes:
            # Its first chunk came with it: the collective reads it first,
            # and holds it only until then.
            stream.put_back(first)
        del first, payload
        s = await self._session
        if header.group != self.group or header.src_rank >= s.world_size:
            raise ProtocolError(
                f"stream from {origin} claims group {header.group} rank {header.src_rank}; "
                f"this is group {self.group} of {s.world_size} ranks"
            )
        if header.descriptor.kind == pb.LINK:
            await self._link(s, header, stream, origin)
            return
        senders = s.senders or {(s.rank - 1) % s.world_size}
        if header.src_rank not in senders:
            raise ProtocolError(
                f"stream from {origin} claims rank {header.src_rank}, which is not a neighbour "
                "of this rank in any ring"
            )
        self._verify_nonce(s, header.src_rank, header.nonce, "a stream", origin)
        refusal = s.jobs.refused(header.seq)
        if refusal is not None:
            raise copy_refusal(refusal)  # the sender's collective fails with the refusal
        if not s.jobs.expects(header.seq):
            raise ProtocolError(
                f"stream from {origin} for seq {header.seq}, which this rank already finished"
            )
        key = (header.group, header.seq, header.lane, header.src_rank)
        if self.mailboxes.full(key):
            raise ProtocolError(f"too many streams waiting for collectives; refused {origin}")
        box = self.mailboxes.get(key)
        if box.arrived.done():
            raise ProtocolError(
                f"duplicate stream for seq {header.seq} lane {header.lane} from {origin}"
            )
        self.mailboxes.arrived(key, (header, stream))
        try:
            async with asyncio.timeout(s.linger):
                await asyncio.shield(box.done)
        except TimeoutError:
            raise ProtocolError(
                f"stream for seq {header.seq} from rank {header.src_rank} was never consumed: "
                "this rank did not run that collective"
            ) from None
        finally:
            if not box.done.done():
                # The sender went away before we finished reading it.
                box.done.cancel()
            self.mailboxes.drop(key)

    async def _link(self, s: Session, hello: pb.ChunkHeader, stream: InStream, origin: str) -> None:
        """A rank's message link: after its hello, every message is one small
        collective's data, delivered to the mailbox of (seq, sender)."""
        src = hello.src_rank
        if src == s.rank:
            raise ProtocolError(f"link from {origin} claims to be this rank")
        self._verify_nonce(s, src, hello.nonce, "a link", origin)
        while True:
            message = await stream.read()
            if message is None:
                return  # the sender closed it (it is closing)
            header, payload = wire.decode(message)
            if header.src_rank != src or header.group != self.group:
                raise ProtocolError(f"link from rank {src} carried a message claiming otherwise")
            key: MailboxKey
            if header.kind == pb.P2P:
                key = (P2P_KEY, header.step, header.seq, header.lane, src)
            elif s.jobs.refused(header.seq) is not None:
                continue  # for a collective some rank refused: nobody will consume it
            elif not s.jobs.expects(header.seq):
                raise ProtocolError(
                    f"link message from rank {src} for seq {header.seq}, which this rank "
                    "already finished"
                )
            else:
                key = (header.group, header.seq, header.lane, src)
            if self.mailboxes.full(key):
                raise ProtocolError(f"too many messages waiting for collectives; refused {origin}")
            box = self.mailboxes.get(key)
            if box.arrived.done():
                raise ProtocolError(
                    f"duplicate message for seq {header.seq} part {header.lane} from rank {src}"
                )
            self.mailboxes.arrived(key, (header, payload))

    async def handle_abort(self, message: bytes) -> None:
        s = await self._session
        try:
            abort = pb.Abort.FromString(message)
        except DecodeError as exc:
            raise ProtocolError(f"undecodable abort message: {exc}") from exc
        if abort.from_rank >= s.world_size or abort.from_rank == s.rank:
            raise ProtocolError(f"abort from unknown rank {abort.from_rank}")
        self._verify_nonce(s, abort.from_rank, abort.nonce, "an abort", f"rank {abort.from_rank}")
        s.failure.receive(abort)
