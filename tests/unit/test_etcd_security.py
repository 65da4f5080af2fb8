"""The etcd store with TLS and authentication (issue 33): ``etcds://`` endpoints, the CA and
client certificate, the user and password from the environment or a 0600 file, never the URL;
against a real etcd started by the test with TLS, client-certificate auth and users."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from restartable.inprocess.errors import ConfigError
from restartable.inprocess.etcd.security import credentials_from_env
from restartable.inprocess.etcd.url import parse_url
from tests.etcd_cluster import skip_reason
from tests.multiproc import slow

needs_etcd = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

# ----- configuration (pure) ---------------------------------------------------------------


def test_credentials_in_the_url_are_refused_naming_the_variables() -> None:
    # Before: "endpoint 'user:pass@h:2379' has port 'pass@h'", a misleading port error.
    with pytest.raises(ConfigError) as err:
        parse_url("etcd://alice:s3cret@h1:2379,h2/job")
    text = str(err.value)
    assert "INPROCESS_ETCD_USER" in text and "INPROCESS_ETCD_PASSWORD_FILE" in text
    assert "s3cret" not in text and "***@h1:2379" in text  # the password is not repeated


def test_etcds_urls_select_tls() -> None:
    a = parse_url("etcds://h1:2379,h2/job")
    assert a.tls and a.endpoints == (("h1", 2379), ("h2", 2379)) and a.prefix == "job"
    assert a.to_url("x") == "etcds://h1:2379,h2:2379/x"
    assert not parse_url("etcd://h1").tls


def test_credential_variables_are_checked(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("secret\n")
    pw.chmod(0o600)
    c = credentials_from_env({"INPROCESS_ETCD_USER": "u", "INPROCESS_ETCD_PASSWORD_FILE": str(pw)})
    assert (c.user, c.password) == ("u", "secret") and "secret" not in repr(c)
    pw.chmod(0o644)
    with pytest.raises(ConfigError, match=r"mode 0644.*chmod 600"):
        credentials_from_env({"INPROCESS_ETCD_USER": "u", "INPROCESS_ETCD_PASSWORD_FILE": str(pw)})
    with pytest.raises(ConfigError, match="INPROCESS_ETCD_USER"):
        credentials_from_env({"INPROCESS_ETCD_PASSWORD": "x"})
    with pytest.raises(ConfigError, match="without a password"):
        credentials_from_env({"INPROCESS_ETCD_USER": "u"})
    with pytest.raises(ConfigError, match="go together"):
        credentials_from_env({"INPROCESS_ETCD_CERT": str(pw)})
    with pytest.raises(ConfigError, match=r"INPROCESS_ETCD_CA.*is not a file"):
        credentials_from_env({"INPROCESS_ETCD_CA": str(tmp_path / "missing.pem")})


# ----- against a real etcd with TLS and auth ------------------------------------------------


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    if skip_reason() is not None:
        pytest.skip(str(skip_reason()))
    pytest.importorskip("cryptography")
    from tests.etcd_secure import SecureEtcd

    with SecureEtcd(tmp_path_factory.mktemp("etcd-tls"), token_ttl=1) as etcd:
        yield etcd


def _env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@needs_etcd
def test_the_protocol_runs_over_tls_with_a_user(
    secure: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from restartable.inprocess.etcd import EtcdStore
    from restartable.inprocess.protocol import fault_records, iteration_end, keys
    from tests.etcd_secure import SecureEtcd

    assert isinstance(secure, SecureEtcd)
    _env(monkeypatch, secure.client_env())
    with (
        EtcdStore(secure.url, prefix="tls-job", timeout=10.0) as a,
        EtcdStore(secure.url, prefix="tls-job", timeout=10.0) as b,
    ):
        a.set("k", "v")
        assert b.get("k") == b"v" and b.add("n", 2) == 2
        threading.Timer(0.2, a.set, args=("late", "w")).start()  # a watch over TLS
        assert b.wait_value("late", datetime.timedelta(seconds=5)) == b"w"
        fault_records.report_fault(a, iteration=0, initial_rank=1, kind="exception", detail="x")
        assert iteration_end.outcome(b, 0) == keys.OUTCOME_FAULT
        assert a.delete_all() > 0


@needs_etcd
@slow("a 3 s wait for a token to expire; test_the_protocol_runs_over_tls_with_a_user covers TLS")
def test_an_expired_token_is_replaced(secure: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from restartable.inprocess.etcd import EtcdStore
    from tests.etcd_secure import SecureEtcd

    assert isinstance(secure, SecureEtcd)
    _env(monkeypatch, secure.client_env())
    with EtcdStore(secure.url, prefix="tls-expiry", timeout=10.0) as a:
        a.set("k", "v")
        # etcd's simple tokens expire (--auth-token-ttl 1 here, swept every second): the
        # client asks for a new one when etcd refuses the old one, and goes on.
        session = a._endpoints.current()[1].session
        old = session.headers["Authorization"]
        time.sleep(3.0)
        assert a.get("k") == b"v" and a.count_arrival("c", "m") == 1
        assert session.headers["Authorization"] != old
        a.delete_all()


@needs_etcd
def test_a_wrong_password_or_no_user_is_refused(
    secure: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from restartable.inprocess.etcd import EtcdStore, EtcdStoreError
    from tests.etcd_secure import SecureEtcd

    assert isinstance(secure, SecureEtcd)
    _env(monkeypatch, secure.client_env(password="wrong"))
    # Connecting (its first request) fails at once, naming the user and where the password is.
    with pytest.raises(EtcdStoreError, match=r"refused user 'job'.*INPROCESS_ETCD_PASSWORD_FILE"):
        EtcdStore(secure.url, prefix="tls-job", timeout=5.0)
    monkeypatch.delenv("INPROCESS_ETCD_USER")
    monkeypatch.delenv("INPROCESS_ETCD_PASSWORD_FILE")
    s = EtcdStore(secure.url, prefix="tls-job", timeout=5.0)  # the status needs no user
    t0 = time.monotonic()
    with pytest.raises(EtcdStoreError, match=r"INPROCESS_ETCD_USER"):
        s.set("k", "v")  # the certificate alone names no user: refused, not retried
    assert time.monotonic() - t0 < 4.0
    s.close()


@needs_etcd
def test_a_plain_url_with_tls_files_names_the_scheme(
    secure: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from restartable.inprocess.etcd import EtcdStore
    from tests.etcd_secure import SecureEtcd

    assert isinstance(secure, SecureEtcd)
    _env(monkeypatch, secure.client_env())
    with pytest.raises(ConfigError, match="etcds://"):
        EtcdStore(secure.url.replace("etcds://", "etcd://"), prefix="tls-job", timeout=2.0)
