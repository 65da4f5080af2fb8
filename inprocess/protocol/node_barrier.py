"""The restart barrier by node, the rank's side: a rank meets its node's ranks on the node's own
store, and only its node's relay (``node_relay``) talks to the job's store for them.

Keys and call order, in the NODE-LOCAL store (a store on the node only; every key under
``it{n}/``, ``keys.key``)::

    start_node_iteration(local, n, members=..., nodes=...)   # every local rank, at the start
    iteration_end.wait_outcome(local, n, ...)                 # monitors: the relay copies ``end``
    decision = node_restart_barrier(local, job, n, initial_rank=me, decide=..., timeout=...)

* ``node/members``  the node's participants of iteration ``n`` (runs, ``ranks.encode_ranks``)
* ``node/nodes``    how many nodes take part in ``n`` (the job-wide node count's expected value)
* ``node/live``     appended by every live rank as it arrives (whom the relay may ask to decide)
* ``node/n``        the local count: each member once, alive (itself) or dead (its relay)
* ``node/full``     set by whoever completed the local count: the relay then counts the node
* ``node/order/j``  the relay's j-th order: ``decide:<rank>`` (that rank takes the decision and
                    publishes it on the job store) or ``go:<decision>`` (the end of the barrier)

A rank's calls to the job store in a restart: none, unless its relay names it the decider (it
then reads the faults and the respawn state and compare-and-sets ``restart/go``, as on the
per-rank path: ``restart_meeting.decide``). Every other wait is on the local store. Nothing here
imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import FaultRecord
from restartable.inprocess.protocol.barriers import wait_released
from restartable.inprocess.protocol.fault_records import read_faults
from restartable.inprocess.protocol.keys import key, peek, set_many
from restartable.inprocess.protocol.ranks import decode_ranks, encode_ranks
from restartable.inprocess.protocol.store import Store

# The environment variable naming the node-local store (``host:port``) the launcher hosts for
# its ranks; absent: the per-rank path (``restart_meeting``), as under plain torchrun or srun.
NODE_STORE_ENV = "RESTARTABLE_NODE_STORE"
ORDER_DECIDE = "decide:"
ORDER_GO = "go:"


def local_key(iteration: int, name: str) -> str:
    """A node-local key of iteration ``iteration`` (``node/<name>``)."""
    return key(iteration, f"node/{name}")


def go_key(iteration: int) -> str:
    """The job store's decision key, the same as the per-rank path's (``restart_meeting``)."""
    return key(iteration, "restart/go")


def start_node_iteration(
    local: Store, iteration: int, *, members: Collection[int], nodes: int
) -> None:
    """Every local rank when ``iteration`` starts (all write the same values; one local call):
    the node's participants and the number of participating nodes, which the relay reads."""
    if not members or nodes < 1:
        raise ValueError(
            f"start_node_iteration: members={sorted(members)!r}, nodes={nodes}: a node that "
            "takes part has at least one member and the job at least one node"
        )
    set_many(
        local,
        {
            local_key(iteration, "members"): encode_ranks(sorted(members)),
            local_key(iteration, "nodes"): str(nodes),
        },
    )


def node_members(local: Store, iteration: int) -> tuple[int, ...]:
    """The node's participants of ``iteration`` (``start_node_iteration``; () before)."""
    raw = peek(local, local_key(iteration, "members"))
    return () if raw is None else decode_ranks(raw.decode())


def count_local(local: Store, iteration: int, rank: int, *, by: str, expected: int) -> bool:
    """Count ``rank`` at the node's local barrier of ``expected`` members once (alive: by
    itself; dead: by the relay); True when this call completed it (``node/full`` = ``by``,
    first writer wins). Two local ``add`` calls, one more for the completing one."""
    n = local.count_arrival(local_key(iteration, "n"), str(rank))
    if n < expected:
        return False
    return local.compare_set(local_key(iteration, "full"), "", by).decode() == by


def node_restart_barrier(
    local: Store,
    job: Store,
    iteration: int,
    *,
    initial_rank: int,
    members: Collection[int],
    decide: Callable[[list[FaultRecord]], str],
    timeout: float,
    clock: Clock = SYSTEM,
) -> str:
    """A live participant's restart barrier on the node path; returns the decision (JSON).

    Called where the per-rank path calls ``restart_meeting.restart_barrier``, with the same
    ``decide``; ``members``: the node's participants (as given to ``start_node_iteration``).
    Blocks on the local store until the relay relays the job's decision, at most
    ``timeout`` seconds (``StoreTimeoutError`` naming the barrier). When the relay names this
    rank the node's decider, it decides on the job store's fault records and publishes
    (compare-and-set: the first decision published is everyone's) before it waits on."""
    me = str(initial_rank)
    deadline = clock.monotonic() + timeout
    local.append(local_key(iteration, "live"), f"{me},")  # before the count: the relay reads it
    count_local(local, iteration, initial_rank, by=me, expected=len(members))
    what = f"node restart barrier {iteration} (rank {me})"
    for j in range(1 << 16):  # one order per decider the relay names; bounded by the deadline
        order = wait_released(
            local, local_key(iteration, f"order/{j}"), deadline=deadline, clock=clock, what=what
        )
        assert order is not None  # no re-check: only a value or the deadline ends the wait
        if order.startswith(ORDER_GO):
            return order[len(ORDER_GO) :]
        if order == ORDER_DECIDE + me:
            published = decide(read_faults(job, iteration))
            return job.compare_set(go_key(iteration), "", published).decode()
    raise AssertionError(f"{what}: 65,536 orders without a decision")
