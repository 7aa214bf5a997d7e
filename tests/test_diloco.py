"""fg.DiLoCo on in-process ranks (each a Backend on its own thread), against
an independent single-process simulation of N DiLoCo workers: plain loops,
torch.optim.SGD(nesterov=True) as the outer optimizer, per-parameter
tensors (the wrapper keeps flat ones). Also the streaming fragments'
overlap and delay, the state dict round trip, bad arguments, and bf16."""

from __future__ import annotations

import concurrent.futures
import copy
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ferrogrpc as fg
from tests.helpers import backends, on_ranks

D_IN, D_OUT, BATCH = 6, 3, 8
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
# The model without BatchNorm, by parameter: elements 48, 8, 64, 8, 24, 3.
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
# Contiguous, balanced by bytes (all float64): cut k at the element
# boundary nearest k/F of the 155 elements, the earlier on a tie, inside a
# parameter where it falls there.
LAYOUTS = {
    1: [NAMES],
    # 77 | 78 (77.5: the earlier)
    2: [
        ["0.weight", "0.bias", "2.weight[0:21]"],
        ["2.weight[21:64]", "2.bias", "4.weight", "4.bias"],
    ],
    # 52 | 51 | 52 (51.7 and 103.3)
    3: [
        ["0.weight", "0.bias[0:4]"],
        ["0.bias[4:8]", "2.weight[0:47]"],
        ["2.weight[47:64]", "2.bias", "4.weight", "4.bias"],
    ],
}


def pieces(numels: list[int], fragments: int) -> list[list[tuple[int, int, int]]]:
    """Per fragment, its (parameter, lo, hi) element ranges: the cuts at
    the element boundaries nearest k/F of the total (equal element sizes),
    the earlier on a tie."""
    total = sum(numels)
    cuts = [0]
    for k in range(1, fragments):
        target = total * k / fragments
        cuts.append(int(target) if target - int(target) <= 0.5 else int(target) + 1)
    cuts.append(total)
    out: list[list[tuple[int, int, int]]] = []
    for lo, hi in itertools.pairwise(cuts):
        ranges, first = [], 0
        for i, n in enumerate(numels):
            a, b = max(lo - first, 0), min(hi - first, n)
            if a < b:
                ranges.append((i, a, b))
            first += n
        out.append(ranges)
    return out


def _group(world: int) -> Iterator[list[fg.Backend]]:
    # shm=False: the pseudo-gradients cross gRPC, where a wire dtype applies.
    group = backends(world, shm=False)
    yield group
    for b in group:
        b.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[list[fg.Backend]]:
    yield from _group(2)


@pytest.fixture(scope="module")
def trio() -> Iterator[list[fg.Backend]]:
    yield from _group(3)


def make_model(seed: int, with_bn: bool = False) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    norm: list[nn.Module] = [nn.BatchNorm1d(8)] if with_bn else []
    model = nn.Sequential(
        nn.Linear(D_IN, 8), *norm, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, D_OUT)
    ).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    return model


def make_inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.02)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard: its own batch for each inner step."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, D_IN, generator=gen, dtype=torch.float64)
    return x, torch.randn(BATCH, D_OUT, generator=gen, dtype=torch.float64)


