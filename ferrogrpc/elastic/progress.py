"""ElasticBackend's guard against a livelock: a group whose members keep
changing epoch without ever completing a step is not converging (they
disagree on where they are), and a further change will not mend it; a
member then raises, naming it, rather than change again."""

from __future__ import annotations

from ..errors import FerroGrpcError, ProtocolError

# Epoch changes in a row, none followed by a completed step, after which a
# member raises rather than change again: such a group is not converging
# (its members disagree on where they are), and no further change mends it.
FRUITLESS_CHANGES = 50


class Progress:
    """This process's epoch changes since its last completed step (a
    committed sync, or a boundary passed): ElasticBackend's guard against
    a livelock, which it turns into an error naming it."""

    def __init__(self) -> None:
        self.changes = 0

    def made(self) -> None:
        self.changes = 0

    def changed(self, cause: FerroGrpcError | None, rank: int) -> None:
        self.changes += 1
        if self.changes > FRUITLESS_CHANGES:
            raise ProtocolError(
                f"the elastic group changed epoch {FRUITLESS_CHANGES} times in a row without "
                f"completing a step: its members do not agree on where they are (the last "
                f"failure: {cause}). This is a defect of ferrogrpc's; please report it with "
                "every rank's flight record (FERROGRPC_FLIGHT_DIR)",
                rank=rank,
                op="recover",
            )
