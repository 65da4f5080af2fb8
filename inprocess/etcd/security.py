"""TLS and authentication of the etcd clients, from the environment or files (never the URL or
the command line, which every process list shows).

Variables (read here, once per client; inprocess.launch's ranks and watchdogs inherit them):

* ``INPROCESS_ETCD_CA``        CA certificate file that signed the members' certificates
                               (``etcds://`` without it: the system's CAs)
* ``INPROCESS_ETCD_CERT``, ``INPROCESS_ETCD_KEY``
                               client certificate and its key (etcd's ``--client-cert-auth``)
* ``INPROCESS_ETCD_USER``      user of etcd's authentication (``etcd --auth``: users and roles)
* ``INPROCESS_ETCD_PASSWORD_FILE``
                               a file holding that user's password (one line; must not be
                               readable by group or others), or ``INPROCESS_ETCD_PASSWORD``
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from restartable.inprocess.errors import ConfigError

ENV_CA = "INPROCESS_ETCD_CA"
ENV_CERT = "INPROCESS_ETCD_CERT"
ENV_KEY = "INPROCESS_ETCD_KEY"
ENV_USER = "INPROCESS_ETCD_USER"
ENV_PASSWORD_FILE = "INPROCESS_ETCD_PASSWORD_FILE"
ENV_PASSWORD = "INPROCESS_ETCD_PASSWORD"


@dataclass(frozen=True)
class EtcdCredentials:
    """How a client proves who it is and checks whom it talks to (all optional).

    ``ca_file``: PEM CA bundle for the members' certificates; ``cert_file`` / ``key_file``: the
    client certificate; ``user`` / ``password``: etcd's own authentication (a token is asked
    for with them, per endpoint, and sent with every request)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password: str | None = None

    def __repr__(self) -> str:  # never the password, in a log or a traceback
        hidden = None if self.password is None else "***"
        return (
            f"EtcdCredentials(ca_file={self.ca_file!r}, cert_file={self.cert_file!r}, "
            f"key_file={self.key_file!r}, user={self.user!r}, password={hidden!r})"
        )

    @property
    def needs_tls(self) -> bool:
        """A CA or a client certificate only make sense over TLS (``etcds://``)."""
        return any(x is not None for x in (self.ca_file, self.cert_file, self.key_file))


def credentials_from_env(env: Mapping[str, str] | None = None) -> EtcdCredentials:
    """The credentials the ``INPROCESS_ETCD_*`` variables name (see the module docstring).

    Raises ``ConfigError`` naming the variable for a file that does not exist, a certificate
    without its key (or the reverse), a password without a user, or a password file that
    group or others can read."""
    env = os.environ if env is None else env

    def var(name: str) -> str | None:
        value = env.get(name, "").strip()
        return value or None

    ca, cert, key = var(ENV_CA), var(ENV_CERT), var(ENV_KEY)
    for name, path in ((ENV_CA, ca), (ENV_CERT, cert), (ENV_KEY, key)):
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name} ({path!r}) is not a file: name the PEM file, or unset it")
    if (cert is None) != (key is None):
        raise ConfigError(
            f"{ENV_CERT} ({cert!r}) and {ENV_KEY} ({key!r}) go together: set both (the client "
            "certificate and its key) or neither"
        )
    user = var(ENV_USER)
    password = _password(env, var(ENV_PASSWORD_FILE))
    if password is not None and user is None:
        raise ConfigError(
            f"a password is set ({ENV_PASSWORD_FILE} or {ENV_PASSWORD}) but {ENV_USER} is not: "
            "set the etcd user it belongs to"
        )
    if user is not None and password is None:
        raise ConfigError(
            f"{ENV_USER} ({user!r}) is set without a password: set {ENV_PASSWORD_FILE} to a "
            "0600 file that holds it"
        )
    return EtcdCredentials(ca_file=ca, cert_file=cert, key_file=key, user=user, password=password)


def _password(env: Mapping[str, str], path: str | None) -> str | None:
    if path is None:
        return env.get(ENV_PASSWORD) or None
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(
            f"{ENV_PASSWORD_FILE} ({path!r}) cannot be read ({exc.strerror}): name a file "
            "that holds the etcd password"
        ) from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{ENV_PASSWORD_FILE} ({path!r}) has mode {stat.S_IMODE(st.st_mode):04o}: others "
            f"could read the etcd password; chmod 600 {path}"
        )
    return text.rstrip("\r\n")