def inner_step(forward: Any, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad()
    nn.functional.mse_loss(forward(x), y).backward()
    opt.step()


def simulate(
    world: int,
    steps: int,
    *,
    sync_every: int,
    fragments: int = 1,
    with_bn: bool = False,
    sync_at_end: bool = False,
) -> list[nn.Module]:
    """N DiLoCo workers in one process, as docs/diloco.md describes them:
    fragment f starts after inner step t when (t - f*H//F) % H == 0; it is
    applied tau = 0 (F == 1) or H//F (F > 1) inner steps later, before any
    start of that step, with the pseudo-gradient taken at its start; each
    worker's parameters of the fragment become new_global + (now - at_start);
    floating buffers ride with fragment 0 the same way. ``sync_at_end``
    (DiLoCo.sync): the exchange still due is applied at once, then every
    fragment syncs with tau = 0, but one whose locals became its global
    parameters at the last step."""
    template = make_model(0, with_bn)
    workers = [copy.deepcopy(template) for _ in range(world)]
    inner = [make_inner(w) for w in workers]
    # Per fragment: its element ranges, their global values (one leaf
    # tensor per range) and an outer optimizer of its own (SGD is
    # elementwise, so this is one SGD over the model, stepped per fragment).
    groups = pieces([p.numel() for p in template.parameters()], fragments)
    glob = [
        [p.detach().reshape(-1)[lo:hi].clone() for i, lo, hi in group
         for p in [list(template.parameters())[i]]]
        for group in groups
    ]  # fmt: skip
    outer = [torch.optim.SGD(g, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for g in glob]
    tau = 0 if fragments == 1 else sync_every // fragments
    due: dict[int, Any] = {}

    def params(r: int) -> list[torch.Tensor]:
        return list(workers[r].parameters())

    def float_buffers(r: int) -> list[torch.Tensor]:
        return [b for b in workers[r].buffers() if b.is_floating_point()]

    def apply(exchange: Any) -> None:
        f, mean, at_start, buffers = exchange
        for g, m in zip(glob[f], mean, strict=True):
            g.grad = m
        outer[f].step()
        with torch.no_grad():
            for r in range(world):
                for j, (i, lo, hi) in enumerate(groups[f]):
                    flat = params(r)[i].view(-1)
                    flat[lo:hi] = glob[f][j] + (flat[lo:hi] - at_start[r][j])
                if buffers is not None:
                    means, starts = buffers
                    for b, m, s in zip(float_buffers(r), means, starts[r], strict=True):
                        b.copy_(m + (b - s))

    def start(f: int) -> Any:
        def local(r: int, i: int, lo: int, hi: int) -> torch.Tensor:
            return params(r)[i].detach().reshape(-1)[lo:hi]

        mean = [
            sum(g - local(r, i, lo, hi) for r in range(world)) / world
            for g, (i, lo, hi) in zip(glob[f], groups[f], strict=True)
        ]
        at_start = [[local(r, *piece).clone() for piece in groups[f]] for r in range(world)]
        buffers = None
        if f == 0 and with_bn:
            starts = [[b.clone() for b in float_buffers(r)] for r in range(world)]
            buffers = ([sum(bs) / world for bs in zip(*starts, strict=True)], starts)
        return (f, mean, at_start, buffers)

    synced: dict[int, int] = {}  # fragment -> the step its locals became global
    for t in range(1, steps + 1):
        for r in range(world):
            inner_step(workers[r], inner[r], r, t - 1)
        if t in due:
            apply(due.pop(t)[2])
        for f in range(fragments):
            if (t - f * sync_every // fragments) % sync_every:
                continue
            exchange = start(f)
            if tau == 0:
                apply(exchange)
                synced[f] = t
            else:
                due[t + tau] = (f, t, exchange)
    if sync_at_end:
        for t in sorted(due):
            f, started, exchange = due.pop(t)
            apply(exchange)
            if started == steps:
                synced[f] = steps
        left = [f for f in range(fragments) if synced.get(f) != steps]
        for exchange in [start(f) for f in left]:
            apply(exchange)
    return workers


def train(
    group: list[fg.Backend],
    steps: int,
    *,
    sync_every: int,
    fragments: int = 1,
    with_bn: bool = False,
    compression: str | None = None,
    sync_at_end: bool = False,
) -> list[nn.Module]:
    """The same training on real ranks; each starts from its own seed's
    weights (the construction broadcasts rank 0's)."""

    def run(rank: int) -> nn.Module:
        model = make_model(rank, with_bn)
        opt = make_inner(model)
        diloco = fg.DiLoCo(
            model,
            group[rank],
            opt,
            sync_every=sync_every,
            fragments=fragments,
            compression=compression,
        )
        for t in range(steps):
            inner_step(diloco, opt, rank, t)
            diloco.step()
        assert diloco.inner_steps == steps
        if sync_at_end:
            diloco.sync()
            assert diloco.inner_steps == steps
            assert diloco.state_dict()["outer"]["pending"] is None
        diloco.state_dict()  # waits for an exchange still in flight
        return model

    return on_ranks(run, len(group))


def assert_close(real: list[nn.Module], sim: list[nn.Module], atol: float = 1e-6) -> None:
    for rank, (a, b) in enumerate(zip(real, sim, strict=True)):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            if x.is_floating_point():
                diff = float((x - y).abs().max())
                assert diff <= atol, f"rank {rank} {name}: off by {diff:.3g}"


# ----------------------------------------------------------------------- 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_equal_a_simulation_of_diloco_workers(
    world: int, pair: list[fg.Backend], trio: list[fg.Backend]
) -> None:
    group = pair if world == 2 else trio
    h = 4
    real = train(group, 3 * h, sync_every=h, with_bn=True)
    sim = simulate(world, 3 * h, sync_every=h, with_bn=True)
    assert_close(real, sim)
    # Right after a sync every rank holds the global parameters and the
    # averaged buffers.
    for other in real[1:]:
        for x, y in zip(real[0].state_dict().values(), other.state_dict().values(), strict=True):
            assert torch.equal(x, y)
    # The ranks really trained apart, and the outer step really moved them:
    # the simulation without its syncs is far away.
    alone = simulate(world, 3 * h, sync_every=3 * h + 1, with_bn=True)
    with pytest.raises(AssertionError):
        assert_close(real, alone, atol=1e-3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fragments", [1, 3])
def test_sync_brings_every_rank_to_the_same_model_as_the_simulation(
    fragments: int, trio: list[fg.Backend]
) -> None:
    # H = 6, F = 3: fragment 2 starts after step 16 (16 % 6 == 4) and would
    # be applied after step 18: at step 17 it is still in flight.
    h, steps = 6, 17
    bn = fragments == 1  # (the fragment layouts are the model's without BatchNorm)
    real = train(trio, steps, sync_every=h, fragments=fragments, with_bn=bn, sync_at_end=True)
    sim = simulate(3, steps, sync_every=h, fragments=fragments, with_bn=bn, sync_at_end=True)
    assert_close(real, sim)
    for other in real[1:]:
        for x, y in zip(real[0].state_dict().values(), other.state_dict().values(), strict=True):
            assert torch.equal(x, y)
    # Without the final sync the ranks differ, and the simulation does too.
    apart = simulate(3, steps, sync_every=h, fragments=fragments, with_bn=bn)
    with pytest.raises(AssertionError):
        assert_close(real, apart, atol=1e-4)


@pytest.mark.timeout(60)
def test_sync_right_after_a_sync_changes_nothing(pair: list[fg.Backend]) -> None:
    # F=1, H=4, 8 steps: the fragment synced at step 8; sync() leaves it (an
    # outer step on a zero pseudo-gradient would still move the model by
    # the momentum), and a second sync() changes nothing either.
    h, steps = 4, 8

    def run(rank: int) -> list[dict[str, torch.Tensor]]:
        model = make_model(rank, True)
        opt = make_inner(model)
        diloco = fg.DiLoCo(model, pair[rank], opt, sync_every=h)
        for t in range(steps):
            inner_step(diloco, opt, rank, t)
            diloco.step()
        states = [copy.deepcopy(model.state_dict())]
        for _ in range(2):
            diloco.sync()
            states.append(copy.deepcopy(model.state_dict()))
        return states

    for states in on_ranks(run, 2):
        for later in states[1:]:
            for name, x in states[0].items():
                assert torch.equal(x, later[name]), name
    assert OUTER_MOMENTUM > 0  # (else an extra outer step would not move it)


# ----------------------------------------------------------------------- 2


class _Gated(fg.Work[torch.Tensor]):
    """A Work whose result is held back until the rank has run one more inner
    step than when it started; notes the inner step at which it is waited for."""

    def __init__(self, future: concurrent.futures.Future[torch.Tensor], log: dict[str, Any]):
        super().__init__(future, "all_reduce")
        self.log = log

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        self.log["waited_at"] = self.log["clock"]()
        return super().wait(timeout)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "fragments"), [(2, 2), (3, 3)])
def test_fragments_overlap_inner_steps_and_apply_after_the_documented_delay(
    world: int, fragments: int, pair: list[fg.Backend], trio: list[fg.Backend]
) -> None:
    group = pair if world == 2 else trio
    h = 6
    tau = h // fragments
    steps = 3 * h

    def run(rank: int) -> tuple[nn.Module, list[dict[str, Any]], list[list[str]]]:
        backend = group[rank]
        real_all_reduce = backend.all_reduce
        done = [0]  # inner steps this rank has run
        exchanges: list[dict[str, Any]] = []
        gates: list[tuple[int, threading.Event]] = []

        def gated(tensor: torch.Tensor, op: Any = "sum", **kwargs: Any) -> Any:
            assert kwargs.get("async_op") is True
            work = real_all_reduce(tensor, op, **kwargs)
            future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            gate = threading.Event()
            gates.append((done[0], gate))

            def finish() -> None:
                try:
                    result = work.wait()
                except BaseException as exc:
                    future.set_exception(exc)
                    return
                # Held until a later inner step ran (a DiLoCo that waited in
                # the step that started it would find it still not done).
                gate.wait(5)
                future.set_result(result)

            threading.Thread(target=finish, daemon=True).start()
            log: dict[str, Any] = {"started": done[0], "clock": lambda: done[0]}
            log["work"] = gated_work = _Gated(future, log)
            exchanges.append(log)
            return gated_work

        backend.all_reduce = gated  # type: ignore[method-assign]
        try:
            model = make_model(rank)
            opt = make_inner(model)
            diloco = fg.DiLoCo(model, backend, opt, sync_every=h, fragments=fragments)
            assert diloco.delay == tau
            for t in range(steps):
                inner_step(diloco, opt, rank, t)
                done[0] += 1
                for started, gate in gates:
                    if started < done[0]:
                        gate.set()
                seen = len(exchanges)
                diloco.step()
                for log in exchanges[seen:]:
                    log["running_on_return"] = not log["work"].is_completed()
            for _, gate in gates:
                gate.set()  # the last exchange: no inner step follows it
            diloco.state_dict()
            return model, exchanges, diloco.fragment_layout()
        finally:
            for _, gate in gates:
                gate.set()
            del backend.all_reduce  # the class's method again

    results = on_ranks(run, world)
    sim = simulate(world, steps, sync_every=h, fragments=fragments)
    assert_close([m for m, _, _ in results], sim)
    for _, exchanges, layout in results:
        assert layout == LAYOUTS[fragments]
        starts = [log["started"] for log in exchanges]
        expected = [t for t in range(1, steps + 1) if any(
            (t - f * h // fragments) % h == 0 for f in range(fragments)
        )]  # fmt: skip
        assert starts == expected
        for log in exchanges:
            # step() returned with the exchange still running ...
            assert log["running_on_return"], log
            # ... the next inner steps ran, and it was applied (waited for)
            # tau steps after its start: the last one only by state_dict().
            if log["started"] + tau <= steps:
                assert log["waited_at"] == log["started"] + tau, log
            else:
                assert log["waited_at"] == steps, log


# ----------------------------------------------------------------------- 3


@pytest.mark.timeout(60)
def test_a_loaded_state_dict_continues_bit_identically(pair: list[fg.Backend]) -> None:
    h, fragments, cut, steps = 4, 2, 5, 13
    # After step 5, fragment 0's exchange started at step 4 (with the
    # BatchNorm buffers) is still to be applied, at step 4 + 2.

    def run(rank: int) -> list[tuple[str, torch.Tensor]]:
        def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, fg.DiLoCo]:
            model = make_model(seed, with_bn=True)
            opt = make_inner(model)
            diloco = fg.DiLoCo(model, pair[rank], opt, sync_every=h, fragments=fragments)
            return model, opt, diloco

        _, opt, diloco = build(rank)
        for t in range(cut):
            inner_step(diloco, opt, rank, t)
            diloco.step()
        saved = copy.deepcopy(diloco.state_dict())
        assert saved["outer"]["pending"] is not None
        assert saved["outer"]["pending"]["buffers"] is not None
        for t in range(cut, steps):
            inner_step(diloco, opt, rank, t)
            diloco.step()
        uninterrupted = diloco.state_dict()

        _, opt2, resumed = build(rank + 7)
        resumed.load_state_dict(saved)
        assert resumed.inner_steps == cut
        for t in range(cut, steps):
            inner_step(resumed, opt2, rank, t)
            resumed.step()
        again = resumed.state_dict()
        return [*_leaves(uninterrupted), ("vs", torch.zeros(())), *_leaves(again)]

    for leaves in on_ranks(run, 2):
        split = [name for name, _ in leaves].index("vs")
        a, b = leaves[:split], leaves[split + 1 :]
        assert [n for n, _ in a] == [n for n, _ in b]
        for (name, x), (_, y) in zip(a, b, strict=True):
            assert torch.equal(x, y), name


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key in tree:
            yield from _leaves(tree[key], f"{prefix}/{key}")
    elif isinstance(tree, list | tuple):
        for i, item in enumerate(tree):
            yield from _leaves(item, f"{prefix}/{i}")
    else:
        yield prefix, torch.tensor(float(tree) if isinstance(tree, int | float) else 0.0)


# ----------------------------------------------------------------------- 4


@pytest.mark.timeout(60)
def test_bad_arguments_raise_config_errors(pair: list[fg.Backend]) -> None:
    backend = pair[0]  # every check runs before any collective
    model = make_model(0)
    opt = make_inner(model)
    other = torch.optim.SGD(make_model(1).parameters(), lr=0.1)
    frozen = make_model(0).requires_grad_(False)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"backend": "tcp://x"}, "backend must be a ferrogrpc Backend"),
        ({"model": "model"}, "wraps an nn.Module"),
        ({"model": frozen}, "no trainable parameter"),
        ({"inner_optimizer": None}, "inner_optimizer must be a torch.optim.Optimizer"),
        ({"inner_optimizer": other}, "not the model's"),
        ({"sync_every": 0}, "sync_every must be an int >= 1, got 0"),
        ({"sync_every": 2.0}, "sync_every must be an int >= 1"),
        ({"sync_every": True}, "sync_every must be an int >= 1"),
        ({"outer_lr": 0}, "outer_lr must be a finite number > 0"),
        ({"outer_lr": float("nan")}, "outer_lr must be a finite number > 0"),
        ({"outer_momentum": 1.0}, "outer_momentum must be a number in [0, 1)"),
        ({"outer_momentum": -0.1}, "outer_momentum must be a number in [0, 1)"),
        ({"fragments": 0}, "fragments must be an int >= 1"),
        (
            {"fragments": 156, "sync_every": 200},
            "fragments=156 exceeds the model's 155 trainable parameter elements",
        ),
        ({"fragments": 3, "sync_every": 2}, "fragments=3 exceeds sync_every=2"),
        ({"compression": "fp16"}, "compression must be None, 'bf16', 'int8' or 'int4', got 'fp16'"),
    ]
    for change, message in cases:
        kwargs: dict[str, Any] = {
            "model": model,
            "backend": backend,
            "inner_optimizer": opt,
            "sync_every": 4,
        } | change
        with pytest.raises(fg.ConfigError) as info:
            fg.DiLoCo(
                kwargs.pop("model"), kwargs.pop("backend"), kwargs.pop("inner_optimizer"), **kwargs
            )
        assert message in str(info.value), (change, str(info.value))

    # Ranks that disagree on a setting all raise, naming it.
    def mismatched(rank: int) -> str:
        m = make_model(rank)
        with pytest.raises(fg.ConfigError) as info:
            fg.DiLoCo(m, pair[rank], make_inner(m), sync_every=4 + rank)
        return str(info.value)

    for text in on_ranks(mismatched, 2):
        assert "sync_every=4" in text and "sync_every=5" in text, text

    # A state dict of another layout is refused, and nothing is loaded.
    def layouts(rank: int) -> str:
        m = make_model(rank)
        two = fg.DiLoCo(m, pair[rank], make_inner(m), sync_every=4, fragments=2)
        one = fg.DiLoCo(m, pair[rank], make_inner(m), sync_every=4)
        with pytest.raises(fg.ConfigError) as info:
            one.load_state_dict(two.state_dict())
        assert one.inner_steps == 0
        with pytest.raises(fg.ConfigError, match="not a DiLoCo state dict"):
            one.load_state_dict({"model": {}})
        return str(info.value)

    for text in on_ranks(layouts, 2):
        assert "fragments" in text, text


