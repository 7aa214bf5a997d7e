"""Files another user or process wrote, or prepared (issue 55).

Where a rank writes (FERROGRPC_TRACE, FERROGRPC_FLIGHT_DIR): symlinks
planted at the names it writes are never followed, and a directory of
another user, or one every user may write without the sticky bit, is
refused at start-up with a ConfigError naming it and why (see [Note: files
in a shared directory] in ferrogrpc/observe/files.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from ferrogrpc.env import Settings
from ferrogrpc.errors import ConfigError, Identity, PeerError
from ferrogrpc.observe import flight, trace
from ferrogrpc.testing import local_group

pytestmark = pytest.mark.timeout(60)

PRECIOUS = "the user's own file: nothing of ferrogrpc's may land here\n"
NOBODY = 65534


def _victims(tmp_path: Path, names: list[str], folder: Path) -> list[Path]:
    """A file of the user's outside ``folder`` for each of ``names``, and a
    symlink to it planted at that name in ``folder``, as another user
    would."""
    victims = []
    for i, name in enumerate(names):
        victim = tmp_path / f"victim{i}"
        victim.write_text(PRECIOUS)
        (folder / name).symlink_to(victim)
        victims.append(victim)
    return victims


def test_a_flight_dump_follows_no_planted_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "flight"
    folder.mkdir()
    monkeypatch.setattr(flight, "_dumps", itertools.count(0))
    name = f"flight-rank00001-pid{os.getpid()}-0.json"
    # The file's name and the name it used to be written under first.
    victims = _victims(tmp_path, [name, f".{name}.tmp"], folder)
    recorder = flight.FlightRecorder(Identity(1, 2, ["a:1", "b:1"]), str(folder))
    path = recorder.dump(PeerError("rank 0 died", peer=0))
    assert path == folder / name
    assert [v.read_text() for v in victims] == [PRECIOUS] * 2
    # The link at the record's name was replaced by the record itself.
    assert not path.is_symlink() and flight.load(path)["rank"] == 1


async def test_a_trace_follows_no_planted_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "trace"
    folder.mkdir()
    monkeypatch.setattr(trace, "_files", itertools.count(0))
    # Every name the two ranks' files could take in this process (each
    # takes one of the first two numbers), and the spool's and the temporary
    # file's names as they used to be.
    names = [
        f"trace-rank{r:05d}-pid{os.getpid()}-{n}.json"
        for r, n in itertools.product(range(2), [0, 1])
    ]
    planted = [*names, *(f".{n}.tmp" for n in names), *(f".{n}.spool0" for n in names)]
    victims = _victims(tmp_path, planted, folder)
    async with local_group(2, settings=Settings(trace_dir=str(folder))) as peers:
        await asyncio.gather(*(p.all_reduce(torch.ones(8)) for p in peers))
    assert [v.read_text() for v in victims] == [PRECIOUS] * len(victims)
    written = [folder / n for n in names if not (folder / n).is_symlink()]
    assert len(written) == 2
    ranks = {trace.load(p)["otherData"]["rank"] for p in written}
    assert ranks == {0, 1}


@pytest.mark.parametrize("setting", ["trace_dir", "flight_dir"])
@pytest.mark.parametrize("hazard", ["writable by all, no sticky bit", "another user's"])
async def test_an_unsafe_directory_is_refused_at_start(
    tmp_path: Path, setting: str, hazard: str
) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    if hazard == "another user's":
        assert os.geteuid() == 0, "needs root to give a directory away (CI runs as root)"
        os.chown(folder, NOBODY, NOBODY)
        folder.chmod(0o1777)  # /tmp's mode: the owner still decides
        why = f"belongs to uid {NOBODY}"
    else:
        folder.chmod(0o777)
        why = "no sticky bit"
    with pytest.raises(ConfigError) as caught:
        async with local_group(2, settings=Settings(**{setting: str(folder)})):
            pass
    message = str(caught.value)
    assert str(folder) in message and why in message, message
    variable = "FERROGRPC_TRACE" if setting == "trace_dir" else "FERROGRPC_FLIGHT_DIR"
    assert variable in message, message
    assert list(folder.iterdir()) == []


def test_a_flight_dump_into_a_directory_taken_since_start_writes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Missing at start (it passes then), made by another user before the
    # rank breaks: the dump is refused and logged, never raised.
    folder = tmp_path / "later"
    recorder = flight.FlightRecorder(Identity(0, 2, ["a:1", "b:1"]), str(folder))
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    assert recorder.dump(PeerError("rank 1 died", peer=1)) is None
    assert list(folder.iterdir()) == []
    assert f"belongs to uid {NOBODY}" in caplog.text


async def test_a_directory_of_ones_own_with_the_sticky_bit_is_used(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    folder.chmod(0o1777)
    async with local_group(2, settings=Settings(trace_dir=str(folder))) as peers:
        await asyncio.gather(*(p.all_reduce(torch.ones(8)) for p in peers))
    assert len(list(folder.glob("trace-rank*.json"))) == 2
    assert json.loads(next(folder.glob("trace-rank*.json")).read_text())["otherData"]
