"""A restart is never delivered inside an import (it would leave a half-initialised module)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from inprocess.errors import RestartInterrupt
from inprocess.monitor import Interrupter


def test_delivery_waits_until_the_import_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slow_import_mod.py").write_text("import time\ntime.sleep(0.4)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    interrupter = Interrupter()
    interrupter.arm()
    outcomes: list[bool | None] = []

    def fire() -> None:
        time.sleep(0.1)  # the main thread is now inside the import's sleep
        while (result := interrupter.deliver()) is None:
            outcomes.append(None)
            time.sleep(0.005)
        outcomes.append(result)

    thread = threading.Thread(target=fire)
    thread.start()
    try:
        with pytest.raises(RestartInterrupt):
            import slow_import_mod  # noqa: F401

            time.sleep(10)  # the restart lands here, after the import completed
        assert sys.modules["slow_import_mod"].DONE
        assert outcomes[0] is None and outcomes[-1] is True
    finally:
        thread.join()
        while True:  # a delivery may race with disarm(); the contract is to loop
            try:
                interrupter.close()
                break
            except RestartInterrupt:
                continue
        sys.modules.pop("slow_import_mod", None)
