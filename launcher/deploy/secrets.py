"""TLS certificates, SuperNode authentication keys and SuperExec secrets for a deployment.

One folder (default `deploy/secrets/`, git-ignored) holds everything a fleet needs:

  ca.crt, ca.key            a private certificate authority (the CLI and SuperNodes trust ca.crt)
  server.pem, server.key    the SuperLink's certificate, SANs: IP:127.0.0.1, DNS:localhost,
                            DNS:superlink (the compose service name) + any extra names asked for
  <node>, <node>.pub        one EC (P-384) key pair per SuperNode, OpenSSH format, as
                            `flower-supernode --auth-supernode-private-key` and
                            `flwr supernode register` read them
  superexec-<name>.secret   shared secrets between a SuperLink/SuperNode and its external
                            SuperExec (process isolation only)

Existing files are kept (a running fleet's CA or a registered key is never replaced silently);
`overwrite=True` regenerates everything.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets as pysecrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DNS = ("localhost", "superlink")
DEFAULT_IPS = ("127.0.0.1",)
SUPERLINK_SECRET = "superlink"  # name of the SuperLink <-> ServerApp SuperExec secret


@dataclass(frozen=True)
class SecretFiles:
    """Where the files of one secrets folder live (paths need not exist yet)."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server.key"

    def node_key(self, node: str) -> Path:
        return self.root / node

    def node_pub(self, node: str) -> Path:
        return self.root / f"{node}.pub"

    def superexec_secret(self, name: str) -> Path:
        return self.root / f"superexec-{name}.secret"


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write atomically; private files are created 0600 so no other user can read a key."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "oneshot-fl"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _make_ca(files: SecretFiles, days: int) -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(_name("oneshot-fl CA")).issuer_name(_name("oneshot-fl CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA384()))
    _write(files.ca_key, _pem_key(key), private=True)
    _write(files.ca_cert, cert.public_bytes(serialization.Encoding.PEM), private=False)


def _make_server_cert(files: SecretFiles, dns: tuple[str, ...], ips: tuple[str, ...], days: int) -> None:
    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    key = ec.generate_private_key(ec.SECP384R1())
    now = dt.datetime.now(dt.timezone.utc)
    sans = [x509.DNSName(name) for name in dns] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    # Python 3.13's default TLS context is strict (VERIFY_X509_STRICT): the leaf needs SANs,
    # an authority key identifier and must not be a CA.
    cert = (x509.CertificateBuilder()
            .subject_name(_name(dns[0] if dns else ips[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    _write(files.server_key, _pem_key(key), private=True)
    _write(files.server_cert, cert.public_bytes(serialization.Encoding.PEM), private=False)


def _make_node_key(files: SecretFiles, node: str) -> None:
    # EC on a NIST curve: what `flwr supernode register` accepts (it rejects ed25519 and RSA)
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(files.node_key(node), private, private=True)
    _write(files.node_pub(node), public + f" oneshot-fl-{node}\n".encode(), private=False)


def server_sans(files: SecretFiles) -> set[str]:
    """The SuperLink certificate's SANs as 'DNS:name' / 'IP:addr' strings."""
    cert = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return ({f"DNS:{n}" for n in ext.get_values_for_type(x509.DNSName)}
            | {f"IP:{a}" for a in ext.get_values_for_type(x509.IPAddress)})


def generate(out: Path, nodes: list[str], *, superexec: list[str] = (), dns: tuple[str, ...] = DEFAULT_DNS,
             ips: tuple[str, ...] = DEFAULT_IPS, days: int = 365, overwrite: bool = False) -> dict[str, list[str]]:
    """Create whatever is missing in `out`; returns {'created': [...], 'kept': [...]} file names."""
    files = SecretFiles(Path(out))
    files.root.mkdir(parents=True, exist_ok=True)
    os.chmod(files.root, 0o700)
    report: dict[str, list[str]] = {"created": [], "kept": []}

    def step(paths: list[Path], make) -> None:
        if overwrite or not all(p.exists() for p in paths):
            make()
            report["created"] += [p.name for p in paths]
        else:
            report["kept"] += [p.name for p in paths]

    ca_fresh = overwrite or not files.ca_cert.exists()
    step([files.ca_cert, files.ca_key], lambda: _make_ca(files, days))
    wanted = {f"DNS:{n}" for n in dns} | {f"IP:{i}" for i in ips}
    # a new CA or new names invalidate the old server certificate
    if ca_fresh or (files.server_cert.exists() and not wanted <= server_sans(files)):
        for path in (files.server_cert, files.server_key):
            path.unlink(missing_ok=True)
    step([files.server_cert, files.server_key], lambda: _make_server_cert(files, tuple(dns), tuple(ips), days))
    for node in nodes:
        step([files.node_key(node), files.node_pub(node)], lambda node=node: _make_node_key(files, node))
    for name in superexec:
        path = files.superexec_secret(name)
        step([path], lambda path=path: _write(path, pysecrets.token_hex(32).encode(), private=True))
    return report
