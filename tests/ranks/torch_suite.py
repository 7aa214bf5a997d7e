"""A rank program running tests of PyTorch's own distributed suite
(torch.testing._internal.distributed.distributed_test) with the backend set
to ``ferrogrpc``, all in one process group: ``torch_suite.py TEST...``.
Prints one ``RESULT {name: passed|skipped: why|failed: why}`` JSON line."""

from __future__ import annotations

import json
import os
import sys
import traceback
import unittest

os.environ.setdefault("BACKEND", "ferrogrpc")

import torch.distributed as dist
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)

import ferrogrpc  # noqa: F401 - registers the backend


class Suite(TestDistBackend, DistributedTest._DistTestBase):
    pass


def main() -> None:
    rank = int(os.environ["RANK"])
    temp = os.environ["TEMP_DIR"]  # shared by the ranks; the suite's helpers use it
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(temp, sub), exist_ok=True)
    dist.init_process_group("ferrogrpc")
    results: dict[str, str] = {}
    for name in sys.argv[1:]:
        case = Suite(name)
        case.rank = rank
        case.file_name = os.path.join(temp, "init_dir", "file")
        dist.barrier()
        try:
            getattr(case, name)()
            results[name] = "passed"
        except unittest.SkipTest as exc:
            results[name] = f"skipped: {exc}"
        except Exception:
            results[name] = "failed: " + traceback.format_exc()[-600:]
    dist.barrier()
    sys.stdout.write("RESULT " + json.dumps(results) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
