"""Issue 47: the launcher's store server does not print torch's C++ warnings about reset
client connections (a SIGKILLed rank's) on the job's console (inprocess/launch/torch_log.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.multiproc import REPO_ROOT

# A libuv TCPStore server, as the launcher hosts one, and 50 client connections closed with a
# reset, as a killed rank's are: torch warns "TCPStoreLibUvBackend.cpp ... [c10d] The remote
# address of the client socket cannot be retrieved" on each one it accepts after the reset.
_SERVE = """
import os, socket, struct, sys, time
{prelude}
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
for _ in range(50):
    c = socket.create_connection(("127.0.0.1", s.port))
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()
time.sleep(0.5)
print("level after import:", os.environ.get("TORCH_CPP_LOG_LEVEL"))
"""
_QUIET = "from restartable.inprocess.launch.torch_log import import_torch_quietly as quiet; quiet()"


def _serve(prelude: str) -> str:
    code = _SERVE.format(prelude=prelude)
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def test_the_launchers_torch_import_silences_the_store_servers_reset_warnings() -> None:
    assert "TCPStoreLibUvBackend" in _serve("")  # the noise, without the launcher's import
    quiet = _serve(_QUIET)
    assert "TCPStoreLibUvBackend" not in quiet, quiet
    assert "level after import: None" in quiet  # the ranks get the user's environment
