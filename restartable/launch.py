"""``python -m restartable.launch``: the per-node launcher, the short name users type for
``python -m restartable.inprocess.launch`` (docs/launching.md); both run the same code."""

import runpy

if __name__ == "__main__":
    runpy.run_module("restartable.inprocess.launch", run_name="__main__", alter_sys=True)
