"""The CPU a node-local write of one shard costs, three ways: why the local tier writes its
shards with ``pwrite`` (checkpoint/local/directory.py).

Run: ``python benchmarks/local_dir_write.py [--dir DIR] [--mib 1.6] [--reps 300]``. Prints one
JSON document. For a shard of ``--mib`` MiB (the example's state is 1.6 MB), in ``--dir`` (default:
a temporary directory; try a disk-backed one and ``/dev/shm``), the median thread CPU and wall
time of:

* ``pwrite``: what the tier's background thread does at each save: one ``os.pwrite`` of the
  packed shard into the page cache;
* ``o_direct``: the same write with ``O_DIRECT`` from a page-aligned buffer (no page-cache copy;
  the device is written at every save; ``null`` where the file system refuses it: tmpfs before
  Linux 6.6);
* ``mapped_copy`` / ``mapped_copy_after_writeback``: the training thread's copy of the state
  into a ``MAP_SHARED`` mapping of the file (the file would then be written by the copy
  itself),
  with the pages dirty, and right after they were written back (``fdatasync``, what the kernel's
  periodic writeback does to pages that stay dirty): a write-protected page faults on its next
  write;
* ``anonymous_copy``: the same copy into ordinary memory (the save's copy).

A run sleeps 10 ms between repetitions, as training does between saves.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

_PAGE = mmap.PAGESIZE


def _median_ms(
    op: Callable[[], object], reps: int, before: Callable[[], object] | None
) -> dict[str, float]:
    """Median thread CPU and wall time of ``op`` in ms; ``before`` runs untimed before each."""
    for _ in range(10):
        op()
    cpu, wall = [], []
    for _ in range(reps):
        if before is not None:
            before()
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        op()
        cpu.append(time.thread_time_ns() - c)
        wall.append(time.perf_counter_ns() - w)
        time.sleep(0.01)
    return {
        "cpu_ms": round(statistics.median(cpu) / 1e6, 3),
        "wall_ms": round(statistics.median(wall) / 1e6, 3),
    }


def _writes(path: Path, nbytes: int, reps: int) -> dict[str, dict[str, float] | None]:
    buf = mmap.mmap(-1, nbytes)  # anonymous mappings are page-aligned, as O_DIRECT requires
    buf.write(os.urandom(nbytes))
    view = memoryview(buf)
    out: dict[str, dict[str, float] | None] = {}
    for name, flags in (("pwrite", 0), ("o_direct", getattr(os, "O_DIRECT", None))):
        if flags is None:
            out[name] = None
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600)
        except OSError:  # a file system without O_DIRECT (tmpfs before Linux 6.6)
            out[name] = None
            continue
        try:
            out[name] = _median_ms(functools.partial(os.pwrite, fd, view, _PAGE), reps, None)
        except OSError:
            out[name] = None
        finally:
            os.close(fd)
    view.release()
    buf.close()
    return out


def _copies(path: Path, nbytes: int, reps: int) -> dict[str, dict[str, float]]:
    src = torch.rand(nbytes // 4)
    anon = torch.empty_like(src)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes, mmap.MAP_SHARED) as mm:
            out = {"anonymous_copy": _median_ms(functools.partial(anon.copy_, src), reps, None)}
            out.update(_mapped_copies(mm, src, fd, reps))
    finally:
        os.close(fd)
    return out


def _mapped_copies(
    mm: mmap.mmap, src: torch.Tensor, fd: int, reps: int
) -> dict[str, dict[str, float]]:
    """The copies into the file mapping; its tensor view ends with this call, so that the
    mapping can be closed after it."""
    copy = functools.partial(torch.frombuffer(mm, dtype=torch.float32).copy_, src)
    return {
        "mapped_copy": _median_ms(copy, reps, None),
        "mapped_copy_after_writeback": _median_ms(copy, reps, functools.partial(os.fdatasync, fd)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--mib", type=float, default=1.6, help="shard size in MiB")
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args()
    torch.set_num_threads(1)
    nbytes = max(_PAGE, int(args.mib * (1 << 20)) // _PAGE * _PAGE)
    with contextlib.ExitStack() as stack:
        root = args.dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path = root / f".local-dir-write-{os.getpid()}.bin"
        try:
            result = {
                "benchmark": "local_dir_write",
                "dir": str(root),
                "bytes": nbytes,
                **_writes(path, nbytes, args.reps),
                **_copies(path, nbytes, args.reps),
            }
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
