"""False removals under load: an elastic group trains for a while beside CPU
burners, and nobody may be removed.

Starts a coordinator and ``--nproc`` ranks of ``client.train --elastic``
(DDP, one JSON line per step) and ``--burners`` processes that spin on a
core, for ``--seconds`` from the group's first step. Then it reports the
steps trained, the epochs the group went through (1 means nobody was ever
removed), every removal the coordinator logged, and whether every member
logged the same loss and checksum at every step.

    python scripts/elastic_soak.py --nproc 4 --burners 2 --seconds 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from ferrogrpc.testing import free_port

    port = free_port()
    env = {
        **os.environ,
        "FERROGRPC_COORDINATOR": f"127.0.0.1:{port}",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    burn = "import time\nwhile True: pass"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(args.burners)]
    with tempfile.TemporaryDirectory(prefix="ferrogrpc-soak-") as tmp:
        log = Path(tmp) / "coordinator.log"
        coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "server", "--world-size", str(args.nproc)),
                *("--host", "127.0.0.1", "--port", str(port)),
            ],
            cwd=ROOT,
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        cmd = [sys.executable, "-m", "client.train", "--elastic", "--steps", "100000000"]
        cmd += ["--step-sleep", str(args.step_sleep)]
        outs = [Path(tmp) / f"rank{i}.log" for i in range(args.nproc)]
        ranks = [
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o.open("wb"), stderr=subprocess.STDOUT)
            for o in outs
        ]
        try:
            # The time counts from the group's first step, not from the
            # processes' start (imports, the first epoch).
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all(
                '{"rank"' in o.read_text(errors="replace") for o in outs
            ):
                if any(r.poll() is not None for r in ranks):
                    break
                time.sleep(0.2)
            start = time.monotonic()
            while time.monotonic() - start < args.seconds:
                if any(r.poll() is not None for r in ranks):
                    break
                time.sleep(0.5)
            exited = [r.poll() for r in ranks]
        finally:
            # The coordinator first: a rank killed while it still runs is a
            # death it logs as a removal ("ranks [0] dropped"), which the
            # end of the soak is not (seen once in a full test run).
            for p in [coordinator, *ranks, *burners]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        by_step: dict[int, set[tuple[float, float]]] = {}
        epochs: set[int] = set()
        for o in outs:
            for line in o.read_text(errors="replace").splitlines():
                if line.startswith('{"rank"'):
                    r = json.loads(line)
                    by_step.setdefault(r["step"], set()).add((r["loss"], r["checksum"]))
                    epochs.add(r["epoch"])
        text = log.read_text(errors="replace")
        removals = [
            line
            for line in text.splitlines()
            if "went silent" in line or ("dropped" in line and "ranks [] dropped" not in line)
        ]
        # The last step may be cut short by the kill: count complete ones.
        complete = [s for s, v in by_step.items() if len(v) == 1]
        differ = [s for s, v in by_step.items() if len(v) > 1]
        print(
            f"{args.nproc} ranks beside {args.burners} CPU burners for {args.seconds:g}s: "
            f"{len(by_step)} steps, epochs {sorted(epochs)}, removals {len(removals)}, "
            f"members differ at {len(differ)} steps"
        )
        for line in removals:
            print("  " + line)
        ok = not removals and not differ and all(e is None for e in exited) and complete
        print("OK: nobody removed" if ok else f"FAILED (exit codes {exited})")
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
