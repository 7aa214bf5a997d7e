"""Compressed collectives: ``wire_dtype`` sends bf16/fp16 over gRPC while
every hop accumulates in the tensor's own dtype. The result is within the
documented bound of the exact float64 sum, rounded the same on every rank,
and the bytes on the wire really are halved. Plus ``all_reduce_coalesced``."""

from __future__ import annotations

import asyncio

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.algorithms import ring as lane

pytestmark = pytest.mark.timeout(120)

# Unit roundoff of the wire dtype (half an ulp at 1): bf16 keeps 8
# significant bits, fp16 11.
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def bound(inputs: list[torch.Tensor], wire: torch.dtype) -> torch.Tensor:
    """The README's bound: |result - exact| <= W * u * sum_i |x_i|, elementwise
    (each of the W-1 partial sums sent is rounded once, and so is the result),
    plus float32's own rounding."""
    world = len(inputs)
    magnitude = torch.stack([t.double().abs() for t in inputs]).sum(0)
    return world * UNIT[wire] * magnitude + 1e-6 * magnitude


@pytest.mark.parametrize("numel", [1000, 1 << 17])  # one exchange; rings
@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 3, 4])
async def test_all_reduce_in_a_wire_dtype_is_within_its_bound(
    world: int, wire: torch.dtype, numel: int
) -> None:
    gen = torch.Generator().manual_seed(world * 7 + numel)
    inputs = [torch.randn(numel, generator=gen) * 3 for _ in range(world)]
    async with fg.testing.local_group(world, transport="grpc") as peers:
        exact = [t.clone() for t in inputs]
        await asyncio.gather(*(p.all_reduce(t) for p, t in zip(peers, exact, strict=True)))
        sent_before = fg.testing.stats(peers[0]).bytes_sent
        tensors = [t.clone() for t in inputs]
        await asyncio.gather(
            *(p.all_reduce(t, wire_dtype=wire) for p, t in zip(peers, tensors, strict=True))
        )
        sent = fg.testing.stats(peers[0]).bytes_sent - sent_before
    reference = torch.stack([t.double() for t in inputs]).sum(0)
    err = (tensors[0].double() - reference).abs()
    assert bool((err <= bound(inputs, wire)).all()), float((err - bound(inputs, wire)).max())
    # Really sent in the wire dtype: the error is not zero (a float32
    # transfer would be exact here); a ring rounds its result to the wire
    # dtype (one exchange sums the rounded contributions in float32).
    assert float(err.max()) > 0
    if numel > 1000:
        assert torch.equal(tensors[0], tensors[0].to(wire).float())
    for t in tensors[1:]:
        assert torch.equal(t, tensors[0])  # the same bits on every rank
    # Half the bytes of float32 on the wire.
    exact_bytes = numel * 4 * (2 * (world - 1) / world if numel > 1000 else world - 1)
    assert sent <= 0.55 * exact_bytes + 4096, (sent, exact_bytes)


