"""The public surface is deliberate, and the generated code matches proto/."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ferrogrpc as fg
from tests.helpers import ROOT

pytestmark = pytest.mark.timeout(60)


def test_public_names_are_pinned() -> None:
    assert sorted(fg.__all__) == sorted(
        [
            "Backend",
            "ChunkPolicy",
            "CollectiveTimeoutError",
            "ConfigError",
            "DDP",
            "DiLoCo",
            "ElasticBackend",
            "ElasticState",
            "FSDP",
            "FerroGrpcError",
            "Membership",
            "Peer",
            "PeerError",
            "ProtocolError",
            "QuorumLostError",
            "ShardLostError",
            "ReduceOp",
            "RendezvousError",
            "SUPPORTED_DTYPES",
            "TLSConfig",
            "Timeouts",
            "Work",
            "__version__",
            "init_backend",
            "testing",
        ]
    )
    for name in fg.__all__:
        assert hasattr(fg, name), name


def test_error_hierarchy() -> None:
    assert issubclass(fg.ConfigError, fg.FerroGrpcError) and issubclass(fg.ConfigError, ValueError)
    assert issubclass(fg.CollectiveTimeoutError, TimeoutError)
    for cls in (fg.RendezvousError, fg.PeerError, fg.ProtocolError):
        assert issubclass(cls, fg.FerroGrpcError)
    err = fg.PeerError(
        "gone", rank=2, world_size=4, op="all_reduce", seq=17, step=3, peer=1, peer_address="h:1"
    )
    assert str(err) == "[rank 2/4 all_reduce#17 step 3 peer 1 (h:1)] gone"


def test_reduce_op_strings() -> None:
    assert fg.ReduceOp.coerce("sum") is fg.ReduceOp.SUM
    assert fg.ReduceOp.coerce("MEAN") is fg.ReduceOp.MEAN
    with pytest.raises(fg.ConfigError):
        fg.ReduceOp.coerce("avg")


def test_options_validate() -> None:
    with pytest.raises(fg.ConfigError):
        fg.Timeouts(idle=0)
    with pytest.raises(fg.ConfigError):
        fg.ChunkPolicy(chunk_bytes=1)


def test_generated_code_has_no_drift() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gen_proto.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
