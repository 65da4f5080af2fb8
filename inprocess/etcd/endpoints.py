"""Requests to an etcd cluster through etcd3gw, with failover between the cluster's endpoints.

Every endpoint of the URL gets one ``etcd3gw`` client (HTTP/JSON to etcd's gRPC gateway,
``/v3/``). A request that fails because its endpoint is down, times out, or has no leader for a
moment is retried on the next endpoint, with a short backoff, until the caller's deadline; any
other answer (a malformed request, no v3 API) is an ``EtcdStoreError`` at once.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from restartable.inprocess.clock import SYSTEM, Clock
from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.errors import EtcdStoreError, EtcdTimeoutError
from restartable.inprocess.etcd.security import (
    ENV_CA,
    ENV_CERT,
    EtcdCredentials,
    credentials_from_env,
)
from restartable.inprocess.etcd.url import TLS_SCHEME, EtcdAddress

if TYPE_CHECKING:
    from etcd3gw.client import Etcd3Client

log = logging.getLogger(__name__)

T = TypeVar("T")

API_PATH = "/v3/"  # etcd >= 3.4; 3.3's /v3beta/ gateway is not supported (ours needs 3.4's)
# Backoff between two attempts after an endpoint error: first retry at once on the next
# endpoint (a killed member answers "connection refused" in microseconds), then wait a little so
# that an election (~1 s with etcd's defaults) is not flooded with requests.
_BACKOFF_FIRST_S = 0.0
_BACKOFF_MAX_S = 0.2
# Handshakes a member breaks off in a row before its refusal of our client certificate is taken
# for what it is (with TLS 1.3 the refusal often reaches the client as a bare EOF, not an alert;
# a member that is down refuses the connection instead, so it never counts here).
_TLS_TRIES = 3


class Transient(Exception):
    """An endpoint-level failure worth retrying elsewhere (wraps the library's error)."""


class TokenRefused(Transient):
    """The endpoint refused this client's auth token (expired, or issued by another member):
    a new one is asked for before the next request there."""


def _client_module() -> Any:
    try:
        # Not `import etcd3gw.client`: the package's `client` function shadows the module.
        return importlib.import_module("etcd3gw.client")
    except ImportError as exc:
        raise EtcdStoreError(
            "the etcd store needs the etcd3gw package: pip install 'restartable[etcd]'"
        ) from exc


class Endpoints:
    """The clients of every endpoint of one cluster, and the one in use (thread-safe).

    ``request_timeout`` bounds one HTTP request (a member that hangs instead of refusing is left
    after this long). ``credentials`` (default: ``credentials_from_env()``): TLS files and the
    etcd user, see ``inprocess.etcd.security``; with a user, each endpoint's client asks for a
    token before its first request (etcd's simple tokens are valid on the member that issued
    them only) and again when the member refuses it. Constructed by ``EtcdStore``; ``call`` is
    its only way to the cluster.
    """

    def __init__(
        self,
        address: EtcdAddress,
        *,
        request_timeout: float,
        credentials: EtcdCredentials | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        mod = _client_module()
        creds = credentials_from_env() if credentials is None else credentials
        if creds.needs_tls and not address.tls:
            raise ConfigError(
                f"{ENV_CA} or {ENV_CERT} is set but the store URL ({address.to_url()!r}) is not "
                f"TLS: start it with {TLS_SCHEME} to talk to etcd over TLS"
            )
        self.address = address
        self.request_timeout = request_timeout
        self.clock = clock
        self._creds = creds
        self._clients: list[Etcd3Client] = [
            mod.Etcd3Client(
                host=h,
                port=p,
                protocol="https" if address.tls else "http",
                timeout=request_timeout,
                api_path=API_PATH,
                session=_bounded_session(request_timeout, creds),
            )
            for h, p in address.endpoints
        ]
        self._authed = [False] * len(self._clients)
        self._current = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        for c in self._clients:
            c.session.close()

    def current(self) -> tuple[int, Etcd3Client]:
        """The endpoint in use (its index, for ``fail_over``) and its client."""
        with self._lock:
            return self._current, self._clients[self._current]

    def fail_over(self, index: int) -> None:
        """Move on from endpoint ``index`` (unless another thread already did)."""
        with self._lock:
            if self._current == index:
                self._current = (index + 1) % len(self._clients)

    def failed(self, index: int, exc: Transient) -> None:
        """A request to endpoint ``index`` failed with ``exc``: move on from it (and ask it for
        a new token next time when it refused this one)."""
        if isinstance(exc, TokenRefused):
            self._authed[index] = False
        self.fail_over(index)

    def call(self, what: str, op: Callable[[Etcd3Client], T], *, deadline: float) -> T:
        """Run ``op`` against a live endpoint; retry on the next endpoint until ``deadline``
        (``clock.monotonic()`` seconds). ``op`` must be safe to repeat (the store makes its
        non-idempotent writes so). Raises ``EtcdTimeoutError`` naming every endpoint, the
        bound and the last error; ``EtcdStoreError`` for a non-transient refusal."""
        backoff = _BACKOFF_FIRST_S
        tried = tls_failed = 0
        while True:
            index, client = self.current()
            try:
                self.authenticate(index, client)
                return classify(functools.partial(op, client))
            except Transient as exc:
                last = exc
                log.debug("etcd %s on %s failed: %s", what, self.address.endpoints[index], exc)
                if isinstance(exc, TokenRefused) and self._creds.user is None:
                    raise EtcdStoreError(
                        f"etcd at {client.base_url} requires authentication ({exc}): set "
                        "INPROCESS_ETCD_USER and INPROCESS_ETCD_PASSWORD_FILE (docs/etcd.md)"
                    ) from exc
                tls_failed = tls_failed + 1 if "SSL" in str(exc) else 0
                if tls_failed >= _TLS_TRIES:
                    raise UntrustedEndpoint(
                        f"etcd broke off {tls_failed} TLS handshakes in a row ({exc}): a member "
                        "that does not accept this client's certificate; set INPROCESS_ETCD_CERT "
                        "and INPROCESS_ETCD_KEY to one signed by the CA the members trust"
                    ) from exc
                self.failed(index, exc)
                tried += 1
            now = self.clock.monotonic()
            if now >= deadline:
                raise EtcdTimeoutError(
                    f"etcd {what}: no endpoint of {self.address.describe()} answered within the "
                    f"timeout ({tried} attempts; last error: {last}): check that the etcd "
                    "cluster is up and reachable, or raise the store timeout"
                ) from last.__cause__
            if tried % len(self._clients) == 0:  # a full round failed: back off
                self.clock.sleep(min(backoff, deadline - now))
                backoff = min(max(2 * backoff, 0.01), _BACKOFF_MAX_S)

    def authenticate(self, index: int, client: Etcd3Client) -> None:
        """Give endpoint ``index``'s client a token of the configured user, unless it has one
        (no user: nothing to do). ``Transient`` when the member does not answer;
        ``EtcdStoreError`` naming the user when it refuses the password."""
        if self._creds.user is None or self._authed[index]:
            return
        body = {"name": self._creds.user, "password": self._creds.password or ""}
        # Not with the refused token: etcd answers 401 to any request that carries one.
        client.session.headers.pop("Authorization", None)
        try:
            answer = classify(lambda: client.post(client.get_url("/auth/authenticate"), json=body))
        except UntrustedEndpoint:
            raise  # a certificate, not the user: the message says which
        except (EtcdStoreError, TokenRefused) as exc:
            raise EtcdStoreError(
                f"etcd at {client.base_url} refused user {self._creds.user!r}: {exc}; check "
                "INPROCESS_ETCD_USER and the password in INPROCESS_ETCD_PASSWORD_FILE"
            ) from exc
        client.session.headers["Authorization"] = str(answer.get("token", ""))
        self._authed[index] = True

    def probe(self, *, deadline: float) -> None:
        """Check that some endpoint is an etcd with the v3 API (one status request).

        Raises ``EtcdStoreError`` when an endpoint answers but without the v3 API (an etcd
        older than 3.4, or not etcd at all), ``EtcdTimeoutError`` when none answers."""
        self.call("status (v3 API check)", _status, deadline=deadline)


# How long a watch stream may stay silent before the client gives it up and re-arms it
# (``inprocess.etcd.watch``): the bound on the stall of a waiter whose member hangs without
# closing the connection (a killed member closes it: re-armed at once; one cut off from its
# leader cancels the watch). A healthy watch of a key nobody writes is re-armed this often.
WATCH_IDLE_S = 5.0


def _bounded_session(request_timeout: float, creds: EtcdCredentials) -> Any:
    """A requests session whose every request is bounded, the library's watch creation too,
    with the TLS files of ``creds`` (the CA that signed the members' certificates, the
    client certificate).

    etcd3gw passes its timeout to unary requests but opens watch streams without one: a member
    that accepts the connection and then hangs would block a waiter forever.
    """
    import requests
    from requests.adapters import HTTPAdapter

    class _Bounded(HTTPAdapter):
        def send(self, request: Any, **kw: Any) -> Any:  # type: ignore[override]
            if kw.get("timeout") is None:
                kw["timeout"] = (request_timeout, WATCH_IDLE_S)
            return super().send(request, **kw)

    session = requests.Session()
    # No proxy variables or ~/.netrc for cluster-internal endpoints: looking them up on every
    # request cost 0.4-1.2 ms of a ~2 ms call (measured, benchmarks/store_etcd.py's setup).
    session.trust_env = False
    if creds.ca_file is not None:
        session.verify = creds.ca_file
    if creds.cert_file is not None and creds.key_file is not None:
        session.cert = (creds.cert_file, creds.key_file)
    session.mount("http://", _Bounded())
    session.mount("https://", _Bounded())
    return session


def _status(client: Etcd3Client) -> None:
    result = client.post(client.get_url("/maintenance/status"), json={})
    if not isinstance(result, dict) or "header" not in result:
        raise EtcdStoreError(
            f"{client.base_url} answered the v3 status request with {result!r}: it is not an "
            "etcd with the v3 API (etcd >= 3.4 needed)"
        )


class UntrustedEndpoint(EtcdStoreError):
    """The TLS handshake failed on a certificate (ours or the member's): refused, not retried."""


def classify(fn: Callable[[], T]) -> T:
    """Run ``fn``; turn the library's endpoint-level failures into ``Transient`` and every other
    refusal into ``EtcdStoreError``."""
    import requests
    from etcd3gw import exceptions as ex

    try:
        return fn()
    except ex.WatchTimedOut:
        raise
    except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError) as e:
        # 503 (no leader, member stopping), 504/408 (timeouts), 500 (leader changed mid-request)
        _refuse_untrusted(e)
        raise Transient(_brief(e)) from e
    except requests.exceptions.RequestException as e:  # raised unwrapped by watch creation
        _refuse_untrusted(e)
        raise Transient(_brief(e)) from e
    except ex.Etcd3Exception as e:
        text = _brief(e)
        if "invalid auth token" in text or "Unauthorized" in text:  # HTTP 401
            raise TokenRefused(text) from e
        if "user name is empty" in text:
            raise EtcdStoreError(
                f"etcd requires authentication ({text}): set INPROCESS_ETCD_USER and "
                "INPROCESS_ETCD_PASSWORD_FILE (docs/etcd.md)"
            ) from e
        if "404" in text or "not found" in text.lower():
            raise EtcdStoreError(
                f"etcd answered {text}: no v3 API (gRPC gateway at {API_PATH}) there; "
                "the etcd store needs etcd >= 3.4 with the v3 API enabled"
            ) from e
        if "permission denied" in text:
            raise EtcdStoreError(
                f"etcd refused the request ({text}): the user INPROCESS_ETCD_USER names has no "
                "role that may read and write restartable/: grant one (etcdctl role "
                "grant-permission ROLE --prefix=true readwrite restartable/; docs/etcd.md)"
            ) from e
        raise EtcdStoreError(f"etcd refused the request: {text}") from e


def _refuse_untrusted(exc: BaseException) -> None:
    """A TLS handshake that fails on a certificate is not a member that is down: it is refused
    at once (``UntrustedEndpoint``), never retried until the timeout as if unreachable (found by
    issue 46's probe: a wrong CA or client certificate took the whole timeout, then read as
    "no endpoint answered")."""
    text = _brief(exc)
    if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
        raise UntrustedEndpoint(
            f"etcd's certificate is not signed by the CA in INPROCESS_ETCD_CA ({text}): set "
            "INPROCESS_ETCD_CA to the CA that signed the members' certificates (docs/etcd.md)"
        ) from exc
    if any(a in text for a in ("ALERT_BAD_CERTIFICATE", "ALERT_UNKNOWN_CA", "CERTIFICATE_REQ")):
        raise UntrustedEndpoint(
            f"etcd refused this client's certificate ({text}): set INPROCESS_ETCD_CERT and "
            "INPROCESS_ETCD_KEY to a certificate signed by the CA the members trust "
            "(their --trusted-ca-file; docs/etcd.md)"
        ) from exc


def _brief(exc: BaseException) -> str:
    """The error's class, its arguments (etcd3gw: the HTTP reason) and the body etcd answered
    (etcd3gw keeps it apart, in ``detail_text``: "etcdserver: user name is empty", ...)."""
    parts = [str(a) for a in exc.args]
    detail = getattr(exc, "detail_text", None)
    if detail:
        parts.append(str(detail).strip())
    text = " ".join(parts) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"
