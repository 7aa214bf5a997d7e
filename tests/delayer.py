"""The tests' delayer of slow and lossy links: client/delayer.py, which
``ferrogrpc bench --link`` uses too (an NFQUEUE delayer: this kernel has no
netem)."""

from __future__ import annotations

from client.delayer import delaying as delaying
from client.delayer import is_syn as is_syn
