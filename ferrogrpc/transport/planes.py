"""Lossless packing of float32 chunks for links slower than the CPU.

A float32's top byte (its sign and the exponent's upper seven bits) is far
from random in training data: gradients, activations and parameters span a
few dozen exponents. The packed payload is that byte plane deflated (raw
deflate, ISA-L's level 1), followed by the three low byte planes as they
are::

    [ deflate(byte 3 of every element) | bytes 0-2 of element 0 | of 1 | ... ]

On ``torch.randn`` data the top plane deflates to 0.42 of its size, so a
chunk's payload is 0.855 of float32's (real gradients: 0.85): 14% fewer
bytes on the wire, for about 5 ns of CPU per element packed and 4 ns
unpacked (1.3 and 1.1 ms per MiB of float32, one core of this project's
machine). Where the link outruns the CPU (loopback, 10 Gbit/s on two
cores) that is a loss; so the ring packs only where its writes show the
link is the bottleneck (see :class:`LinkGauge`). Unpacking restores every
bit: reductions see the same float32 values, and so the results are
bit-identical to unpacked ones.

The header carries the deflated plane's length (``packed_top``); the rest
of the payload is three bytes an element. A payload that does not
decompress to exactly one byte an element is a ProtocolError.
"""

from __future__ import annotations

import time
import types
import zlib

import torch

_deflate: types.ModuleType
try:
    from isal import isal_zlib as _deflate
except ImportError:  # (platforms without ISA-L: stdlib zlib, 4-5x slower)
    _deflate = zlib

# Raw deflate: no zlib header and no Adler-32 (the chunk has its own checksum).
_WBITS = -15
_LEVEL = 1

# Chunks of fewer elements (1 MiB of float32) go as they are: they belong
# to collectives too small to be bound by the link's rate, where packing
# and unpacking add to every chunk's latency and save little (a 4 MiB
# all_reduce at world 4 over 1 Gbit/s, in 256 KiB chunks: 0.81x gloo
# packed, 0.94x not).
MIN_ELEMS = 1 << 18


def top_plane(data: torch.Tensor) -> bytes:
    """The deflated top byte plane of a contiguous float32 tensor."""
    planes = data.view(torch.uint8).view(-1, 4)
    top = planes[:, 3].contiguous()
    packed: bytes = _deflate.compress(top.numpy().data, _LEVEL, _WBITS)
    return packed


def write_low(data: torch.Tensor, into: torch.Tensor) -> None:
    """Bytes 0-2 of every element of ``data`` into the uint8 tensor ``into``
    (3 bytes an element)."""
    planes = data.view(torch.uint8).view(-1, 4)
    into.view(-1, 3).copy_(planes[:, :3])


def unpack(payload: memoryview, top_len: int, out: torch.Tensor) -> None:
    """Restore a packed payload into the float32 tensor ``out`` (its length
    is the chunk's). Raises ValueError if the payload is not a packing of
    ``out.numel()`` elements."""
    n = out.numel()
    if top_len < 0 or payload.nbytes != top_len + 3 * n:
        raise ValueError(
            f"a packed payload of {payload.nbytes} bytes with a {top_len}-byte top plane "
            f"does not hold {n} elements"
        )
    # At most n + 1 bytes are inflated: a plane that would inflate to more
    # (by up to 1032 times its size) is refused without inflating it all.
    inflater = _deflate.decompressobj(_WBITS)
    try:
        top = inflater.decompress(payload[:top_len], n + 1)
    except (zlib.error, _deflate.error) as exc:
        raise ValueError(f"its top plane does not inflate: {exc}") from exc
    if len(top) != n or not inflater.eof or inflater.unconsumed_tail:
        raise ValueError(f"its top plane does not inflate to exactly {n} bytes")
    planes = out.view(torch.uint8).view(n, 4)
    planes[:, 3].copy_(torch.frombuffer(top, dtype=torch.uint8))
    planes[:, :3].copy_(torch.frombuffer(payload[top_len:], dtype=torch.uint8).view(n, 3))


