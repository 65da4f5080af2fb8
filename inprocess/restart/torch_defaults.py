"""Process groups that torch modules keep as default arguments: released at a restart.

Private torch behaviour, kept in this one module (tests/unit/test_group_release.py fails when
torch changes it). ``torch.distributed.nn.functional`` (imported by the first
``DistributedDataParallel``) binds ``group=group.WORLD`` as a default argument of each of its
collectives when it is imported: iteration 0's default group, kept for the life of the
process. That reference kept the destroyed group's sockets open after every restart (peers
blocked on this rank waited for the group timeout) and made the reaper's warning blame user
code that already built DDP inside ``train()``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

# Modules whose functions bind a process group as a default argument at import time.
_MODULES = ("torch.distributed.nn.functional",)


def release_module_defaults(groups: Iterable[Any]) -> int:
    """Replace ``groups`` in the default arguments of ``_MODULES``' functions by None (which
    torch's collectives read as "the current default group", what the default meant when it
    was bound); returns how many defaults changed.

    Called right after the groups are destroyed (``inprocess.restart.abort``; main or monitor
    thread, under the reaper's lock); modules not imported are skipped. Never blocks.
    """
    dead = {id(g) for g in groups}
    if not dead:
        return 0
    changed = 0
    for name in _MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for fn in list(vars(module).values()):
            defaults = getattr(fn, "__defaults__", None)
            if defaults and any(id(d) in dead for d in defaults):
                fn.__defaults__ = tuple(None if id(d) in dead else d for d in defaults)
                changed += 1
            kw = getattr(fn, "__kwdefaults__", None)
            if kw and any(id(v) in dead for v in kw.values()):
                fn.__kwdefaults__ = {k: None if id(v) in dead else v for k, v in kw.items()}
                changed += 1
    return changed
