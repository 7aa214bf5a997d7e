"""ElasticState's transfer of the group's state to a joiner (issue 55):
a joiner whose optimizer differs is refused with a ConfigError naming the
difference, and the members go on; an optimizer state of tensors, plain
values and lists of them (LBFGS) reaches a joiner whole; a corrupt state
header is a ProtocolError naming its sender, found before anything is
allocated. Real processes: a coordinator and ``tests/ranks/elastic_optim.py``
or ``elastic_train.py`` ranks, started by test_elastic.py's ``Run``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .helpers import spawn_rank
from .test_elastic import Run, check_training


class OptimRun(Run):
    """A Run whose ranks are elastic_optim.py processes (OPTIM in env)."""

    def start_rank(self, **env: str) -> Any:
        proc = spawn_rank("elastic_optim.py", env={**self.env, **env})
        self.procs.append(proc)
        return proc


def _refused(run: Run, proc: int) -> list[dict[str, Any]]:
    return [d for d in run.lines(proc) if d.get("event") == "refused"]


def _trained(run: Run, proc: int) -> list[dict[str, Any]]:
    return [d for d in run.lines(proc) if "idx" in d]


@pytest.mark.timeout(55)
def test_a_joiner_with_another_optimizer_is_refused_and_the_members_go_on(
    tmp_path: Path,
) -> None:
    # Two Adam members train; an SGD joiner and an Adam joiner with other
    # betas arrive. Each is refused with a ConfigError naming the first
    # difference, and leaves; the members lose no step and end equal to
    # single-process training.
    steps = 70
    run = OptimRun(tmp_path, 2, OPTIM="adam", STEPS=str(steps), WORLD="3", SLOW="0.1")
    try:
        run.wait_for(lambda: _trained(run, 0), 30, "no step")
        sgd = len(run.procs)
        run.start_rank(OPTIM="sgd")
        betas = len(run.procs)
        run.start_rank(OPTIM="adam-betas")
        for joiner in (sgd, betas):
            run.wait_for(lambda j=joiner: _refused(run, j), 30, f"process {joiner} not refused")
            run.wait_for(lambda j=joiner: run.procs[j].poll() is not None, 10, "it stayed")
        codes = run.finish(40)
    finally:
        run.close()
    assert codes == [0, 0, 4, 4], (codes, run.output())
    assert (
        "optimizer differs from the group's: class SGD vs Adam" in (_refused(run, sgd)[0]["error"])
    )
    assert (
        "param_groups[0]['betas']: (0.9, 0.99) vs (0.9, 0.999)"
        in (_refused(run, betas)[0]["error"])
    )
    assert not _trained(run, sgd) and not _trained(run, betas)
    check_training(run, steps)
