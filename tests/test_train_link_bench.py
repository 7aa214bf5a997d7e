"""``client/bench_train_link.py`` on a shaped link (one rank per network
namespace): what each implementation puts on the wire per training step,
counted by the links themselves. int8 DDP sends about a quarter of float32
DDP's bytes, DiLoCo (H = 10, bf16) about a twentieth, the link's ceiling for DiLoCo (a
plain socket) the same bytes as DiLoCo, and every DDP and DiLoCo rank ends
with the same model. Needs root (ip netns, tc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, clean_env


@pytest.mark.timeout(90)
def test_the_training_link_bench_counts_int8_and_diloco_bytes_on_the_wire(
    tmp_path: Path,
) -> None:
    assert os.geteuid() == 0, "needs root for ip netns and tc (CI runs as root)"
    figures = tmp_path / "lm.json"
    ddp, int8, diloco = "ferrogrpc DDP", "ferrogrpc DDP int8", "DiLoCo H=10 F=2 bf16"
    raw = "raw TCP, DiLoCo's bytes"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "client.bench_train_link", "--link", "1gbit"),
            *("--what", "lm", "--steps", "20", "--sync-every", "10", "--fragments", "2"),
            *("--outer-lr", "1.0", "--outer-momentum", "0.0", "--json", str(figures)),
            # Turns of 7 steps (ending after steps 6, 13, 20): DiLoCo's
            # exchange that starts after step 5 (F=2, H=10: starts after 5,
            # 10, 15, 20, each applied 5 steps later) is still in flight when
            # the first turn ends.
            *("--block", "7", "--only", ddp, int8, diloco, raw),
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=80,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    results = json.loads(figures.read_text())["results"]
    sent = {name: results[name]["sent_per_step"] for name in (ddp, int8, diloco, raw)}
    params = 1_854_342  # client/charlm.py's model
    # A ring all_reduce at world 2 sends the tensor once: 4 bytes a parameter.
    assert 1.0 <= sent[ddp] / (4 * params) < 1.1, sent
    assert 0.2 < sent[int8] / sent[ddp] < 0.3, sent  # 1 + 4/256 bytes, not 4
    # Each fragment syncs twice in 20 steps, the whole model in bf16 (2 bytes
    # a parameter): a twentieth of DDP's bytes (the exchange started at step
    # 20 is waited for at the end of the last turn, and counted).
    assert 0.025 < sent[diloco] / sent[ddp] < 0.06, sent
    # The ceiling sends what DiLoCo sends, at the same steps, unframed.
    assert 0.8 < sent[raw] / sent[diloco] < 1.1, sent
    assert results[raw]["blocked"] is not None and results[raw]["blocked"] < 0.5, results[raw]
    # DiLoCo's too: diloco.sync() ends its training (each fragment was last
    # synced at another step, and the ranks trained apart since).
    for name in (ddp, int8, diloco):
        assert results[name]["same"], (name, results[name])
    for name, r in results.items():
        assert r["loss"] < 4.6, (name, r)  # below the first step's (ln 102 = 4.62)
