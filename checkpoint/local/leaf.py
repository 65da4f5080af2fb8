"""The leaves of a state as the local tier's walk finds them (``checkpoint.local.walk``), and
the marker of its replicated part: what the walk and its memo (``checkpoint.local.memo``) both
build on, below both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from restartable.checkpoint.local import sharded


class ReplicatedState(dict[str, Any]):
    """Marks the part of a state that is identical on every rank (plain data parallelism).

    ``state = {"model": ReplicatedState(model.state_dict()), "rng": rng_state}``: with
    ``local_algo="fully_parallel"`` each rank keeps and replicates only its share of the tensors
    under a ReplicatedState, and a restore broadcasts the shares. It is a plain dict to every other
    reader (the persistent tier, DCP), so it changes nothing there.
    """


@dataclass(slots=True)
class Leaf:
    """One leaf of a state: a tensor, a JSON scalar or an encoded object, and where it sits."""

    key: str
    value: Any
    container: Any  # the dict / list that holds it
    index: Any  # its key / position in `container`
    replicated: bool = False  # under a ReplicatedState
    # A DTensor's sharding (checkpoint.local.sharded); `value` is then its local shard.
    sharding: sharded.Sharding | None = None
