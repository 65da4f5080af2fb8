"""Authenticated store values: every value the framework writes carries a MAC over key and value.

The coordination store (torch's TCPStore, or etcd) has no access control: whoever reaches its port
can read, write and delete every key. A value is sealed with a per-job secret before it is
written and opened (verified) after it is read; a value that fails is rejected with
``ForgedValueError`` naming the key, and is never parsed. The secret is handed to a job's
processes privately (``job_secret``), never through the store. docs/security.md says what this
protects and what not.

Wire layout of a sealed value: one or more frames (``append`` adds one per call), each

    b"RSM1" | payload length (uint32, big endian) | HMAC-SHA256(secret, key, payload)[:16] | payload

The MAC covers the key, so a sealed value copied to another key fails (the iteration is in the
key: ``restartable/it3/end``); the secret itself is bound to one launch and one round
(``Sealer.derive``: ``inprocess.launch`` hands each round's ranks a key derived from the job's
secret, the launch id and the round), so a value sealed in another job or round fails too. It
does not cover which
frames an appended value holds, so frames of one key may be dropped, repeated or reordered by
someone with write access (they can delete the key anyway: every reader treats that as a fault).
Sealing is deterministic, so ``compare_set`` can compare sealed values.

Public API of every process of a job (launcher, fork server, srun task, ranks, watchdogs, store
servers): stdlib only, no torch import, so the light processes import it too. It lives in
``checkpoint``, the lower layer that ``inprocess`` depends on. The names in ``__all__`` are the
contract: ``Sealer`` and ``ForgedValueError`` (seal, open); the secret's hand-over
(``job_secret``, ``job_sealer``, ``new_secret``, ``take_from_environ``, ``handed``,
``child_env``, ``forget_shared_secret`` and the ``*_ENV`` variable names); ``parse_count`` (a
counter read back, which cannot be sealed). The secret file's directory is checked by
``checkpoint.private_files.private_dir``, the one rule for every private directory.
``inprocess`` seals store values through ``inprocess.protocol.sealed_store``;
``checkpoint.exchange`` seals its own values (it talks to the default process group's store
directly).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
import time
from collections.abc import Mapping
from pathlib import Path

from restartable.checkpoint.private_files import private_dir

__all__ = [
    "SECRETS_DIR_ENV",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "ForgedValueError",
    "Sealer",
    "child_env",
    "forget_shared_secret",
    "handed",
    "job_sealer",
    "job_secret",
    "new_secret",
    "parse_count",
    "take_from_environ",
]

MAGIC = b"RSM1"
_HEAD = struct.Struct(">4sI16s")  # magic, payload length, truncated MAC
HEAD_SIZE = _HEAD.size
# 128 bits of MAC: a forger must guess it; truncation to 16 bytes is the usual HMAC practice.
_MAC_BYTES = 16
SECRET_ENV = "RESTARTABLE_SECRET"  # hex; set by inprocess.launch for its ranks
SECRET_FILE_ENV = "RESTARTABLE_SECRET_FILE"  # a file (mode 0600, ours) that holds the hex secret
# How long a process waits for the first process of its job to create the shared secret file.
_SHARED_WAIT_S = 60.0
# Where job_secret keeps the secrets it makes for jobs started without inprocess.launch.
SECRETS_DIR_ENV = "RESTARTABLE_SECRETS_DIR"


class ForgedValueError(RuntimeError):
    """A store value is not sealed with this job's secret: someone else wrote it."""