class LinkGauge:
    """Whether to pack the chunks of one link (to one peer): modes "on"
    and "off" say always and never; mode "auto" packs while the link is
    slower than ``SLOWER_THAN`` times this process's packing rate (the best
    seen: see :func:`packing_rate`).

    The link's rate is what its chunk writes were held to. A write the
    transport takes at once (into its window) says nothing of the link and
    is not counted (a write faster than packing); one that waits was paced
    by the link, or by a receiver that reads late. The rate is the bytes of
    the counted writes over the time they took, each one's weight decaying
    by ``DECAY`` a write.

    Why a quarter: a packed byte costs CPU twice (packing here, unpacking
    on the receiver), on top of the gRPC path's own cost. On this project's
    2-core machine (one core a rank) packing gains 15% at 1 Gbit/s and
    loses 6% at 2 Gbit/s; it packs about 775 MB/s there, so a quarter
    (about 195 MB/s, 1.5 Gbit/s) takes the first (its writes run at
    117-140 MB/s) and not the second (250 MB/s), with room for noise. A
    fast link whose receivers are short of CPU also makes writes wait, but
    far less: at 10 Gbit/s beside two CPU burners they ran at 480 MB/s
    (docs/benchmarks-history.md, "Packed chunks").
    """

    SLOWER_THAN = 0.25
    DECAY = 0.9

    __slots__ = ("_bytes", "_seconds", "mode", "packing", "switches")

    def __init__(self, mode: str = "auto") -> None:
        self.mode = mode
        self._bytes = 0.0
        self._seconds = 0.0
        self.packing = False  # its last answer
        self.switches = 0  # how often its answer changed

    def link_rate(self) -> float:
        """The link's bytes per second, as the writes that waited saw it
        (0: none yet)."""
        return self._bytes / self._seconds if self._seconds > 0.0 else 0.0

    def packs(self) -> bool:
        """Whether the next chunk goes packed."""
        if self.mode != "auto":
            packing = self.mode == "on"
        else:
            packing = 0.0 < self.link_rate() < self.SLOWER_THAN * packing_rate()
        if packing != self.packing:
            self.packing = packing
            self.switches += 1
        return packing

    def wrote(self, nbytes: int, seconds: float) -> None:
        """A chunk write of ``nbytes`` took ``seconds``."""
        if self.mode != "auto" or nbytes >= seconds * packing_rate():
            return  # (taken at once: into the transport's window)
        self._bytes = self.DECAY * self._bytes + nbytes
        self._seconds = self.DECAY * self._seconds + seconds


_rate: float = 0.0
_measured_at = 0.0  # time.monotonic() of the last measurement
# How often the rate is measured again (one packing of 1 MiB, about 1.3 ms):
# a process that calibrated while its core was busy (every rank of a job
# starts at once, beside its data loading) would otherwise hold a rate
# several times too low for its whole run, and never pack a link it should.
REMEASURE_S = 20.0


def _measure(attempts: int) -> float:
    """Bytes of float32 a second: the best of ``attempts`` packings of
    1 MiB of normal values, after one to warm up."""
    sample = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    low = torch.empty(3 * sample.numel(), dtype=torch.uint8)
    best = float("inf")
    for attempt in range(attempts + 1):
        began = time.perf_counter()
        top_plane(sample)
        write_low(sample, low)
        if attempt:
            best = min(best, time.perf_counter() - began)
    return 4 * sample.numel() / max(best, 1e-6)


def packing_rate() -> float:
    """Bytes of float32 this process packs a second: the best of nine
    packings of 1 MiB of normal values on the first call, raised since by
    any faster packing of a chunk, and by one packing of 1 MiB every
    ``REMEASURE_S`` seconds at most. The best, because a rank starts beside
    others (every rank of a job calibrates at once) and whatever shares its
    core slows a packing: the gauge wants what packing costs, not what it
    cost that moment."""
    global _rate, _measured_at
    now = time.monotonic()
    if _rate == 0.0 or now - _measured_at > REMEASURE_S:
        _rate = max(_rate, _measure(9 if _rate == 0.0 else 1))
        _measured_at = now
    return _rate


def saw_packing(elems: int, seconds: float) -> None:
    """Packing ``elems`` elements took ``seconds``."""
    global _rate
    if seconds > 0.0:
        _rate = max(_rate, 4 * elems / seconds)
