"""What a thread (the main thread, seen from the monitor's) is doing now, read from its stack.

Called by the monitor threads (``inprocess.restart.monitor``: a grace for a rank that waits on
its peers, the stack in the soft timeout's log), by ``Interrupter.deliver`` (no restart inside an
import) and by ``inprocess.restart.raised`` (a raise site where ranks wait on their peers). Never
blocks; another thread's stack is read through the CPython fence (``inprocess._cpython_private``).
"""

from __future__ import annotations

import traceback

from restartable.inprocess._cpython_private import current_frame

# Code in which a main thread that makes no progress is waiting for its peers, not hung itself:
# collectives, and autograd (where DDP waits for its gradient all-reduce).
_PEER_WAIT_PATHS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/distributed.py")


def waiting_on_peers(thread_id: int) -> bool:
    """Whether the thread is inside a collective (or a backward pass that waits on one).

    When one rank hangs, its peers stall in the next collective after about the same time. The
    hung rank's own monitor must report first, or the fault is blamed on a waiting rank (and a
    healthy rank could be retired for it): a waiting rank gets a grace beyond soft_timeout.
    """
    frame = current_frame(thread_id)
    while frame is not None:
        if waits_on_peers(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def waits_on_peers(filename: str) -> bool:
    """Whether code in ``filename`` is where a rank waits on its peers (``_PEER_WAIT_PATHS``)."""
    return any(part in filename for part in _PEER_WAIT_PATHS)


def where(thread_id: int, depth: int = 6) -> str:
    """The innermost frames of the thread's stack, for the log (what a user must look at)."""
    frame = current_frame(thread_id)
    if frame is None:
        return "  (thread gone)"
    return "".join(traceback.format_stack(frame)[-depth:]).rstrip()


def in_import(thread_id: int) -> bool:
    """Whether the thread is executing an import right now.

    An exception raised inside an import leaves a half-initialised module in ``sys.modules``:
    every later ``import`` of it then fails the same way (seen: DDP's lazy ``torch._dynamo``
    import interrupted once, every later iteration failed on ``torch._dynamo.utils``). So
    deliveries wait for the import to finish.
    """
    frame = current_frame(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
