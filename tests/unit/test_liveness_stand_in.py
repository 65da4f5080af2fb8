"""A killed launcher's stand-in (``inprocess.srun_task``) keeps node 0's store up for its read
of the job's end, but never keeps a restart from counting the killed launcher's node gone.

Found on a real Slurm cluster (tests/slurm/test_sbatch_scripts.py, the loss of one launcher):
the stand-in wrote the launcher's own beat, so node 0's relay never saw node 1 gone, the
restart waited out --node-timeout (120 s) and the job was requeued instead of going on."""

from __future__ import annotations

import torch.distributed as dist

from restartable.inprocess.launch.control_store import ControlStore
from restartable.inprocess.launch.liveness import Liveness
from restartable.inprocess.protocol.store import C10dStore
from tests.fake_clock import FakeClock

STALE_S = 2.0


def _node0(store: C10dStore, fake: FakeClock) -> Liveness:
    control = ControlStore(store, "launch/")
    return Liveness(
        control, node_rank=0, nnodes=2, beat_stale=STALE_S, node_timeout=10.0, clock=fake.clock()
    )


def test_a_stand_in_beating_keeps_the_store_up_but_the_node_counts_gone() -> None:
    fake = FakeClock()
    store = C10dStore(dist.HashStore())
    node0 = _node0(store, fake)
    store.set("launch/beat/1", "7")  # node 1's launcher beat, then was SIGKILLed
    assert node0.gone_nodes() == frozenset()
    for i in range(5):  # its stand-in beats on its own key every 0.5 s
        store.set("launch/standin/1", str(i))
        fake.advance(0.5)
        node0.gone_nodes()
    assert node0.gone_nodes() == frozenset({1}), "a restart must count node 1 gone"
    # ... while node 0's wait before it leaves still waits for the stand-in's read
    assert node0._still_there(1, stand_in=True)
    fake.advance(STALE_S)  # the stand-in read the end and stopped beating
    assert not node0._still_there(1, stand_in=True)


def test_a_live_launcher_is_never_counted_gone() -> None:
    fake = FakeClock()
    store = C10dStore(dist.HashStore())
    node0 = _node0(store, fake)
    for i in range(10):
        store.set("launch/beat/1", str(i))
        fake.advance(0.5)
        assert node0.gone_nodes() == frozenset()
