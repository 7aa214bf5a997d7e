"""Where grpc errors become ferrogrpc errors, both ways: a failed RPC's
status as the error a user sees (:func:`translate`), and a receiver's
failure as the status or lane answer that carries it to the sender
(:func:`abort_with`, :func:`reply_for`, read back by :func:`replied`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from ..errors import ERROR_CLASSES, Evidence, FerroGrpcError, PeerError, ProtocolError
from ..v1 import collective_pb2 as pb

ERROR_KEY = "ferrogrpc-error"
CULPRIT_KEY = "ferrogrpc-culprit"
# Present, as "refused", when the error is another rank's refusal of the
# collective (errors.Evidence.REFUSED).
EVIDENCE_KEY = "ferrogrpc-evidence"


def translate(exc: BaseException, dst: int, address: str, what: str) -> FerroGrpcError:
    """Translate a failed RPC into the error a user sees."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        details = exc.details() or ""
        trailing: dict[str, str] = {}
        pairs = cast(Sequence[tuple[str, Any]], exc.trailing_metadata() or ())
        for key, value in pairs:
            trailing[str(key)] = str(value)
        reported = ERROR_CLASSES.get(trailing.get(ERROR_KEY, ""))
        if reported is not None and trailing.get(EVIDENCE_KEY) == Evidence.REFUSED.value:
            # Some rank refused the collective; ``details`` names it.
            culprit = int(trailing.get(CULPRIT_KEY, -1))
            return reported(
                details, peer=culprit if culprit >= 0 else None, evidence=Evidence.REFUSED
            )
        if reported is not None:
            # The receiver failed the stream on purpose and said why.
            culprit = int(trailing.get(CULPRIT_KEY, dst))
            return reported(
                f"rank {dst} reported: {details}",
                peer=culprit if culprit >= 0 else None,
                peer_address=address if culprit == dst else None,
                evidence=Evidence.RELAYED,
            )
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ProtocolError(details, peer=dst, peer_address=address)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return PeerError(
                f"{what}: rank {dst} refused our credentials: {details}",
                peer=dst,
                peer_address=address,
            )
        if code == grpc.StatusCode.ABORTED:
            return PeerError(details, peer=dst, peer_address=address)
        evidence = Evidence.FOUND
        if code == grpc.StatusCode.UNAVAILABLE:
            evidence = Evidence.UNREACHABLE
        elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED):
            # grpc reports a write that raced with the receiver failing the
            # stream as a local INTERNAL error, and hides the receiver's
            # status; the receiver's abort message is then the better account
            # of the cause.
            evidence = Evidence.SYMPTOM
        return PeerError(
            f"{what}: rank {dst} at {address} failed ({code.name}: {details})",
            peer=dst,
            peer_address=address,
            evidence=evidence,
        )
    return PeerError(f"{what}: rank {dst} at {address}: {exc!r}", peer=dst, peer_address=address)


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], exc: FerroGrpcError) -> None:
    """Fail an RPC with ``exc``: its class and culprit travel as trailing
    metadata, so the sender raises the same kind of error about the same rank."""
    code = (
        grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(exc, ProtocolError)
        else grpc.StatusCode.ABORTED
    )
    metadata = [
        (ERROR_KEY, type(exc).__name__),
        (CULPRIT_KEY, str(exc.peer if exc.peer is not None else -1)),
    ]
    details = str(exc)
    if exc.evidence is Evidence.REFUSED:
        metadata.append((EVIDENCE_KEY, Evidence.REFUSED.value))
        details = exc.message
    context.set_trailing_metadata(tuple(metadata))
    await context.abort(code, details)


def detached(exc: FerroGrpcError) -> FerroGrpcError:
    """``exc`` as a new error with the same class, text, culprit and
    evidence, but no traceback, cause or context (nothing that references
    the frames it was raised through)."""
    message = exc.message if exc.evidence is Evidence.REFUSED else str(exc)
    return type(exc)(message, peer=exc.peer, evidence=exc.evidence)


def reply_for(exc: FerroGrpcError) -> bytes:
    """A lane's answer failing a stream with ``exc`` (see abort_with)."""
    refused = exc.evidence is Evidence.REFUSED
    return pb.Abort(
        error=type(exc).__name__,
        message=exc.message if refused else str(exc),
        culprit=exc.peer if exc.peer is not None else -1,
        refused=refused,
    ).SerializeToString()


def replied(reply: bytes, dst: int, address: str) -> FerroGrpcError:
    """The error a lane's answer ``reply`` fails a stream with, as
    :func:`translate` makes it of a failed RPC's status."""
    try:
        abort = pb.Abort.FromString(reply)
    except DecodeError:
        return ProtocolError(f"rank {dst} answered a stream with garbage", peer=dst)
    reported = ERROR_CLASSES.get(abort.error, PeerError)
    culprit = abort.culprit if abort.culprit >= 0 else None
    if abort.refused:
        return reported(abort.message, peer=culprit, evidence=Evidence.REFUSED)
    return reported(
        f"rank {dst} reported: {abort.message}",
        peer=culprit,
        peer_address=address if culprit == dst else None,
        evidence=Evidence.RELAYED,
    )
