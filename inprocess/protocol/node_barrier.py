"""The restart barrier by node, the rank's side: a rank meets its node's ranks on the node's own
store, and only its node's relay (``node_relay``) talks to the job's store for them.

Keys and call order, in the NODE-LOCAL store (a store on the node only; every key under
``it{n}/``, ``keys.key``)::

    start_node_iteration(local, n, members=..., nodes=...)   # every local rank, at the start
    iteration_end.wait_outcome(local, n, ...)                 # monitors: the relay copies ``end``
    decision = node_restart_barrier(local, job, n, initial_rank=me, decide=..., timeout=...)

* ``node/members``  the node's participants of iteration ``n`` (runs, ``ranks.encode_ranks``)
* ``node/nodes``    how many nodes take part in ``n`` (the job-wide node count's expected value)
* ``node/n``        the local count, one integer of two bit fields: bit ``s`` is member ``s`` (its
                    place in ``members``) arrived alive, added by the member itself; bit
                    ``SLOTS + s`` member ``s`` counted dead, added by the relay. Each bit is added
                    once by one party, so the sum is their union: one ``add`` both counts a rank
                    and answers who is in (whom the relay may ask to decide: the alive bits)
* ``node/full``     set by the one ``add`` that covered every member (alive or dead): the relay
                    then counts the node
* ``node/order/j``  the relay's j-th order: ``decide:<rank>`` (that rank takes the decision and
                    publishes it on the job store) or ``go:<decision>`` (the end of the barrier)
* ``node/decided``  the decider rank's publish's answer (the decision published first), which
                    its relay relays instead of reading ``restart/go`` from the job store

A rank's calls to the job store in a restart: none, unless its relay names it the decider (it
then reads the faults and the respawn state and compare-and-sets ``restart/go``, as on the
per-rank path: ``restart_meeting.decide``). Every other wait is on the local store. Nothing here
imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import FaultRecord, InprocessError
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
# Members per node the local count holds: c10d's counter is a signed 64-bit integer, two fields.
SLOTS = 31


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
    _slot_bit(sorted(members), min(members), alive=True)  # at most SLOTS members: fail now
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


def _slot_bit(members: Sequence[int], rank: int, *, alive: bool) -> int:
    """The bit of ``node/n`` that counts ``rank`` (``members``: the node's, sorted)."""
    if len(members) > SLOTS:
        raise ValueError(
            f"node barrier: {len(members)} members on one node; at most {SLOTS} (two {SLOTS}-bit "
            "fields of one 64-bit counter): run such a node with --restart-by rank"
        )
    try:
        slot = members.index(rank)
    except ValueError:
        raise ValueError(
            f"node barrier: rank {rank} is not a member of this node ({list(members)})"
        ) from None
    return 1 << (slot if alive else SLOTS + slot)


def _covered(count: int, members: int) -> bool:
    """Every one of ``members`` slots counted, alive or dead, in ``count``."""
    everyone = (1 << members) - 1
    return (count | (count >> SLOTS)) & everyone == everyone


def count_local(
    local: Store, iteration: int, members: Sequence[int], rank: int, *, alive: bool, by: str
) -> bool:
    """Count ``rank`` at the node's local barrier of ``members`` (sorted): alive (the rank
    itself, once) or dead (its relay, once); True when this call completed the count (it then
    sets ``node/full`` = ``by``). One local ``add``; the completing caller one ``set`` more."""
    bit = _slot_bit(members, rank, alive=alive)
    count = local.add(local_key(iteration, "n"), bit)
    if not _covered(count, len(members)) or _covered(count - bit, len(members)):
        return False  # not complete, or completed before this add (by the other field)
    local.set(local_key(iteration, "full"), by)
    return True


def arrived_alive(local: Store, iteration: int, members: Sequence[int]) -> set[int]:
    """The members that arrived alive at the local barrier (one local ``add`` of 0)."""
    count = local.add(local_key(iteration, "n"), 0)
    return {r for s, r in enumerate(members) if count >> s & 1}


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
    (compare-and-set: the first decision published is everyone's) before it waits on.
    Local calls: one ``add`` to arrive (one ``set`` more for the rank that completes the
    count), then a ``wait`` and a ``get`` per order until the decision (the decider: one
    ``set`` of ``node/decided`` more)."""
    me = str(initial_rank)
    deadline = clock.monotonic() + timeout
    count_local(local, iteration, sorted(members), initial_rank, alive=True, by=me)
    what = f"node restart barrier {iteration} (rank {me})"
    j = 0  # one order per decider the relay names; the deadline bounds how many are read
    while True:
        order = wait_released(
            local, local_key(iteration, f"order/{j}"), deadline=deadline, clock=clock, what=what
        )
        if order is None:  # wait_released returns None only after a re-check, which is not asked
            raise InprocessError(f"{what}: the wait for order {j} ended without a value")
        if order.startswith(ORDER_GO):
            return order[len(ORDER_GO) :]
        if order == ORDER_DECIDE + me:
            published = decide(read_faults(job, iteration))
            got = job.compare_set(go_key(iteration), "", published).decode()
            # The relay waits for it here, not on the job store: one job-store call fewer.
            local.set(local_key(iteration, "decided"), got)
            return got
        j += 1
