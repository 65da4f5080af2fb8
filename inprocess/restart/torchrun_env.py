"""The torchrun environment contract, kept true in every restart iteration.

torchrun scripts, Lightning and many libraries read RANK, WORLD_SIZE, LOCAL_RANK, ... instead of
asking ``torch.distributed``. After a restart renumbers the ranks (a reserve took a lost rank's
place, ``active_world_size`` < ranks started) their launch values are wrong, and code such as
``if int(os.environ["LOCAL_RANK"]) == 0: save_snapshot()`` silently stops running when the
process that had LOCAL_RANK 0 is gone. So the restart loop (``inprocess.restart.active``) writes the
current iteration's values before each call of ``train()``: this is the one write to os.environ
that DESIGN.md allows.

Meaning in an iteration (the same as torchrun's for the ranks that run ``train()``):

- ``RANK`` / ``WORLD_SIZE``: ``ctx.rank`` / ``ctx.world_size``; ``ROLE_RANK`` /
  ``ROLE_WORLD_SIZE`` the same (torchrun's single role).
- ``LOCAL_RANK``: this rank's index among the active ranks of its node, ordered by ``RANK``
  (0..LOCAL_WORLD_SIZE-1; exactly one active rank per node has 0). ``LOCAL_WORLD_SIZE``: how
  many ranks of its node are active.
- ``GROUP_RANK``: the index of its node among the nodes that have active ranks (ordered by
  their lowest ``RANK``); ``GROUP_WORLD_SIZE``: how many such nodes.
- ``INPROCESS_LAUNCH_LOCAL_RANK`` / ``INPROCESS_LAUNCH_GROUP_RANK``: the process's local rank
  and node at launch, which never change. The first is the device a GPU process owns: the
  framework binds it (``torch.cuda.set_device``); a script that binds ``LOCAL_RANK`` instead
  moves a reserve that took another's place to the lost rank's device (free, since its process
  is gone), away from what its prewarm put on its own.

MASTER_ADDR / MASTER_PORT are not rewritten: they name the job's store, which the framework
creates every iteration's group through (see docs/inprocess.md, "Porting a torchrun script").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence

from restartable.inprocess.protocol.ranks import node_index

LAUNCH_LOCAL_RANK = "INPROCESS_LAUNCH_LOCAL_RANK"
LAUNCH_GROUP_RANK = "INPROCESS_LAUNCH_GROUP_RANK"  # checkpoint.local reads it (node_key)


def iteration_env(
    *, me: int, active: Sequence[int], node_of: Sequence[int], launch_local_rank: int
) -> dict[str, str]:
    """The torchrun variables of identity ``me`` for an iteration whose active ranks (by
    identity, in rank order) are ``active``; ``node_of`` maps an initial rank to its node.

    Pure. Raises ``ValueError`` when ``me`` is not active (a reserve runs no ``train()``).
    """
    if me not in active:
        raise ValueError(f"identity {me} is not active in {tuple(active)}: only active ranks")
    rank = list(active).index(me)
    nodes: list[int] = []  # nodes with active ranks, by their lowest rank
    for r in active:
        n = node_index(r, node_of)
        if n not in nodes:
            nodes.append(n)
    mine = node_index(me, node_of)
    siblings = [r for r in active if node_index(r, node_of) == mine]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(active)),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(len(active)),
        "LOCAL_RANK": str(siblings.index(me)),
        "LOCAL_WORLD_SIZE": str(len(siblings)),
        "GROUP_RANK": str(nodes.index(mine)),
        "GROUP_WORLD_SIZE": str(len(nodes)),
        LAUNCH_LOCAL_RANK: str(launch_local_rank),
        LAUNCH_GROUP_RANK: str(mine),
    }


def export(values: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> None:
    """Write ``values`` into ``os.environ`` (main thread, before ``train()``; never blocks)."""
    target = os.environ if environ is None else environ
    target.update(values)
