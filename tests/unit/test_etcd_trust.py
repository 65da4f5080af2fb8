"""etcd with TLS and auth against the wrong credentials (issue 46's probe): a member whose
certificate our CA does not verify, a client certificate the members do not trust and a user
without a role are each refused at once with one error naming the variable to fix, never
retried until the timeout as if etcd were down. Against a real etcd (tests/etcd_secure.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.etcd_cluster import skip_reason

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
_TIMEOUT_S = 10.0  # what a retried refusal would take; a refusal must come much sooner
_PROMPT_S = 2.0


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    pytest.importorskip("cryptography")
    from tests.etcd_secure import SecureEtcd

    with SecureEtcd(tmp_path_factory.mktemp("etcd-trust")) as etcd:
        yield etcd


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Another CA's certificates (a CA, a client certificate and key) for the same names."""
    pytest.importorskip("cryptography")
    from tests.etcd_secure import _pem_files

    return _pem_files(tmp_path_factory.mktemp("foreign-ca"))


def _refused(monkeypatch: pytest.MonkeyPatch, url: str, env: dict[str, str]) -> str:
    from restartable.inprocess.etcd import EtcdStore, EtcdStoreError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    with (
        pytest.raises(EtcdStoreError) as err,
        EtcdStore(url, prefix="trust-job", timeout=_TIMEOUT_S) as s,
    ):
        s.set("k", "v")
    assert time.monotonic() - t0 < _PROMPT_S, str(err.value)
    return str(err.value)


def test_a_wrong_ca_is_refused_at_once_naming_it(
    secure: object, foreign: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**secure.client_env(), "INPROCESS_ETCD_CA": str(foreign["ca.crt"])}  # type: ignore[attr-defined]
    assert "INPROCESS_ETCD_CA" in _refused(monkeypatch, secure.url, env)  # type: ignore[attr-defined]


def test_a_client_certificate_of_another_ca_is_refused_at_once_naming_it(
    secure: object, foreign: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        **secure.client_env(),  # type: ignore[attr-defined]
        "INPROCESS_ETCD_CERT": str(foreign["client.crt"]),
        "INPROCESS_ETCD_KEY": str(foreign["client.key"]),
    }
    text = _refused(monkeypatch, secure.url, env)  # type: ignore[attr-defined]
    assert "INPROCESS_ETCD_CERT" in text and "INPROCESS_ETCD_KEY" in text


def test_a_user_without_a_role_is_refused_at_once_naming_the_grant(
    secure: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.etcd_secure import ROOT_PASSWORD

    token = secure._post("auth/authenticate", {"name": "root", "password": ROOT_PASSWORD})  # type: ignore[attr-defined]
    secure._post("auth/user/add", {"name": "norole", "password": "pw"}, token=token["token"])  # type: ignore[attr-defined]
    pw = tmp_path / "pw"
    pw.write_text("pw\n")
    pw.chmod(0o600)
    env = {
        **secure.client_env(),  # type: ignore[attr-defined]
        "INPROCESS_ETCD_USER": "norole",
        "INPROCESS_ETCD_PASSWORD_FILE": str(pw),
    }
    text = _refused(monkeypatch, secure.url, env)  # type: ignore[attr-defined]
    assert "permission denied" in text and "grant-permission" in text
