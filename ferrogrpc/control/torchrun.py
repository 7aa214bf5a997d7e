"""torchrun's ``ferrogrpc`` rendezvous: ``torchrun --rdzv-backend=ferrogrpc
--rdzv-endpoint=HOST:PORT`` supervises the processes while a ferrogrpc
coordinator at HOST:PORT holds the membership (see [Note: two restart
rules]). Registered through the ``torchrun.handlers`` entry point.

[Note: two restart rules]
torchrun's agent restarts its node's workers for two reasons:

1. one of them failed: counted against ``--max-restarts``;
2. they are healthy, and ``num_nodes_waiting()`` says that nodes wait: not
   counted. torchrun's own rendezvous can only admit a node by forming the
   whole worker group again, so every agent restarts every worker.

Our coordinator admits processes one at a time, live, at a step boundary,
and it counts processes, not nodes. So the two rules are kept apart:

- ``num_nodes_waiting()`` is always 0. A new node's agent starts its
  workers at once, and they join at the members' next boundary. No running
  agent is ever told that it has a reason to restart.
- ``next_rendezvous()`` is this node's alone: rank 0 of a group of one, with
  a store of its own. It waits for nothing but the coordinator's answer. Rule
  1 then restarts this node's workers only. Elsewhere the survivors drop the
  lost ranks and go on (a RECOVER), and the restarted workers join at the
  next boundary (a GROW).
- The group's bounds come from ``--nnodes=MIN:MAX``: the workers read it
  from their environment, as MIN (and MAX) nodes of ``LOCAL_WORLD_SIZE``
  processes each. The coordinator enforces them; the agents do not.
- Below the minimum, the workers raise ``QuorumLostError`` and exit non-zero.
  Rule 1 would restart them into a group that is over: a new group, without
  the state. So every ``next_rendezvous()`` after the first asks the
  coordinator, and raises ``RendezvousClosedError`` once this node's group
  has ended. The agent stops, and torchrun exits non-zero.
- A node whose worker dies restarts all of its workers: until they are back,
  they are absent from the group. At exactly MIN nodes, that absence is
  below the quorum. To ride a local restart through, run a node above the
  minimum, or set ``FERROGRPC_MIN_WORLD_SIZE`` lower.

The handler never starts a coordinator. One started inside an agent would
die with that node. Two agents that each found none would start two, and so
two groups. Run ``ferrogrpc coordinator`` beside the job (docs/recipes/).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, MutableMapping

import grpc
from torch.distributed import HashStore  # type: ignore[attr-defined]  # (public, not re-exported in the stubs)
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ..env import (
    ADVERTISE_HOST_ENV,
    BIND_HOST_ENV,
    COORDINATOR_ENV,
    ELASTIC_ENV,
    TORCHRUN_NNODES_ENV,
    Settings,
)
from ..transport.auth import sync_channel, token_metadata
from ..v1 import rendezvous_pb2 as rpb
from .coordinator_client import SERVICE

logger = logging.getLogger("ferrogrpc.torchrun")

BACKEND = "ferrogrpc"
# torchrun's own default rendezvous port (its c10d backend's), for an
# endpoint given without one.
DEFAULT_PORT = 29400
# How long the first rendezvous waits for a coordinator to answer (the
# ``join_timeout`` of --rdzv-conf), as torchrun's c10d rendezvous does.
DEFAULT_JOIN_TIMEOUT_S = 600.0
# How often an unanswered coordinator is asked again.
RETRY_S = 0.5


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``HOST`` (port 29400). ValueError if
    it is none of these."""
    text = endpoint.strip()
    if not text:
        raise ValueError(
            "--rdzv-endpoint is empty: the ferrogrpc rendezvous needs the coordinator's "
            "HOST:PORT (`ferrogrpc coordinator --world-size 0 --port PORT`)"
        )
    host, port = text, DEFAULT_PORT
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), endpoint)
    elif text.count(":") == 1:
        host, _, raw = text.partition(":")
        port = _port(raw, endpoint)
    if not host:
        raise ValueError(f"--rdzv-endpoint {endpoint!r} has no host")
    return host, port


def _port(raw: str, endpoint: str) -> int:
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: {raw!r} is not a port") from None
    if not 0 < port < 65536:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: port {port} is out of range")
    return port


