"""The etcd-v3 backend over TLS (``--rdzv-conf protocol=https,cacert=..,cert=..,key=..``)
against a real etcd member that requires client certificates (etcd's
``--client-cert-auth``).

The certificates are made here, for this test only, with the ``cryptography`` package (the
test extra): a CA that signs the member's certificate (for 127.0.0.1) and the right client
certificate, and a foreign CA that signs a client certificate etcd must refuse. Skipped only
when etcd-server is missing.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ftrun.control.errors import StoreError
from ftrun.control.etcd import EtcdOptions, connect_etcd
from ftrun.control.etcdkeepalive import KeepAliveStream
from tests.infra.etcd_cluster import ServerTls, etcd_missing_reason, loopback_etcd
from tests.launch import launcher

pytestmark = pytest.mark.skipif(etcd_missing_reason() is not None,
                                reason=etcd_missing_reason() or "")

TOKEN = "etcd-tls-test-token"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(directory: Path, stem: str, key: ec.EllipticCurvePrivateKey,
           cert: x509.Certificate) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


class _Ca:
    """A throwaway certificate authority that signs leaf certificates into a directory."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                                  False, False), True)
                     .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                         self.key.public_key()), False)
                     .sign(self.key, hashes.SHA256()))
        self.path = directory / f"{name}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def sign(self, stem: str, *, server: bool) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        # etcd's own gateway dials its gRPC server with the server's certificate as a
        # client one (with --client-cert-auth: 503 without the client usage)
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server \
            else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (x509.CertificateBuilder().subject_name(_name(stem))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage(usage), False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       self.key.public_key()), False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        return _write(self.directory, stem, key, builder.sign(self.key, hashes.SHA256()))


def _ftrun(args: list[str], script: Path, timeout: float, bundle: Path
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([launcher(), *args, str(script)], capture_output=True, text=True,
                          timeout=timeout, cwd=script.parent,
                          env={"PATH": "/usr/bin:/bin", "FTRUN_JOB_TOKEN": TOKEN,
                               "REQUESTS_CA_BUNDLE": str(bundle)})


def test_etcd_tls_job_forms_with_the_right_client_certificate_and_a_wrong_one_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd requires a client certificate of its CA. With that certificate (and the CA to
    check etcd's own), a client's requests work and a real ftrun job forms its generation
    on etcd, runs its worker and exits 0 (a held wait's stream, on a session of its own,
    speaks TLS too), also where ``REQUESTS_CA_BUNDLE`` names another
    CA (requests lets it override a session's own: ``cacert`` must win). With a client
    certificate of a foreign CA (etcd refuses the handshake), or a CA that did not sign
    etcd's certificate (the client refuses it), connecting fails with one line that names
    the endpoint and the TLS error:
    ftrun exits 3 within its read_timeout plus start-up, no traceback."""
    ca, foreign = _Ca(tmp_path, "ca"), _Ca(tmp_path, "foreign-ca")
    server_cert, server_key = ca.sign("etcd-server", server=True)
    client_cert, client_key = ca.sign("ftrun-node", server=False)
    bad_cert, bad_key = foreign.sign("intruder", server=False)
    probe = ssl.create_default_context(cafile=str(ca.path))
    probe.load_cert_chain(str(client_cert), str(client_key))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(foreign.path))
    with loopback_etcd(tls=ServerTls(server_cert, server_key, ca.path, probe)) as endpoint:
        right = {"protocol": "https", "cacert": str(ca.path), "cert": str(client_cert),
                 "key": str(client_key)}
        client = connect_etcd(EtcdOptions.parse(endpoint, right), 10, op_timeout_s=5)
        client.set("tls/hello", "over tls")
        assert client.get("tls/hello") == b"over tls"
        # a joining agent's held wait (a stream on a session of its own) over TLS too
        held = ["tls/as", "tls/gen", "tls/shutdown"]
        assert client.wait_any(held, 0.2) is None
        writer = connect_etcd(EtcdOptions.parse(endpoint, right), 10, op_timeout_s=5)
        put = threading.Timer(0.3, lambda: writer.set("tls/gen", "formed"))
        put.start()
        assert client.wait_any(held, 10) == (1, b"formed")
        put.join()
        # a lease's renewals on the gRPC keepalive stream, over TLS with the same files
        lease, _ = client.grant_ttl(5)
        stream = KeepAliveStream.for_options(client.options)
        assert client.keep_alive(lease, stream) > 0 and stream.opened == 1
        stream.close()
        doubted = KeepAliveStream.for_options(EtcdOptions.parse(
            endpoint, {**right, "cacert": str(foreign.path)}))
        with pytest.raises(RuntimeError, match="no etcd endpoint answered"):
            client.keep_alive(lease, doubted)  # etcd's certificate is not of that CA
        doubted.close()
        untrusted = {**right, "cacert": str(foreign.path)}
        with pytest.raises(StoreError) as refused:
            connect_etcd(EtcdOptions.parse(endpoint, untrusted), 2, op_timeout_s=1)
        line = str(refused.value)
        assert "\n" not in line and endpoint in line and "certificate verify failed" in line, \
            line

        script = tmp_path / "train.py"
        script.write_text("import os\nprint('worker ran', os.environ['RANK'], flush=True)\n")
        conf = ",".join(f"{k}={v}" for k, v in right.items())
        base = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
                "--rdzv-endpoint", endpoint, "--rdzv-id", "tlsjob", "--local-addr",
                "127.0.0.1"]
        done = _ftrun([*base, "--rdzv-conf", f"{conf},last_call_timeout=0"], script, 120,
                      foreign.path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "joined generation 0" in done.stderr and "worker ran 0" in done.stdout, \
            done.stdout[-3000:] + done.stderr[-3000:]

        wrong = {**right, "cert": str(bad_cert), "key": str(bad_key), "read_timeout": "3"}
        started = time.monotonic()
        done = _ftrun([*base, "--rdzv-conf", ",".join(f"{k}={v}" for k, v in wrong.items())],
                      script, 120, foreign.path)
        took = time.monotonic() - started
        assert done.returncode == 3, done
        assert "Traceback" not in done.stderr + done.stdout, done.stderr
        failure = [x for x in done.stderr.splitlines() if "cannot reach etcd" in x]
        assert len(failure) == 1 and endpoint in failure[0], done.stderr
        assert any(word in failure[0].lower() for word in ("certificate", "tls", "ssl")), \
            failure[0]
        assert "worker ran" not in done.stdout
        assert took < 40, took  # 3 s of tries + the interpreter and torch import on 2 cores
        print(f"wrong client certificate: {failure[0]} ({took:.1f} s)")
