"""Algorithms: how one collective runs on one rank (ring, one exchange, direct
sockets, shared-memory rounds, two levels, point to point), and the records
and context they share."""
