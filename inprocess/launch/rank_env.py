"""The environment of one rank process: the launcher's own environment, torchrun's variables
(with torchrun's defaults) and the launcher's. ``inprocess.launch.launcher_round`` asks for it
per process it starts (cold or from the warm pool)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from restartable.inprocess import journal
from restartable.inprocess.protocol import environment


def rank_env(
    args: argparse.Namespace,
    local_rank: int,
    port: int,
    generation: int = 0,
    store_env: Mapping[str, str] | None = None,
    *,
    round_: int = 0,
    launch_id: str | None = None,
) -> dict[str, str]:
    """The environment of one rank (the launcher's own environment plus the job variables).

    ``generation`` > 0: a process respawned in the slot of ``local_rank``; it keeps the slot's
    RANK and joins the job under a new identity (``inprocess.protocol.ranks.respawn_identity``).
    ``store_env``: the round's key (RESTARTABLE_SECRET) and, with ``--store``, its
    INPROCESS_STORE / INPROCESS_JOB_ID.
    ``round_``: the in-job restart round (INPROCESS_LAUNCH_ROUND; the config's fault drill
    fires in round 0 only). ``launch_id``: RESTARTABLE_LAUNCH_ID, the same on every node and
    in every round (the journal groups a launch's records by it; the example names its
    directories after it).
    """
    n = args.nproc_per_node
    inherited = dict(os.environ)
    for name in ("INPROCESS_STORE", "INPROCESS_JOB_ID"):  # this round's values, or none
        inherited.pop(name, None)
    env = {
        **torchrun_defaults(n, inherited),
        **inherited,
        **(store_env or {}),
        "RANK": str(args.node_rank * n + local_rank),
        "WORLD_SIZE": str(args.nnodes * n),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": str(args.node_rank),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(port),
        **_launcher_vars(args, round_),
        **_torchrun_names(args, args.node_rank * n + local_rank, round_),
    }
    if launch_id is not None:
        env[journal.ENV_LAUNCH] = launch_id
    if generation:
        env["INPROCESS_RESPAWN_GENERATION"] = str(generation)
    else:
        env.pop("INPROCESS_RESPAWN_GENERATION", None)
    return env


def _launcher_vars(args: argparse.Namespace, round_: int) -> dict[str, str]:
    """The launcher's own variables of a rank (``rank_env``)."""
    return {
        "INPROCESS_STORE_HOSTED": "1",
        # The ranks die with us (the store we host dies with us too): see bind_to_launcher().
        "INPROCESS_LAUNCHER_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
        "INPROCESS_LAUNCH_ROUND": str(round_),
        # So a script can tell whether a lost rank comes back (e.g. the example's warning
        # when its fault plan loses more ranks than it has reserves).
        "INPROCESS_MAX_RESPAWNS": str(getattr(args, "max_respawns", 0)),
        environment.ENV_ATTEMPT: str(getattr(args, "attempt", 0)),
    }


def _torchrun_names(args: argparse.Namespace, rank: int, round_: int) -> dict[str, str]:
    """torchrun's names for the facts ``rank_env`` sets, for scripts and libraries that read
    them."""
    return {
        "GROUP_WORLD_SIZE": str(args.nnodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(args.nnodes * args.nproc_per_node),
        "TORCHELASTIC_RESTART_COUNT": str(round_),
        "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts),
        # A store server listens at MASTER_ADDR:MASTER_PORT (ours, as torchrun's agent store):
        # a script's own init_process_group("env://") connects to it instead of binding
        # MASTER_PORT on rank 0 (EADDRINUSE there, and the other ranks waited for rank 0 until
        # the init timeout); @restartable then names the misuse (inprocess.restart.loop).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def torchrun_defaults(nproc_per_node: int, environ: Mapping[str, str]) -> dict[str, str]:
    """What torchrun sets unless the user did: ``OMP_NUM_THREADS=1`` with several ranks per
    node (each rank's intra-op pool would otherwise take every core: measured, nanoGPT's step
    took 3x as long), ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``. A value in ``environ`` wins."""
    defaults = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    if nproc_per_node > 1:
        defaults["OMP_NUM_THREADS"] = "1"
    return {k: v for k, v in defaults.items() if k not in environ}
