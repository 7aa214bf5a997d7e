"""Structured logs (issue 32, item 5): lines carry rank, op and seq; the
JSON formatter writes one object per line; a healthy run prints nothing."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest
import torch

import ferrogrpc as fg
from ferrogrpc.env import Settings
from ferrogrpc.errors import ConfigError
from ferrogrpc.observe import logs
from tests.helpers import free_port, rank_env, spawn_rank

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def captured() -> io.StringIO:
    stream = io.StringIO()
    handler = logs.configure("json", "DEBUG", stream=stream)
    yield stream
    logger = logging.getLogger(logs.LOGGER)
    logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logs._installed = None


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_debug_lines_name_each_collective_by_rank_op_and_seq(captured: io.StringIO) -> None:
    async def run() -> None:
        async with fg.testing.local_group(2) as peers:
            for n in (4, 1 << 18):
                await asyncio.gather(*(p.all_reduce(torch.ones(n)) for p in peers))
            await asyncio.gather(*(p.broadcast(torch.ones(8), root=1) for p in peers))

    asyncio.run(run())
    lines = [x for x in _lines(captured) if x.get("op") and "done in" in str(x["message"])]
    # Each rank logged each collective it ran, once, in call order.
    for rank in (0, 1):
        mine = [(x["op"], x["seq"]) for x in lines if x["rank"] == rank]
        ops = [op for op, _ in mine]
        assert ops[-3:] == ["all_reduce", "all_reduce", "broadcast"], mine
        seqs = [seq for _, seq in mine]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), mine
    for x in lines:
        assert x["world_size"] == 2 and x["level"] == "DEBUG" and x["logger"] == "ferrogrpc"
        assert str(x["time"]).endswith("Z")


def test_a_break_is_one_line_naming_op_seq_and_culprit(captured: io.StringIO) -> None:
    async def run() -> None:
        timeouts = fg.Timeouts(collective=30, idle=1.0, connect=10)
        async with fg.testing.local_group(2, timeouts=timeouts) as peers:
            await asyncio.gather(*(p.all_reduce(torch.ones(4)) for p in peers))
            await peers[1].close()
            with pytest.raises(fg.FerroGrpcError):
                await peers[0].all_reduce(torch.ones(4))

    asyncio.run(run())
    broke = [x for x in _lines(captured) if str(x["message"]).startswith("broke:")]
    assert broke, captured.getvalue()
    first = broke[0]
    assert first["rank"] == 0 and first["op"] == "all_reduce", first
    assert first["peer"] == 1 and isinstance(first["seq"], int), first


def test_text_formatter_prefixes_rank_op_seq_and_peer() -> None:
    record = logging.LogRecord("ferrogrpc", logging.INFO, __file__, 1, "stalled", None, None)
    for name, value in {
        "rank": 2,
        "world_size": 4,
        "op": "all_reduce",
        "seq": 17,
        "peer": 1,
    }.items():
        setattr(record, name, value)
    text = logs.TextFormatter().format(record)
    assert "[rank 2/4 all_reduce#17 peer 1] stalled" in text, text
    as_json = json.loads(logs.JsonFormatter().format(record))
    assert (as_json["rank"], as_json["op"], as_json["seq"], as_json["peer"]) == (
        2,
        "all_reduce",
        17,
        1,
    )


def test_bad_log_settings_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="FERROGRPC_LOG="):
        Settings.from_env({"FERROGRPC_LOG": "xml"})
    with pytest.raises(ConfigError, match="FERROGRPC_LOG_LEVEL="):
        Settings.from_env({"FERROGRPC_LOG": "json", "FERROGRPC_LOG_LEVEL": "loud"})
    s = Settings.from_env({"FERROGRPC_LOG": "JSON", "FERROGRPC_LOG_LEVEL": "debug"})
    assert (s.log_format, s.log_level) == ("json", "DEBUG")


@pytest.mark.timeout(90)
def test_a_healthy_run_prints_nothing() -> None:
    port = free_port()
    procs = [spawn_rank("quiet.py", env=rank_env(r, 2, port)) for r in range(2)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.wait() for p in procs] == [0, 0], outputs
    assert outputs == ["", ""], outputs
