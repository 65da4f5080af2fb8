"""A restart is never delivered inside an import (it would leave a half-initialised module)."""

from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

import pytest

from restartable.inprocess.errors import RestartInterrupt
from restartable.inprocess.restart.interrupter import Interrupter

_SYNC_S = 10.0  # real-time bound of each wait on the other thread: reached only when broken


def test_delivery_waits_until_the_import_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The imported module reports that its import is under way, then stays inside it until
    # released: the first delivery is made while the main thread is certainly in the import.
    gate = types.SimpleNamespace(entered=threading.Event(), release=threading.Event())
    monkeypatch.setitem(sys.modules, "slow_import_gate", gate)
    (tmp_path / "slow_import_mod.py").write_text(
        "import slow_import_gate as gate\n"
        "gate.entered.set()\n"
        f"gate.release.wait({_SYNC_S})\n"
        "DONE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    interrupter = Interrupter()
    interrupter.arm()
    outcomes: list[bool | None] = []

    def fire() -> None:
        try:
            if not gate.entered.wait(_SYNC_S):
                return  # the main thread's import never started: outcomes stays empty
            outcomes.append(interrupter.deliver())  # inside the import: deferred (None)
        finally:
            gate.release.set()
        deadline = time.monotonic() + _SYNC_S
        while (result := interrupter.deliver()) is None and time.monotonic() < deadline:
            outcomes.append(None)
            time.sleep(0.005)  # the monitor's retry cadence, not a head start
        outcomes.append(result)

    thread = threading.Thread(target=fire)
    thread.start()
    try:
        with pytest.raises(RestartInterrupt):
            import slow_import_mod  # noqa: F401

            time.sleep(_SYNC_S)  # the restart lands here, after the import completed
        assert sys.modules["slow_import_mod"].DONE
        assert outcomes[0] is None and outcomes[-1] is True, outcomes
    finally:
        thread.join()
        while True:  # a delivery may race with disarm(); the contract is to loop
            try:
                interrupter.close()
                break
            except RestartInterrupt:
                continue
        sys.modules.pop("slow_import_mod", None)
