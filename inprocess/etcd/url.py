"""Parsing of ``etcd://host:port,host:port,.../prefix`` store URLs (``etcds://`` for TLS; pure,
no I/O). Credentials never go in the URL (``inprocess.etcd.security`` takes them from the
environment or files)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from restartable.inprocess.errors import ConfigError

SCHEME = "etcd://"
TLS_SCHEME = "etcds://"  # the same over TLS (https to every endpoint)
DEFAULT_PORT = 2379
# A job prefix becomes part of every key: keep it to characters that need no escaping anywhere.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


@dataclass(frozen=True)
class EtcdAddress:
    """Where the cluster is (``endpoints``, each ``(host, port)``, tried in order) and the job's
    key prefix from the URL's path (None when the URL has none)."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str | None = None
    tls: bool = False  # etcds://: https, the CA and client certificate of security.py

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def to_url(self, prefix: str | None = None) -> str:
        """The URL of these endpoints with ``prefix`` as its path (none when None)."""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        scheme = TLS_SCHEME if self.tls else SCHEME
        return f"{scheme}{hosts}" + (f"/{prefix}" if prefix else "")


def is_etcd_url(value: str) -> bool:
    """True when ``value`` selects the etcd backend (starts with ``etcd://`` or ``etcds://``)."""
    lowered = value.strip().lower()
    return lowered.startswith(SCHEME) or lowered.startswith(TLS_SCHEME)


def parse_url(url: str) -> EtcdAddress:
    """Parse ``etcd://host1:2379,host2:2379,host3[/prefix]`` (port 2379 when omitted; IPv6 hosts
    in brackets; ``etcds://`` for TLS). Raises ``ConfigError`` naming the URL, the bad part and
    the expected form; a URL with credentials (``user:password@``) is refused, naming the
    variables that take them."""
    form = "expected etcd://host:port[,host:port...][/job-prefix] (etcds:// for TLS)"
    if not isinstance(url, str) or not is_etcd_url(url):
        raise ConfigError(f"store URL ({url!r}) must start with {SCHEME} or {TLS_SCHEME}: {form}")
    tls = url.strip().lower().startswith(TLS_SCHEME)
    rest = url.strip()[len(TLS_SCHEME if tls else SCHEME) :]
    hosts, _, prefix = rest.partition("/")
    if "@" in hosts:
        # Not parsed as a host: a URL is visible in the process list, the launcher's command
        # line and the journal, so a password in it would leak (docs/security.md).
        raise ConfigError(
            f"store URL ({_redacted(url)!r}) holds credentials (user:password@host): they never "
            "go in the URL, which every process list shows; set INPROCESS_ETCD_USER and "
            "INPROCESS_ETCD_PASSWORD_FILE (a 0600 file holding the password) instead, and "
            "drop the user part from the URL (docs/etcd.md#tls-and-authentication)"
        )
    if not hosts:
        raise ConfigError(f"store URL ({url!r}) names no endpoint: {form}")
    endpoints = tuple(_endpoint(url, part, form) for part in hosts.split(","))
    prefix = prefix.strip("/")
    if prefix:
        check_prefix(prefix, where=f"store URL ({url!r}): the job prefix")
    return EtcdAddress(endpoints=endpoints, prefix=prefix or None, tls=tls)


def _redacted(url: str) -> str:
    """``url`` with whatever precedes an ``@`` in its host part replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    hosts, slash, path = rest.partition("/")
    return (
        f"{scheme}{sep}"
        + ",".join(f"***@{h.rpartition('@')[2]}" if "@" in h else h for h in hosts.split(","))
        + slash
        + path
    )


def check_prefix(prefix: str, *, where: str = "prefix") -> str:
    """Return ``prefix`` without outer slashes; ``ConfigError`` unless it is a non-empty run of
    letters, digits, '.', '_', '-' with single '/' between them (``where`` names the field)."""
    stripped = prefix.strip("/") if isinstance(prefix, str) else prefix
    if not isinstance(stripped, str) or not _PREFIX_RE.match(stripped):
        raise ConfigError(
            f"{where} {prefix!r} must be non-empty and hold only letters, digits, '.', '_', '-' "
            "and '/' between them: use the job id, for example 'job-4711'"
        )
    return stripped


# A job id names one namespace: no '/', so that no job's keys lie under another's (job "team"
# deleting its keys must not delete "team/exp1"'s). inprocess.launch appends "/round<k>" for its
# in-job restart rounds; a user's id cannot have that form, so a round never meets a real job.
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_ROUND_RE = re.compile(r"^[A-Za-z0-9._-]+(/round[1-9][0-9]*)?$")


def check_job_id(job_id: str, *, where: str, round_suffix: bool = False) -> str:
    """Return ``job_id``; ``ConfigError`` unless it is a non-empty run of letters, digits, '.',
    '_', '-' (``round_suffix``: also the ``<id>/round<k>`` that inprocess.launch gives its
    ranks)."""
    pattern = _ROUND_RE if round_suffix else _JOB_ID_RE
    if not isinstance(job_id, str) or not pattern.match(job_id):
        raise ConfigError(
            f"{where} {job_id!r} must be non-empty and hold only letters, digits, '.', '_' and "
            "'-' (no '/': a job's keys must not lie under another job's): for example 'job-4711'"
        )
    return job_id


def _endpoint(url: str, part: str, form: str) -> tuple[str, int]:
    part = part.strip()
    if part.startswith("["):  # [v6::addr]:port
        host, sep, port_s = part[1:].partition("]")
        port_s = port_s[1:] if port_s.startswith(":") else port_s
        if not sep or not host:
            raise ConfigError(f"store URL ({url!r}): endpoint {part!r} is malformed: {form}")
    else:
        host, _, port_s = part.partition(":")
    if not host or any(c in host for c in " @?#"):
        raise ConfigError(f"store URL ({url!r}): endpoint {part!r} has no valid host: {form}")
    if not port_s:
        return host, DEFAULT_PORT
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ConfigError(
            f"store URL ({url!r}): endpoint {part!r} has port {port_s!r}, not a TCP port "
            f"(1..65535): {form}"
        )
    return host, port