@pytest.mark.timeout(60)
def test_a_state_dict_cut_at_parameter_boundaries_loads_cut_again(
    pair: list[fg.Backend],
) -> None:
    # ferrogrpc before 2026-12-04 cut F=2 after "0.bias" (element 56); now
    # inside "2.weight" (element 77). With no exchange in flight the outer
    # state (elementwise) is cut again; with one in flight it is refused.
    old_layout = [NAMES[:2], NAMES[2:]]

    def run(rank: int) -> None:
        m = make_model(rank)
        opt = make_inner(m)
        diloco = fg.DiLoCo(m, pair[rank], opt, sync_every=4, fragments=2)
        for t in range(6):
            inner_step(diloco, opt, rank, t)
            diloco.step()
        diloco.sync()
        state = copy.deepcopy(diloco.state_dict())
        assert state["outer"]["pending"] is None
        flat = {k: torch.cat(state["outer"][k]) for k in ("global", "momentum")}
        assert flat["momentum"].abs().sum() > 0  # (outer steps ran)
        old = copy.deepcopy(state)
        old["outer"]["fragments"] = old_layout
        for k in ("global", "momentum"):
            old["outer"][k] = list(flat[k].split([56, 99]))
        m2 = make_model(rank + 5)
        fresh = fg.DiLoCo(m2, pair[rank], make_inner(m2), sync_every=4, fragments=2)
        fresh.load_state_dict(old)
        loaded = fresh.state_dict()["outer"]
        assert loaded["fragments"] == LAYOUTS[2]
        for k in ("global", "momentum"):
            assert [t.numel() for t in loaded[k]] == [77, 78]
            assert torch.equal(torch.cat(loaded[k]), flat[k]), k
        assert fresh.inner_steps == 6
        # An exchange in flight saved with the old cut is refused.
        old["outer"]["pending"] = {"fragment": 0, "started": 4}
        with pytest.raises(fg.ConfigError, match="fragments"):
            fresh.load_state_dict(old)

    on_ranks(run, 2)


