"""The CPU launcher (``mori_jit.testing.distributed``) tears a worker down in order: whatever of the
job still holds the process group through a reference cycle is released while the group lives; and
a job that hangs shows where each live worker is before the workers are killed."""
from __future__ import annotations

import time
import weakref

import pytest

import torch.distributed as dist

from mori_jit.testing.distributed import run_distributed


class _Holder:
    """An object in a reference cycle (as an op kept alive by a caught exception's traceback is)."""

    def __init__(self, group):
        self.group, self.me = group, self


def _note_group_state(path: str) -> None:
    with open(path, "w") as f:
        f.write("alive" if dist.is_initialized() else "destroyed")


def _cycle_job(rank, ws, folder):
    holder = _Holder(dist.group.WORLD)
    # runs when the cycle is collected, or at interpreter exit if it never is
    weakref.finalize(holder, _note_group_state, f"{folder}/rank{rank}")


def test_cycles_holding_the_group_go_before_the_group(tmp_path):
    run_distributed(_cycle_job, 2, str(tmp_path), timeout=60)
    states = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert states == {"rank0": "alive", "rank1": "alive"}, states


def _stuck_job(rank, ws):
    if rank == 1:
        _wait_for_a_peer_that_never_comes()
    time.sleep(0.1)


def _wait_for_a_peer_that_never_comes():
    time.sleep(600)


def test_a_hung_job_prints_where_each_live_worker_is_before_it_is_killed(capfd):
    with pytest.raises(TimeoutError, match="did not finish within 20"):
        run_distributed(_stuck_job, 2, timeout=20)
    err = capfd.readouterr().err
    assert "_wait_for_a_peer_that_never_comes" in err and "_stuck_job" in err, err[-3000:]
