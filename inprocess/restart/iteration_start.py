"""The start of an active rank's iteration: the join barrier, then the iteration's group and the
ready barrier.

Called by ``inprocess.restart.active.run_active`` on the main thread: ``join`` first, then
``create_group`` (from inside its handlers, once the monitor runs). Every wait is bounded by
``barrier_timeout``, or broken when a rank of the iteration is gone or faults meanwhile.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from restartable.inprocess.errors import RestartInterrupt
from restartable.inprocess.protocol import barriers, fault_records, keys
from restartable.inprocess.protocol.ranks import Assignment
from restartable.inprocess.protocol.store import Store
from restartable.inprocess.restart.process_group import init_iteration_group
from restartable.inprocess.restart.services import RankServices


def join(svc: RankServices, iteration: int, assignment: Assignment) -> bool:
    """The iteration's join barrier (blocks up to ``barrier_timeout``); False when a rank of
    ``assignment`` is gone meanwhile (the iteration is over before it began)."""
    with svc.progress.paused():
        svc.rendezvous.prepare(host=assignment.active[0])  # before joining: see its docstring
        return barriers.join_barrier(
            svc.store,
            iteration,
            expected=len(assignment.active),
            timeout=svc.config.barrier_timeout,
            clock=svc.clock,
            recheck=functools.partial(_break_if_gone, svc.store, iteration, assignment.active),
        )


def create_group(svc: RankServices, iteration: int, rank: int, active: tuple[int, ...]) -> None:
    """The iteration's group, then the ready barrier: nobody trains before every rank joined.

    A rank still inside gloo's connect when a peer faults could not be released until the
    init timeout.
    """
    world, host = len(active), active[0]
    try:
        init_iteration_group(
            svc.config,
            svc.rendezvous.store(host),
            iteration=iteration,
            rank=rank,
            world_size=world,
            local_rank=svc.local_rank,
        )
    except BaseException:
        svc.rendezvous.forget(host)  # the host may be gone: connect afresh next time
        raise
    if not svc.config.init_process_group:
        return
    with svc.progress.paused():
        if svc.rendezvous.hosted:
            # On etcd the store barrier costs two consensus round trips and a watch; a barrier
            # of the new group itself gives the same guarantee (it completes only once every
            # rank has the group) in a millisecond, and a peer that faults meanwhile tears its
            # group down, which fails this barrier at once, as it fails any collective.
            _group_barrier()
            return
        ready = barriers.ready_barrier(
            svc.store,
            iteration,
            expected=world,
            timeout=svc.config.barrier_timeout,
            clock=svc.clock,
        )
    if not ready:
        raise RestartInterrupt("a rank faulted while the group was created")


def _group_barrier() -> None:
    """``dist.barrier()`` on the default group (NCCL: on this rank's current device)."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def _break_if_gone(store: Store, iteration: int, active: tuple[int, ...]) -> bool:
    """Join recheck: an active rank that died during the restart breaks the barrier."""
    dead = keys.gone_ranks(store) & set(active)
    for r in sorted(dead):
        fault_records.report_fault(
            store,
            iteration=iteration,
            initial_rank=r,
            kind="dead",
            detail="lost during the restart",
        )
    return bool(dead)