def test_fragment_starts_are_the_nearest_element_boundaries_by_bytes() -> None:
    from ferrogrpc.wrappers.diloco_fragments import fragment_starts

    def brute(numels: list[int], sizes: list[int], parts: int) -> list[int]:
        # Every element boundary's byte offset; the nearest to each target,
        # the earlier on a tie, then kept so that no fragment is empty.
        offsets = [0]
        for n, s in zip(numels, sizes, strict=True):
            offsets += [offsets[-1] + s * (j + 1) for j in range(n)]
        total = len(offsets) - 1
        starts = [0]
        for k in range(1, parts):
            target = offsets[-1] * k / parts
            best = min(range(total + 1), key=lambda i: (abs(offsets[i] - target), i))
            starts.append(min(max(best, starts[-1] + 1), total - (parts - k)))
        return starts

    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        count = int(torch.randint(1, 6, (1,), generator=gen))
        numels = torch.randint(0, 9, (count,), generator=gen).tolist()
        if sum(numels) == 0:
            numels[0] = 1
        sizes = [[2, 4, 8][int(i)] for i in torch.randint(0, 3, (count,), generator=gen)]
        for parts in {1, 2, 3, sum(numels)}:
            if parts <= sum(numels):
                assert fragment_starts(numels, sizes, parts) == brute(numels, sizes, parts), (
                    numels,
                    sizes,
                    parts,
                )


