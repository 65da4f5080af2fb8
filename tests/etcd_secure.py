"""A real etcd with TLS and authentication, for tests: a throwaway CA, server and client
certificates (made with ``cryptography``), one ``/usr/bin/etcd`` member on https with client
certificate auth, a root user and a job user whose role may read and write ``restartable/``,
and etcd's authentication enabled through the v3 API. ``close()`` kills it and removes its files.

    with SecureEtcd(tmp_path) as etcd:
        env = etcd.client_env()        # INPROCESS_ETCD_CA / CERT / KEY / USER / PASSWORD_FILE
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.etcd_cluster import ETCD_BIN
from tests.multiproc import free_ports

USER, PASSWORD = "job", "job-secret-pw"
ROOT_PASSWORD = "root-secret-pw"
_START_TIMEOUT_S = 30.0


def _pem_files(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(
        subject: str | x509.Name,
        key: Any,
        issuer: x509.Name,
        signer: Any,
        *,
        ca: bool,
        usage: Any = None,
        san: bool = False,
    ) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(name(subject) if isinstance(subject, str) else subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        if san:
            ip = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
            b = b.add_extension(x509.SubjectAlternativeName([ip]), critical=False)
        return b.sign(signer, hashes.SHA256())

    out: dict[str, Path] = {}

    def write(stem: str, key: Any, crt: x509.Certificate) -> None:
        out[f"{stem}.key"] = d / f"{stem}.key"
        out[f"{stem}.crt"] = d / f"{stem}.crt"
        out[f"{stem}.key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        out[f"{stem}.key"].chmod(0o600)
        out[f"{stem}.crt"].write_bytes(crt.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("restartable test CA", ca_key, name("restartable test CA"), ca_key, ca=True)
    write("ca", ca_key, ca)
    server_key = ec.generate_private_key(ec.SECP256R1())
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    server = cert("127.0.0.1", server_key, ca.subject, ca_key, ca=False, usage=usage, san=True)
    write("server", server_key, server)
    client_key = ec.generate_private_key(ec.SECP256R1())
    # No CN: with authentication on, etcd's gateway (the v3 HTTP API) refuses a client
    # certificate that has one ("CommonName ... will be ignored"): the user comes from a token.
    client_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "restartable tests")])
    write("client", client_key, cert(client_name, client_key, ca.subject, ca_key, ca=False,
                                     usage=[ExtendedKeyUsageOID.CLIENT_AUTH]))  # fmt: skip
    return out


class SecureEtcd:
    """One etcd member with TLS (client certificates required) and authentication enabled.

    ``token_ttl``: etcd's ``--auth-token-ttl`` (seconds an unused token lives)."""

    def __init__(self, directory: Path, *, token_ttl: int = 300) -> None:
        self.dir = directory
        self.files = _pem_files(directory)
        self.port, self.peer_port = free_ports(2)
        client = f"https://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        f = self.files
        with open(directory / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    ETCD_BIN,
                    "--name=s0",
                    f"--data-dir={directory / 'data'}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=s0={peer}",
                    "--initial-cluster-state=new",
                    f"--cert-file={f['server.crt']}",
                    f"--key-file={f['server.key']}",
                    f"--trusted-ca-file={f['ca.crt']}",
                    "--client-cert-auth",
                    f"--auth-token-ttl={token_ttl}",
                    "--logger=zap",
                    "--log-level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_up()
            self._enable_auth()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"etcds://127.0.0.1:{self.port}"

    def client_env(self, *, password: str = PASSWORD) -> dict[str, str]:
        """The ``INPROCESS_ETCD_*`` variables of a job client (a 0600 password file)."""
        pw = self.dir / f"password-{abs(hash(password))}"
        pw.write_text(password + "\n")
        pw.chmod(0o600)
        return {
            "INPROCESS_ETCD_CA": str(self.files["ca.crt"]),
            "INPROCESS_ETCD_CERT": str(self.files["client.crt"]),
            "INPROCESS_ETCD_KEY": str(self.files["client.key"]),
            "INPROCESS_ETCD_USER": USER,
            "INPROCESS_ETCD_PASSWORD_FILE": str(pw),
        }

    def _post(self, path: str, body: dict[str, Any], token: str | None = None) -> Any:
        import requests

        f = self.files
        headers = {"Authorization": token} if token else {}
        r = requests.post(f"https://127.0.0.1:{self.port}/v3/{path}", json=body, timeout=5,
                          verify=str(f["ca.crt"]), headers=headers,
                          cert=(str(f["client.crt"]), str(f["client.key"])))  # fmt: skip
        r.raise_for_status()
        return r.json()

    def _wait_up(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            with contextlib.suppress(Exception):
                if int(self._post("maintenance/status", {}).get("leader", 0)):
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "etcd.log").read_text(errors="replace")
                raise RuntimeError(f"the TLS etcd did not start: {log[-2000:]}")
            time.sleep(0.05)

    def _enable_auth(self) -> None:
        def b64(b: bytes) -> str:
            return base64.b64encode(b).decode()

        self._post("auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
        self._post("auth/role/add", {"name": "root"})
        self._post("auth/user/grant", {"user": "root", "role": "root"})
        self._post("auth/user/add", {"name": USER, "password": PASSWORD})
        self._post("auth/role/add", {"name": "jobs"})
        perm = {
            "permType": "READWRITE",
            "key": b64(b"restartable/"),
            "range_end": b64(b"restartable0"),
        }  # fmt: skip  ('0' follows '/')
        self._post("auth/role/grant", {"name": "jobs", "perm": perm})
        self._post("auth/user/grant", {"user": USER, "role": "jobs"})
        self._post("auth/enable", {})

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def __enter__(self) -> SecureEtcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