class Sealer:
    """Seals and opens the values of one job (one secret). Immutable and thread-safe."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError(
                f"the job secret has {len(secret)} bytes; it must have at least 16: set "
                f"{SECRET_ENV} to 32 or more hex digits"
            )
        self._secret = secret
        # The keyed state, copied per MAC: HMAC's key set-up is paid once, not per value
        # (measured: ~2 us per MAC instead of ~9 us on the 2-core CI machine).
        self._keyed = hmac.new(secret, digestmod=hashlib.sha256)

    @property
    def secret(self) -> bytes:
        """The secret (to hand to a child process privately, e.g. in its environment)."""
        return self._secret

    def derive(self, *context: str) -> Sealer:
        """A sealer whose secret is bound to ``context`` (e.g. ``("launch", id, "round", "2")``):
        HMAC-SHA256(secret, context). A value sealed by one never opens with another, and the
        derived secret reveals nothing of this one (a rank holding its round's key cannot seal
        for another launch or round)."""
        label = "\0".join(("restartable-derive-v1", *context)).encode()
        return Sealer(hmac.new(self._secret, label, hashlib.sha256).digest())

    def _mac(self, key: str, payload: bytes) -> bytes:
        kb = key.encode()
        msg = struct.pack(">I", len(kb)) + kb + payload
        h = self._keyed.copy()  # copy() is thread-safe: the keyed state is never updated
        h.update(msg)
        return h.digest()[:_MAC_BYTES]

    def seal(self, key: str, value: str | bytes) -> bytes:
        """``value`` as one sealed frame for ``key``."""
        payload = value.encode() if isinstance(value, str) else bytes(value)
        return _HEAD.pack(MAGIC, len(payload), self._mac(key, payload)) + payload

    def open(self, key: str, raw: bytes) -> bytes:
        """The payload of ``raw`` (the concatenated payloads of its frames), read from ``key``.

        Raises ``ForgedValueError`` naming the key when any frame is malformed or its MAC fails:
        nothing of such a value is returned, so nothing of it is parsed.
        """
        raw = bytes(raw)
        out: list[bytes] = []
        pos = 0
        while pos < len(raw):
            if len(raw) - pos < HEAD_SIZE:
                raise _forged(key, "a truncated frame")
            magic, n, mac = _HEAD.unpack_from(raw, pos)
            payload = raw[pos + HEAD_SIZE : pos + HEAD_SIZE + n]
            if magic != MAGIC or len(payload) != n:
                raise _forged(key, "no sealed frame (not written by this job's processes)")
            if not hmac.compare_digest(mac, self._mac(key, payload)):
                raise _forged(key, "a MAC that does not match this job's secret")
            out.append(payload)
            pos += HEAD_SIZE + n
        if not out:
            raise _forged(key, "an empty value")
        return b"".join(out)


def _forged(key: str, what: str) -> ForgedValueError:
    return ForgedValueError(
        f"store key {key!r} holds {what}: rejected unread. Someone who can reach the store wrote "
        "or changed it; keep the store's port private to the job (docs/security.md)"
    )


# The secret this process was handed in its environment, taken out of it (take_from_environ).
_taken: str | None = None


def take_from_environ() -> None:
    """Move ``RESTARTABLE_SECRET`` out of ``os.environ`` into this module (idempotent): a
    process the user's script starts (``subprocess``, ``os.system``) does not inherit it.

    Called when this module is imported and by the rank's entry (``inprocess.rank_entry``,
    the warm pool's fork) before the user's script runs; ``job_secret`` reads it from here.
    A child of ours that needs it gets it explicitly (``child_env``)."""
    global _taken
    value = os.environ.pop(SECRET_ENV, None)
    if value:
        _taken = value


def handed() -> bool:
    """Whether this process was handed a secret (``RESTARTABLE_SECRET``, taken or not)."""
    return bool(os.environ.get(SECRET_ENV) or _taken)


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus the secret this process was handed, if any: the
    environment of a process of ours that seals (a store server the rank starts)."""
    env = dict(os.environ if base is None else base)
    if _taken and SECRET_ENV not in env:
        env[SECRET_ENV] = _taken
    return env