@pytest.mark.timeout(30)
def test_a_parameter_with_no_elements_is_in_a_fragment() -> None:
    from ferrogrpc.wrappers.diloco_fragments import make_fragment

    a, empty, b = (nn.Parameter(torch.ones(n)) for n in (3, 0, 3))
    named = [("a", a), ("empty", empty), ("b", b)]
    first, second = make_fragment(named, 0, 3), make_fragment(named, 3, 6)
    assert [p.label() for p in first.pieces] == ["a"]
    assert [p.label() for p in second.pieces] == ["empty", "b"]
    trailing = [("a", a), ("empty", empty)]
    assert [p.label() for p in make_fragment(trailing, 2, 3).pieces] == ["a[2:3]", "empty"]


# ----------------------------------------------------------------------- 5


@pytest.mark.timeout(60)
def test_bf16_compression_stays_within_its_bound(pair: list[fg.Backend]) -> None:
    world, h = 2, 4
    # One sync: the local parameters before it do not depend on the wire.
    exact = train(pair, h, sync_every=h)
    bf16 = train(pair, h, sync_every=h, compression="bf16")
    before = simulate(world, h, sync_every=h + 1)  # the locals just before the sync
    start = list(make_model(0).parameters())
    for i, (x, y) in enumerate(zip(exact[0].parameters(), bf16[0].parameters(), strict=True)):
        deltas = [start[i].detach() - list(w.parameters())[i].detach() for w in before]
        mean_abs = sum(d.abs() for d in deltas) / world
        # docs/diloco.md: the mean within W * 2^-8 * mean|delta|; the first
        # outer step multiplies it by outer_lr * (1 + outer_momentum).
        bound = OUTER_LR * (1 + OUTER_MOMENTUM) * world * 2.0**-8 * mean_abs + 1e-12
        err = (x - y).abs()
        assert bool((err <= bound).all()), float((err - bound).max())
    diff = max(
        float((x - y).detach().abs().max())
        for x, y in zip(exact[0].parameters(), bf16[0].parameters(), strict=True)
    )
    assert diff > 0  # the pseudo-gradients really crossed as bf16


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("compression", "qmax"), [("int8", 127), ("int4", 7)])
def test_int8_and_int4_compression_stay_within_their_bound(
    pair: list[fg.Backend], compression: str, qmax: int
) -> None:
    world, h = 2, 4
    exact = train(pair, h, sync_every=h)
    rounded = train(pair, h, sync_every=h, compression=compression)
    before = simulate(world, h, sync_every=h + 1)
    start = list(make_model(0).parameters())
    moved = 0.0
    for i, (x, y) in enumerate(zip(exact[0].parameters(), rounded[0].parameters(), strict=True)):
        deltas = [start[i].detach() - list(w.parameters())[i].detach() for w in before]
        # docs/diloco.md: the mean within (1 + 1/(4 qmax)) * mean_r max|delta_r| / qmax
        # (half a step of each rank's block, and of the result's, each step
        # at most the tensor's largest magnitude / qmax); times
        # outer_lr * (1 + outer_momentum).
        step = sum(float(d.abs().max()) for d in deltas) / world / qmax
        bound = OUTER_LR * (1 + OUTER_MOMENTUM) * (1 + 1 / (4 * qmax)) * step + 1e-12
        err = float((x - y).detach().abs().max())
        assert err <= bound, (i, err, bound)
        moved = max(moved, err)
    assert moved > 0  # the pseudo-gradients really crossed rounded


