"""torchrun's spellings of the flags the launcher shares with it (``--nproc_per_node``,
``--master_addr``, ``--rdzv-id``, ``--nnodes 2:2``, ``--nproc-per-node gpu``), and a fix for each
torchrun flag it has no equivalent of."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

# torchrun's flags that have no launcher flag of the same meaning: what to give instead.
_TORCHRUN_ONLY = {
    "--rdzv-backend": "the job's store is node 0's launcher (default) or an etcd cluster: "
    "--store etcd://h1:2379,h2:2379,h3:2379 (docs/etcd.md)",
    "--rdzv-endpoint": "name node 0 with --master-addr HOST --master-port PORT, or an etcd "
    "cluster with --store etcd://HOST:2379,...",
    "--rdzv-conf": "the launcher has no rendezvous configuration: --node-timeout bounds the "
    "wait for the other nodes",
    "--standalone": "drop it: one node with its own store is the default",
    "--module": "give the path of the script instead (python -m restartable.launch ... train.py)",
    "-m": "give the path of the script instead (python -m restartable.launch ... train.py)",
    "--no-python": "the launcher runs Python scripts only: give the path of one",
    "--run-path": "give the path of the script as the first argument after the flags",
    "--start-method": "drop it: every rank is a new process (or forked from the warm pool)",
    "--log-dir": "drop it: each rank's output goes to the launcher's stdout as [rank N] lines",
    "--redirects": "drop it: each rank's output goes to the launcher's stdout as [rank N] lines",
    "--tee": "drop it: each rank's output goes to the launcher's stdout as [rank N] lines",
    "--local-ranks-filter": "drop it: every rank's output is shown, prefixed [rank N]",
    "--role": "drop it: every rank has the role 'default'",
    "--local-addr": "drop it: --master-addr names node 0's host",
}
# torchrun's name of a flag whose launcher name differs.
_ALIASES = {"--rdzv-id": "--job-id"}


def spell(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with torchrun's spellings of the launcher's flags rewritten as ours
    (``--nproc_per_node 4`` -> ``--nproc-per-node 4``, ``--rdzv-id`` -> ``--job-id``).

    Only the launcher's own flags, up to the script: the script's arguments are left as they
    are. A torchrun flag without an equivalent exits (``parser.error``) naming the fix."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):  # the script: the rest is its own
            return out + list(argv[i:])
        name, eq, value = token.partition("=")
        ours = name.replace("_", "-") if name.startswith("--") else name
        ours = _ALIASES.get(ours, ours)
        if ours in _TORCHRUN_ONLY:
            parser.error(f"{name} is torchrun's; the launcher has none: {_TORCHRUN_ONLY[ours]}")
        action = parser._option_string_actions.get(ours)  # argparse: no public table
        out.append(token if action is None else f"{ours}{eq}{value}")
        i += 1
        if action is not None and not eq and action.nargs is None and i < len(argv):
            out.append(argv[i])  # the flag's value, never a flag of its own
            i += 1
    return out


def nproc(text: str) -> int:
    """``--nproc-per-node``: a count, or torchrun's ``gpu`` (this node's GPUs), ``cpu`` (its
    cores) or ``auto`` (GPUs if any, else cores)."""
    if text in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count()
        if gpus or text == "gpu":
            if not gpus:
                raise argparse.ArgumentTypeError("'gpu' but this node has no GPU: give a count")
            return int(gpus)
    if text in ("cpu", "auto"):
        return os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of ranks: give a count (e.g. 4), gpu, cpu or auto"
        ) from None


def nnodes(text: str) -> int:
    """``--nnodes``: a count, or torchrun's ``N:N`` (an elastic range only where it is fixed)."""
    low, _, high = text.partition(":")
    try:
        counts = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of nodes: give e.g. 2"
        ) from None
    if counts[0] != counts[1]:
        raise argparse.ArgumentTypeError(
            f"{text!r} is an elastic range, and the launcher runs a fixed number of nodes "
            f"(ranks that leave are replaced by reserves, docs/launching.md): give --nnodes "
            f"{counts[1]}"
        )
    return counts[0]