def parse_count(key: str, raw: bytes | str) -> int:
    """The integer ``raw`` read from ``key`` (a counter the store adds to, which cannot be
    sealed, or a sealed number). Raises ``ForgedValueError`` naming the key when it is not one:
    a stranger's write reads as what it is, never as a bare ``int()`` error."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        return int(text)
    except ValueError:
        raise _forged(key, f"{text[:40]!r}, not a count") from None


def new_secret() -> str:
    """A fresh job secret, as the hex text ``RESTARTABLE_SECRET`` holds."""
    return secrets.token_hex(32)


def job_secret(environ: Mapping[str, str] | None = None, *, create: bool = True) -> bytes | None:
    """This job's secret: ``RESTARTABLE_SECRET`` (hex, set by ``inprocess.launch``), else the
    file ``RESTARTABLE_SECRET_FILE`` names, else a per-user file shared by the processes of one
    job started without our launcher (torchrun, srun): the first process creates it (0600, in a
    0700 directory), the others wait for it. None when the environment names no job at all
    (no MASTER_ADDR/MASTER_PORT): a single process, nothing to authenticate.

    Called once per process by each user of the store (it reads a file at most); may block up
    to a minute for the first process of the job. ``create=False``: never create the shared
    file (a process that only reads, e.g. a watchdog).
    """
    env = os.environ if environ is None else environ
    handed = env.get(SECRET_ENV) or (_taken if environ is None else None)
    if handed:
        try:
            return bytes.fromhex(handed.strip())
        except ValueError:
            raise ValueError(
                f"{SECRET_ENV} is not hex: set it to the output of "
                "python -c 'import secrets; print(secrets.token_hex(32))'"
            ) from None
    if env.get(SECRET_FILE_ENV):
        return _read_private(Path(env[SECRET_FILE_ENV]))
    scope = _job_scope(env)
    if scope is None:
        return None
    return _shared_secret(_secrets_dir(env) / scope, create=create)


def forget_shared_secret(environ: Mapping[str, str]) -> None:
    """Remove the per-user secret file ``job_secret(environ)`` would share (none: nothing).

    Node 0's launcher calls it when its launch ends, so the next launch on the same address
    draws a fresh secret instead of reusing one that outlived its job (a launch that crashed
    leaves it; its keys per launch still differ: ``Sealer.derive``)."""
    if environ.get(SECRET_ENV) or environ.get(SECRET_FILE_ENV) or _taken:
        return  # the secret was given: no file of ours
    scope = _job_scope(environ)
    if scope is not None:
        (_secrets_dir(environ) / scope).unlink(missing_ok=True)


def _job_scope(env: Mapping[str, str]) -> str | None:
    """A file name that every process of one job derives alike: the store's address and the
    job's id (a later job on the same address and id reuses it: docs/security.md)."""
    if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")) and not env.get("INPROCESS_STORE"):
        return None
    parts = [
        env.get("INPROCESS_STORE", ""),
        env.get("MASTER_ADDR", ""),
        env.get("MASTER_PORT", ""),
        env.get("INPROCESS_JOB_ID") or env.get("SLURM_JOB_ID") or "",
        env.get("TORCHELASTIC_RUN_ID", ""),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _secrets_dir(env: Mapping[str, str]) -> Path:
    if env.get(SECRETS_DIR_ENV):
        return Path(env[SECRETS_DIR_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "restartable" / "secrets"


def _shared_secret(path: Path, *, create: bool) -> bytes:
    private_dir(path.parent, what="the job's secrets directory")
    if create and not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, new_secret().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, fails if another process was first: theirs wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    deadline = time.monotonic() + _SHARED_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the job's secret file {path} did not appear within {_SHARED_WAIT_S:.0f} s: the "
                f"job's processes do not share that directory; set {SECRET_ENV} (the same value "
                f"on every node) or {SECRET_FILE_ENV}"
            )
        time.sleep(0.05)
    return _read_private(path)


def _read_private(path: Path) -> bytes:
    """The hex secret in ``path``; refused unless this user owns it and nobody else may read it."""
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"secret file {path} must belong to this user and have mode 0600 (it has uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): chmod 600 {path}"
        )
    try:
        return bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise ValueError(f"secret file {path} does not hold hex digits: rewrite it") from None


# What names one job, alike in all its processes, where the scheduler or torchrun says it: a
# secret read from a file is bound to it (``job_sealer``). No restart count of torchrun's: an
# agent that joins a later rendezvous round counts differently from the others.
_JOB_NAMES = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def job_sealer(environ: Mapping[str, str] | None = None, *, create: bool = True) -> Sealer | None:
    """The job's sealer, or None where there is no job (see ``job_secret``).

    A secret handed in ``RESTARTABLE_SECRET`` is used as it is (``inprocess.launch`` hands its
    ranks a key already bound to their launch and round; a rank hands its watchdog its own).
    A secret read from a file (``RESTARTABLE_SECRET_FILE``, or the per-user file), which
    several jobs may share, is bound to the job the environment names (Slurm's job, step and
    requeue count, torchrun's run id): a value of one such job does not verify in another."""
    env = os.environ if environ is None else environ
    secret = job_secret(environ, create=create)
    if secret is None:
        return None
    sealer = Sealer(secret)
    if env.get(SECRET_ENV) or (environ is None and _taken):
        return sealer
    names = [f"{k}={env[k]}" for k in _JOB_NAMES if env.get(k)]
    return sealer.derive("job", *names) if names else sealer


take_from_environ()  # at import: before anything of the user's can start a process