@pytest.mark.timeout(60)
def test_a_failed_exchange_raises_from_step_and_changes_nothing(pair: list[fg.Backend]) -> None:
    # Fragment 1 (H=4, F=2) starts at step 2 and is applied at step 4: its
    # exchange fails there. Every rank's all_reduce is replaced by one that
    # fails, so no real collective runs and the group stays whole.
    def run(rank: int) -> None:
        backend = pair[rank]
        model = make_model(rank)
        opt = make_inner(model)
        diloco = fg.DiLoCo(model, backend, opt, sync_every=4, fragments=2)

        def failing(tensor: torch.Tensor, op: Any = "sum", **kwargs: Any) -> Any:
            future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            future.set_exception(fg.PeerError("injected", rank=rank, world_size=2, peer=1 - rank))
            return fg.Work(future, "all_reduce")

        backend.all_reduce = failing  # type: ignore[method-assign]
        try:
            inner_step(diloco, opt, rank, 0)
            diloco.step()
            outer = copy.deepcopy(diloco.state_dict()["outer"])  # nothing in flight yet
            for t in range(1, 3):
                inner_step(diloco, opt, rank, t)
                diloco.step()  # step 2 starts fragment 1's exchange
            inner_step(diloco, opt, rank, 3)
            local = copy.deepcopy(model.state_dict())
            with pytest.raises(fg.PeerError, match="injected"):
                diloco.step()
            after = diloco.state_dict()  # works, with the exchange dropped
        finally:
            del backend.all_reduce
        assert diloco.inner_steps == 4
        assert after["outer"]["pending"] is None
        for key in ("global", "momentum"):
            for x, y in zip(outer[key], after["outer"][key], strict=True):
                assert torch.equal(x, y), key
        for name, x in local.items():
            assert torch.equal(x, after["model"][name]), name

    on_ranks(run, 2)


