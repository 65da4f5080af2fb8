"""Entry point of one rank started by ``tests.multiproc.run_ranks(target=...)``.

Usage: ``python -m tests._rank_main module:function kwargs.json``. Calls ``function(**kwargs)``
and writes its JSON return value to ``$TEST_RESULT_DIR/result.$RANK.json``. An exception
propagates (traceback on stderr, exit status 1), so the test sees it.

After a successful return the process leaves with ``os._exit(0)`` once stdio is flushed: a
gloo group object that outlives ``destroy_process_group()`` (a cached DeviceMesh keeps one)
is destroyed during interpreter finalization, and torch's gloo threads then abort the process
now and then ("terminate called without an active exception", SIGABRT; pytorch#190489). That
happens after everything the test asserts, in torch's teardown, not in ours.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path


def main() -> None:
    target, kwargs_file = sys.argv[1], sys.argv[2]
    module_name, _, func_name = target.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    # The launch RANK, read now: @restartable rewrites RANK for each iteration's train().
    out = Path(os.environ["TEST_RESULT_DIR"]) / f"result.{os.environ['RANK']}.json"
    result = func(**json.loads(Path(kwargs_file).read_text()))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
