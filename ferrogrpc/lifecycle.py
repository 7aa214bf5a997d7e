"""The peer's lifecycle: one state, held here, that every part of a rank
reads (see [Note: peer lifecycle])."""

from __future__ import annotations

import enum
import threading

from .errors import ConfigError, FerroGrpcError, Identity


class PeerState(enum.Enum):
    """[Note: peer lifecycle]

    ::

        JOINING ──open()──> OPEN ──break_with()──> BROKEN
           │                  │                      │
           └──────────────────┴──begin_close()──> CLOSING ──end_close()──> CLOSED

    - ``JOINING``: the transport is bound and serving, the rendezvous has not
      finished. The stream intake holds what arrives (a fast neighbour's
      first stream) until the rank knows who everyone is.
    - ``OPEN``: every rank is known (``open()``, when the joined parts are
      opened); collectives run.
    - ``BROKEN``: a collective failed (the failure policy's ``declare``).
      Every later call raises at once with the cause, chained to it;
      ``close()`` still works. A refusal is not a break.
    - ``CLOSING``: ``close()`` began (on the peer, or on its Backend from
      any thread). Every call raises "closed" from here on; running
      collectives are being stopped.
    - ``CLOSED``: everything is released. Terminal.

    The cause of a break is kept through ``CLOSING`` and ``CLOSED``.
    """

    JOINING = "joining"
    OPEN = "open"
    BROKEN = "broken"
    CLOSING = "closing"
    CLOSED = "closed"


class Lifecycle:
    """The state of one rank's peer (see [Note: peer lifecycle]).
    Transitions are thread-safe: a Backend closes from the caller's thread
    while the loop may be declaring a failure."""

    def __init__(self, identity: Identity | None = None) -> None:
        self._lock = threading.Lock()
        self.state = PeerState.JOINING
        # Who this rank is, once known (errors name it).
        self.identity = identity
        # The failure that broke the rank: the first one declared.
        self.cause: FerroGrpcError | None = None

    def open(self, identity: Identity) -> None:
        """JOINING -> OPEN: the rendezvous told this rank who everyone is."""
        with self._lock:
            self.identity = identity
            if self.state is PeerState.JOINING:
                self.state = PeerState.OPEN

    def break_with(self, err: FerroGrpcError) -> bool:
        """OPEN -> BROKEN with ``err``; False if a cause was already set (only
        the first failure counts). A rank closing keeps its state, but the
        cause is still recorded."""
        with self._lock:
            if self.cause is not None:
                return False
            self.cause = err
            if self.state in (PeerState.JOINING, PeerState.OPEN):
                self.state = PeerState.BROKEN
            return True

    def begin_close(self) -> bool:
        """Any state -> CLOSING; True for the first caller only, who then
        releases everything and calls :meth:`end_close`."""
        with self._lock:
            if self.state in (PeerState.CLOSING, PeerState.CLOSED):
                return False
            self.state = PeerState.CLOSING
            return True

    def end_close(self) -> None:
        """CLOSING -> CLOSED: everything is released."""
        with self._lock:
            self.state = PeerState.CLOSED

    @property
    def closing(self) -> bool:
        """Whether ``close()`` has begun (calls are refused)."""
        return self.state in (PeerState.CLOSING, PeerState.CLOSED)

    @property
    def broken(self) -> FerroGrpcError | None:
        """The failure that broke this rank, or None."""
        return self.cause

    def check(self) -> None:
        """Raise if this rank can run no more collectives: closed, or broken
        (chained to the original cause)."""
        me = self.identity or Identity(0, 1)
        if self.closing:
            raise me.error(ConfigError, "this peer is closed")
        broken = self.cause
        if broken is not None:
            raise me.error(
                type(broken),
                f"the group is broken by an earlier failure: {broken}",
                peer=broken.peer,
            ) from broken