@pytest.mark.timeout(30)
def test_a_cut_inside_a_non_contiguous_parameter_reads_and_writes_its_own_elements() -> None:
    from ferrogrpc.wrappers.diloco_fragments import make_fragment

    weight = nn.Parameter(torch.arange(12.0).view(3, 4).t())  # (4, 3), not contiguous
    bias = nn.Parameter(torch.arange(100.0, 103.0))
    named = [("w", weight), ("b", bias)]
    first, second = make_fragment(named, 0, 7), make_fragment(named, 7, 15)
    assert [p.label() for p in first.pieces] == ["w[0:7]"]
    assert [p.label() for p in second.pieces] == ["w[7:12]", "b"]
    flat = weight.detach().reshape(-1)
    assert torch.equal(first.flatten(), flat[:7])
    assert torch.equal(second.flatten(), torch.cat([flat[7:], bias.detach()]))
    second.write(torch.full((8,), -1.0))
    first.write(torch.zeros(7))
    assert torch.equal(weight.detach().reshape(-1), torch.tensor([0.0] * 7 + [-1.0] * 5))
    assert torch.equal(bias.detach(), torch.full((3,), -1.0))
    assert not weight.is_contiguous()


# --------------------------------------------------------------- issue 56


def test_each_fragment_starts_once_per_sync_every_when_fragments_do_not_divide_it() -> None:
    # Issue 56 item 10, the schedule alone: fragment f starts after the
    # inner steps t >= 1 with t % H == (f * H) // F, once in any H steps.
    from ferrogrpc.wrappers.diloco_fragments import fragment_starting, sync_delay, sync_offset

    for h, fragments, offsets in ((5, 2, [0, 2]), (7, 3, [0, 2, 4]), (6, 4, [0, 1, 3, 4])):
        assert [sync_offset(f, h, fragments) for f in range(fragments)] == offsets
        starts: dict[int, list[int]] = {f: [] for f in range(fragments)}
        for t in range(1, 4 * h + 1):
            f = fragment_starting(t, h, fragments)
            if f is not None:
                starts[f].append(t)
        for f in range(fragments):
            first = offsets[f] or h
            assert starts[f] == list(range(first, 4 * h + 1, h)), (h, fragments, f, starts)
        # Each start is applied before the next one starts (tau <= the gap).
        every = sorted(t for ts in starts.values() for t in ts)
        assert min(b - a for a, b in itertools.pairwise(every)) >= sync_delay(h, fragments)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("h", "fragments"), [(5, 2), (7, 3)])
