"""One fault, once per job, for the unmodified torchrun scripts of the script-mode tests.

A module of the scripts' own folder (imported once per process: a restart keeps it). The fault
fires at ``step`` on the rank whose RANK is ``rank`` when ``marker`` does not exist yet, and
creates it first, so a re-run of the script (same process or a reserve) does not fire again.
"""

import os
import signal
import time


def maybe_fault(kind, at, rank, marker, step):
    if not kind or step != at or int(os.environ["RANK"]) != rank or os.path.exists(marker):
        return
    open(marker, "w").close()
    print(f"fault {kind} at step {step} on RANK {rank} (pid {os.getpid()})", flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected fault at step {step}")
    if kind == "hang":
        time.sleep(3600)  # a hung rank: no progress, the soft timeout ends it
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
