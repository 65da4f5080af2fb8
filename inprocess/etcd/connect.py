"""Opening a job's coordination store on etcd from the store setting (the wrapper's hook).

The store setting is ``store="etcd://h1:2379,h2:2379,h3:2379"`` (config, launcher flag or the
``INPROCESS_STORE`` environment variable, read by ``inprocess.protocol.environment``). Every rank,
its
monitor and its watchdog open their own client with ``open_store``; all of one job pass the same
``job_id`` so they share one namespace, and a later job (another id) never reads its keys.
"""

from __future__ import annotations

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.store import EtcdStore
from restartable.inprocess.etcd.url import parse_url


def job_prefix(url: str, job_id: str | None, *, round_: int = 0) -> str:
    """The key prefix of one job: the URL's path if it has one, else ``job_id``; in-job restart
    round ``round_`` > 0 (``inprocess.launch`` restarting every worker) gets its own
    sub-namespace, as the TCPStore gets a fresh server per round.

    Raises ``ConfigError`` when neither the URL nor ``job_id`` names the job."""
    prefix = parse_url(url).prefix or job_id
    if not prefix:
        raise ConfigError(
            f"store ({url!r}) needs a job id so that this job's keys never mix with another's: "
            "set INPROCESS_JOB_ID to the same value on every rank (or run under Slurm / "
            "torchrun, whose job id is used), or end the URL with /<job-id>"
        )
    return prefix if round_ == 0 else f"{prefix}/round{round_}"


def open_store(
    url: str,
    *,
    job_id: str | None,
    timeout: float,
    round_: int = 0,
    connect_timeout: float | None = None,
) -> EtcdStore:
    """A new client of the job's store on etcd (one per thread or process that needs one).

    ``timeout`` bounds the blocking gets and waits, ``connect_timeout`` (default: ``timeout``)
    connecting and every other call (``EtcdStore``); errors as ``EtcdStore``'s."""
    prefix = job_prefix(url, job_id, round_=round_)
    return EtcdStore(url, prefix=prefix, timeout=timeout, connect_timeout=connect_timeout)