def test_fragments_that_do_not_divide_sync_every_train_as_the_simulation(
    h: int, fragments: int, pair: list[fg.Backend]
) -> None:
    # Issue 56 item 10, on real ranks: the simulation starts fragment f when
    # (t - f*H//F) % H == 0 by its own arithmetic.
    steps = 3 * h + 2
    real = train(pair, steps, sync_every=h, fragments=fragments)
    assert_close(real, simulate(2, steps, sync_every=h, fragments=fragments))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fragments", [2, 3])
def test_a_delayed_fragment_keeps_its_batchnorm_buffers_local_progress(
    fragments: int, trio: list[fg.Backend]
) -> None:
    # Issue 56 item 11: the floating buffers (BatchNorm's running mean and
    # variance) ride with fragment 0, applied tau steps after they were
    # taken: each rank's buffers become the mean at the start plus its own
    # progress since, as the parameters do. The simulation with BatchNorm
    # and F > 1 says so; the same run that drops the progress does not.
    h = 6
    steps = 3 * h + 1
    real = train(trio, steps, sync_every=h, fragments=fragments, with_bn=True)
    assert_close(real, simulate(3, steps, sync_every=h, fragments=fragments, with_bn=True))
    running = [m.state_dict()["1.running_mean"] for m in real]
    assert not torch.equal(running[0], running[1])  # local progress since the last exchange


@pytest.mark.timeout(60)
def test_a_state_dict_whose_exchange_is_due_is_refused(pair: list[fg.Backend]) -> None:
    # Issue 56 item 12: H=4, F=2 (tau 2): after step 5, fragment 0's
    # exchange started at step 4 is due at step 6. A state dict that says
    # the inner step is 6 (due at this step: step() would have applied it)
    # or 7 (one step later) with that exchange pending is refused; 4 (just
    # started) and 5 load, and 3 (started after it) is refused.
    def run(rank: int) -> dict[int, str]:
        model = make_model(rank)
        opt = make_inner(model)
        diloco = fg.DiLoCo(model, pair[rank], opt, sync_every=4, fragments=2)
        for t in range(5):
            inner_step(diloco, opt, rank, t)
            diloco.step()
        saved = copy.deepcopy(diloco.state_dict())
        assert saved["outer"]["pending"]["started"] == 4 and diloco.delay == 2
        verdicts: dict[int, str] = {}
        for steps in (3, 4, 5, 6, 7):
            state = copy.deepcopy(saved)
            state["outer"]["inner_steps"] = steps
            try:
                diloco.load_state_dict(state)
            except fg.ConfigError as exc:
                assert "not due after" in str(exc), exc
                verdicts[steps] = "refused"
            else:
                assert diloco.inner_steps == steps
                verdicts[steps] = "loaded"
        return verdicts

    for verdicts in on_ranks(run, 2):
        assert verdicts == {3: "refused", 4: "loaded", 5: "loaded", 6: "refused", 7: "refused"}
