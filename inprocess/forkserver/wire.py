"""What the launcher's pool (``inprocess.launch.pool``) and the fork server
(``inprocess.forkserver.server``) both say on their connection: the server's ready line on its
stdout, and the largest request the server reads (the protocol: ``server``'s docstring)."""

from __future__ import annotations

READY_LINE = b"ready\n"
MAX_REQUEST = 1 << 20  # bytes of one request (the environment dominates: tens of KB)