class FerroGrpcRendezvousHandler(RendezvousHandler):
    """torchrun's rendezvous, backed by a ferrogrpc coordinator (see [Note:
    two restart rules]).

    Created in torchrun's agent process, it exports to the workers (through
    the agent's environment, which each worker inherits):
    ``FERROGRPC_COORDINATOR`` (the endpoint), ``FERROGRPC_ELASTIC=1``,
    ``FERROGRPC_TORCHRUN_NNODES`` (``--nnodes``) and, with ``--local-addr``,
    ``FERROGRPC_ADVERTISE_HOST`` and ``FERROGRPC_BIND_HOST`` (unless set).
    So ``fg.init_backend(elastic=True)`` needs no argument. torchrun's
    ``RANK`` and ``WORLD_SIZE`` then describe this node only: a worker's
    rank in the group is ``backend.rank``, given by the coordinator.

    Raises (from ``next_rendezvous``):
        RendezvousTimeoutError: no coordinator answered within
            ``join_timeout`` (``--rdzv-conf join_timeout=S``, default 600).
        RendezvousConnectionError: the coordinator refused this agent (a
            token or TLS mismatch).
        RendezvousClosedError: this node's group ended (quorum lost, or
            every member left) before a restart of its workers.
    """

    def __init__(
        self,
        params: RendezvousParameters,
        *,
        environ: MutableMapping[str, str] | None = None,
    ) -> None:
        self._host, self._port = parse_endpoint(params.endpoint)
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.target = f"{host}:{self._port}"
        self._run_id = params.run_id
        self._join_timeout = float(params.get("join_timeout", DEFAULT_JOIN_TIMEOUT_S))
        environ = os.environ if environ is None else environ
        self._settings = Settings.from_env(environ)
        self._closed = False
        self._rounds = 0
        self._export(environ, params)

    def _export(self, environ: MutableMapping[str, str], params: RendezvousParameters) -> None:
        """What the workers read (the agent passes its environment on)."""
        given = environ.get(COORDINATOR_ENV)
        if given and given != self.target:
            logger.warning(
                "%s=%s is replaced by torchrun's --rdzv-endpoint %s",
                COORDINATOR_ENV,
                given,
                self.target,
            )
        environ[COORDINATOR_ENV] = self.target
        environ[ELASTIC_ENV] = "1"
        environ[TORCHRUN_NNODES_ENV] = f"{params.min_nodes}:{params.max_nodes}"
        if params.local_addr:
            environ.setdefault(ADVERTISE_HOST_ENV, params.local_addr)
            environ.setdefault(BIND_HOST_ENV, params.local_addr)

    # ------------------------------------------------- RendezvousHandler

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers rendezvous through the coordinator

    def next_rendezvous(self) -> RendezvousInfo:
        """This node's rendezvous: once the coordinator answers, rank 0 of
        a group of one (see [Note: two restart rules]). After the first
        call (torchrun restarts this node's workers), closed if the group
        ended meanwhile."""
        if self._closed:
            raise RendezvousClosedError(f"the ferrogrpc rendezvous at {self.target} is closed")
        status = self._reach()
        if self._rounds and not status.epoch and status.ended:
            self._closed = True
            raise RendezvousClosedError(
                f"the elastic group at {self.target} is over ({status.ended}): this node's "
                "workers are not restarted into it"
            )
        self._rounds += 1
        logger.info(
            "ferrogrpc rendezvous %d at %s: the coordinator answers (epoch %d); the "
            "workers join its group",
            self._rounds,
            self.target,
            status.epoch,
        )
        return RendezvousInfo(
            HashStore(), 0, 1, RendezvousStoreInfo(master_addr=self._host, master_port=self._port)
        )

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # new nodes join live: never a reason to restart (the Note)

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True  # nothing held: the store is this agent's, in memory

    # ------------------------------------------------------ coordinator

    def _reach(self) -> rpb.StatusResponse:
        """The coordinator's status, once it answers (it may start after
        the agents, or be restarting)."""
        deadline = time.monotonic() + self._join_timeout
        s = self._settings
        metadata = token_metadata(s.token)
        last = ""
        while True:
            left = deadline - time.monotonic()
            with sync_channel(self.target, s.tls) as channel:
                status = channel.unary_unary(
                    f"/{SERVICE}/Status",
                    request_serializer=rpb.StatusRequest.SerializeToString,
                    response_deserializer=rpb.StatusResponse.FromString,
                )
                try:
                    response: rpb.StatusResponse = status(
                        rpb.StatusRequest(),
                        timeout=max(0.1, min(5.0, left)),
                        metadata=metadata,
                        wait_for_ready=True,
                    )
                    return response
                except grpc.RpcError as exc:
                    code = exc.code() if isinstance(exc, grpc.Call) else None
                    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                    if code not in (
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    ):
                        raise RendezvousConnectionError(
                            f"the ferrogrpc coordinator at {self.target} refused this agent: "
                            f"{code.name if code else ''} {details} (FERROGRPC_TOKEN and "
                            "FERROGRPC_TLS_* must match the coordinator's)"
                        ) from exc
                    last = f"{code.name} {details}"
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(
                    f"no ferrogrpc coordinator answered at {self.target} within "
                    f"{self._join_timeout:g}s ({last}): start one with `ferrogrpc coordinator "
                    f"--world-size 0 --port {self._port}`, or name it in --rdzv-endpoint"
                )
            time.sleep(RETRY_S)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler for ``--rdzv-backend=ferrogrpc`` (torch's registry calls
    it with the launch's parameters)."""
    return FerroGrpcRendezvousHandler(params)


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch loads it, calls it, and
    registers what it returns under the entry point's name."""
    return create_handler