async def test_a_ring_rounds_alike_whether_or_not_it_holds_forwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A finished segment is rounded to the wire dtype straight into the
    # message that forwards it when the lane holds forwards, and through a
    # scratch buffer when it does not: the same bits either way, on every rank.
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1 << 17, generator=gen) for _ in range(3)]
    results = []
    for held in (lane.HELD_MESSAGES, 0):
        monkeypatch.setattr(lane, "HELD_MESSAGES", held)
        tensors = [t.clone() for t in inputs]
        async with fg.testing.local_group(3, transport="grpc") as peers:
            await asyncio.gather(
                *(
                    p.all_reduce(t, wire_dtype=torch.bfloat16)
                    for p, t in zip(peers, tensors, strict=True)
                )
            )
        assert all(torch.equal(t, tensors[0]) for t in tensors), held
        assert torch.equal(tensors[0], tensors[0].bfloat16().float()), held
        results.append(tensors[0])
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("transport", ["grpc", "memory", "shm"])
async def test_reduce_scatter_and_all_gather_in_a_wire_dtype(transport: str) -> None:
    world, n = 3, 3 * (1 << 16)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(n, generator=gen) for _ in range(world)]
    async with fg.testing.local_group(world, transport=transport) as peers:  # type: ignore[arg-type]
        parts = await asyncio.gather(
            *(
                p.reduce_scatter(t, wire_dtype=torch.bfloat16)
                for p, t in zip(peers, inputs, strict=True)
            )
        )
        lists = await asyncio.gather(
            *(
                p.all_gather(t, wire_dtype=torch.bfloat16)
                for p, t in zip(peers, inputs, strict=True)
            )
        )
    reference = torch.stack([t.double() for t in inputs]).sum(0)
    limit = bound(inputs, torch.bfloat16)
    for r, part in enumerate(parts):
        lo = r * (n // world)
        err = (part.double() - reference[lo : lo + n // world]).abs()
        assert bool((err <= limit[lo : lo + n // world]).all())
    for got in lists:
        for r in range(world):
            expected = inputs[r] if transport == "shm" else inputs[r].to(torch.bfloat16).float()
            assert torch.equal(got[r], expected), (transport, r)  # same on every rank


async def test_wire_dtype_is_checked() -> None:
    async with fg.testing.local_group(2, transport="memory") as peers:
        # A refused call is still a collective: the other rank's matching call
        # fails at once, naming the rank and why (issue 17).
        with pytest.raises(fg.ConfigError, match="narrows float32 and float64"):
            peers[0].all_reduce(torch.ones(4, dtype=torch.int32), wire_dtype=torch.bfloat16)
        with pytest.raises(fg.ConfigError, match=r"rank 0.*narrows float32 and float64"):
            await asyncio.wait_for(peers[1].all_reduce(torch.ones(4, dtype=torch.int32)), 10)
        with pytest.raises(fg.ConfigError, match=r"bfloat16 or torch\.float16"):
            peers[0].all_reduce(torch.ones(4), wire_dtype=torch.int16)
        with pytest.raises(fg.ConfigError, match=r"rank 0.*bfloat16 or torch\.float16"):
            await asyncio.wait_for(peers[1].all_reduce(torch.ones(4)), 10)
        with pytest.raises(fg.ConfigError, match=r"int8 is all_reduce's only"):
            peers[0].all_gather(torch.ones(4), wire_dtype=torch.int8)
        with pytest.raises(fg.ConfigError, match=r"rank 0.*int8 is all_reduce's only"):
            await asyncio.wait_for(peers[1].all_gather(torch.ones(4)), 10)
        with pytest.raises(fg.ConfigError, match=r"int4 is all_reduce's only"):
            peers[0].reduce_scatter(torch.ones(4), wire_dtype=torch.int4)
        with pytest.raises(fg.ConfigError, match=r"rank 0.*int4 is all_reduce's only"):
            await asyncio.wait_for(peers[1].reduce_scatter(torch.ones(4)), 10)
        # Ranks that disagree on the wire dtype are told so.
        results = await asyncio.gather(
            peers[0].all_reduce(torch.ones(1 << 17), wire_dtype=torch.bfloat16),
            peers[1].all_reduce(torch.ones(1 << 17)),
            return_exceptions=True,
        )
        assert all(isinstance(r, fg.ProtocolError) for r in results), results
        assert "wire_dtype" in str(results[0]), results


@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_all_reduce_coalesced_is_one_collective_per_dtype(transport: str) -> None:
    world = 3
    shapes = [(3,), (2, 5), (), (7,)]
    async with fg.testing.local_group(world, transport=transport) as peers:  # type: ignore[arg-type]
        inputs = [
            [torch.full(s, float(r + i)) for i, s in enumerate(shapes)]
            + [torch.full((4,), r + 1, dtype=torch.int64)]
            for r in range(world)
        ]
        tensors = [[t.clone() for t in row] for row in inputs]
        before = fg.testing.last_seq(peers[0])
        results = await asyncio.gather(
            *(p.all_reduce_coalesced(row) for p, row in zip(peers, tensors, strict=True))
        )
        # Two dtypes: two collectives, whatever the number of tensors.
        assert fg.testing.last_seq(peers[0]) - before == 2
    for r in range(world):
        assert results[r] == tensors[r]
        for i, t in enumerate(tensors[r]):
            expected = sum(inputs[k][i] for k in range(world))
            assert torch.equal(t, expected), (r, i)


def test_ddp_compression_sends_half_the_bytes_within_the_bound() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from torch import nn

    from tests.helpers import free_port

    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        backends = list(
            pool.map(lambda r: fg.init_backend(r, 2, "127.0.0.1", port, shm=False), [0, 1])
        )
    try:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
        xs = [torch.randn(16, 64, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        # Reference: each rank's gradient in full precision, averaged in float64.
        grads = []
        for x in xs:
            model = _copy(base)
            model(x).square().sum().backward()
            grads.append({n: p.grad.double() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        results: list[dict[str, torch.Tensor]] = [{}, {}]
        sent = [0, 0]

        def step(rank: int) -> None:
            model = _copy(base)
            ddp = fg.DDP(model, backends[rank], compression="bf16")
            before = fg.testing.stats(backends[rank]).bytes_sent
            ddp(xs[rank]).square().sum().backward()
            ddp.sync_gradients()
            sent[rank] = fg.testing.stats(backends[rank]).bytes_sent - before
            results[rank] = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(step, [0, 1]))
        numel = sum(p.numel() for p in base.parameters())
        for name in results[0]:
            assert torch.equal(results[0][name], results[1][name]), name
            mean = (grads[0][name] + grads[1][name]) / 2
            limit = 2 * UNIT[torch.bfloat16] * (grads[0][name].abs() + grads[1][name].abs()) / 2
            err = (results[0][name].double() - mean).abs()
            assert bool((err <= limit + 1e-7).all()), (name, float((err - limit).max()))
        # bf16 on the wire: about half of float32's 4 bytes per element.
        assert sent[0] < 0.6 * numel * 4, (sent, numel)
    finally:
        for b in backends:
            b.close()


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def test_ddp_compression_is_checked() -> None:
    from tests.helpers import free_port

    with (
        fg.init_backend(0, 1, "127.0.0.1", free_port()) as backend,
        pytest.raises(fg.ConfigError, match="compression must be"),
    ):
        fg.DDP(torch.nn.Linear(2, 2), backend, compression="int4")


def test_a_chunk_is_as_many_bytes_on_the_wire_in_a_narrower_dtype() -> None:
    # Fewer messages for the same bytes: in bfloat16 a chunk holds twice the
    # float32 elements (each message costs the same fixed amount).
    from ferrogrpc.algorithms.descriptor import make_descriptor
    from ferrogrpc.ops import ReduceOp
    from ferrogrpc.v1 import collective_pb2 as pb

    buf = torch.ones(1 << 20)
    args = (pb.ALL_REDUCE, buf, ReduceOp.SUM, 0, 2, (1 << 20, 1), 1 << 30, None)
    plain = make_descriptor(*args)
    narrow = make_descriptor(*args, torch.bfloat16)
    assert plain.chunk_elems == (1 << 20) // 4
    assert narrow.chunk_elems == 2 * plain.chunk_elems


# ------------------------------------------- issue 56: small, and two-level


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("transport", ["grpc", "memory"])
async def test_a_small_all_gather_in_a_wire_dtype_is_the_same_on_every_rank(
    transport: str, into: bool
) -> None:
    # Issue 56 item 8: one exchange (a few hundred bytes a rank). Every
    # rank's block arrives rounded to bf16, so a rank's own block must be
    # rounded too: the same bits on every rank, its own block included.
    world, n = 3, 50
    gen = torch.Generator().manual_seed(56)
    inputs = [torch.randn(n, generator=gen) for _ in range(world)]
    expected = torch.cat([t.to(torch.bfloat16).float() for t in inputs])
    assert not torch.equal(expected, torch.cat(inputs))  # bf16 really rounds them
    async with fg.testing.local_group(world, transport=transport) as peers:  # type: ignore[arg-type]
        if into:
            outs = [torch.empty(world * n) for _ in range(world)]
            await asyncio.gather(
                *(
                    p.all_gather_into_tensor(o, t, wire_dtype=torch.bfloat16)
                    for p, o, t in zip(peers, outs, inputs, strict=True)
                )
            )
        else:
            lists = await asyncio.gather(
                *(
                    p.all_gather(t, wire_dtype=torch.bfloat16)
                    for p, t in zip(peers, inputs, strict=True)
                )
            )
            outs = [torch.cat(got) for got in lists]
    for rank, out in enumerate(outs):
        assert torch.equal(out, expected), rank


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
async def test_the_two_level_path_sends_a_wire_dtype_across_hosts(collective: str) -> None:
    # Issue 56 item 9: two hosts of two ranks: shared memory inside a host,
    # gRPC rings across. With wire_dtype the bytes that cross hosts halve,
    # and the result differs from full precision within the README's bound
    # (the same on every rank).
    hosts, n = ["a", "a", "b", "b"], 1 << 17
    world = len(hosts)
    gen = torch.Generator().manual_seed(9)
    inputs = [torch.randn(n, generator=gen) * 3 for _ in range(world)]
    results: dict[str, list[torch.Tensor]] = {}
    sent: dict[str, int] = {}
    async with fg.testing.local_group(world, transport="shm", hosts=hosts) as peers:
        assert {p.data_path for p in peers} == {"two-level"}
        for name, wire in (("full", None), ("bf16", torch.bfloat16)):
            before = sum(fg.testing.stats(p).bytes_sent for p in peers)
            tensors = [t.clone() for t in inputs]
            if collective == "all_reduce":
                await asyncio.gather(
                    *(p.all_reduce(t, wire_dtype=wire) for p, t in zip(peers, tensors, strict=True))
                )
                results[name] = tensors
            else:
                results[name] = list(
                    await asyncio.gather(
                        *(
                            p.reduce_scatter(t, wire_dtype=wire)
                            for p, t in zip(peers, tensors, strict=True)
                        )
                    )
                )
            sent[name] = sum(fg.testing.stats(p).bytes_sent for p in peers) - before
    assert sent["bf16"] <= 0.55 * sent["full"], sent
    reference = torch.stack([t.double() for t in inputs]).sum(0)
    limit = bound(inputs, torch.bfloat16)
    got = results["bf16"]
    if collective == "reduce_scatter":
        whole, part = torch.cat(got), n // world
        for r in range(world):
            assert torch.equal(got[r], whole[r * part : (r + 1) * part])
    else:
        whole = got[0]
        for t in got[1:]:
            assert torch.equal(t, whole)  # the same bits on every rank
    err = (whole.double() - reference).abs()
    assert bool((err <= limit).all()), float((err - limit).max())
    full = torch.cat(results["full"]) if collective == "reduce_scatter" else results["full"][0]
    assert not torch.equal(whole, full)  # really rounded on the way
