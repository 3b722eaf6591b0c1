"""A throwaway PKI for mutual-TLS tests: a CA, a server certificate and a client certificate."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from endpoint_picker.settings import Settings


@dataclass(frozen=True)
class KeyPair:
    key: bytes  # PEM, PKCS#8
    cert: bytes  # PEM

    def write(self, folder: Path, stem: str) -> tuple[Path, Path]:
        """``<stem>.crt`` and ``<stem>.key`` in ``folder``; returns (cert, key) paths."""
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = folder / f"{stem}.crt", folder / f"{stem}.key"
        cert.write_bytes(self.cert)
        key.write_bytes(self.key)
        return cert, key


@dataclass(frozen=True)
class Pki:
    ca: KeyPair
    server: KeyPair  # SAN localhost, serverAuth
    client: KeyPair  # clientAuth

    def write_server_dir(self, folder: Path) -> Path:
        """A --cert-path folder (tls.crt, tls.key) holding the server certificate."""
        self.server.write(folder, "tls")
        return folder


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _issue(
    subject: str,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    usage: x509.ObjectIdentifier | None = None,
    hostnames: tuple[str, ...] = (),
) -> tuple[KeyPair, x509.Name, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if hostnames:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(h) for h in hostnames]), critical=False
        )
    cert = builder.sign(issuer_key, hashes.SHA256())
    pair = KeyPair(_pem_key(key), cert.public_bytes(serialization.Encoding.PEM))
    return pair, _name(subject), key


def make_pki(name: str = "test") -> Pki:
    """A fresh CA (``<name> CA``) with a server (localhost) and a client certificate."""
    ca, ca_name, ca_key = _issue(f"{name} CA", None, ca=True)
    server, _, _ = _issue(
        "epp", (ca_name, ca_key), usage=ExtendedKeyUsageOID.SERVER_AUTH, hostnames=("localhost",)
    )
    client, _, _ = _issue("gateway", (ca_name, ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(ca, server, client)


def with_mtls(settings: Settings, pki: Pki, folder: Path) -> Settings:
    """``settings`` with a CA-signed server certificate and client certificates required."""
    ca_file, _ = pki.ca.write(folder / "ca", "ca")
    server = replace(
        settings.server,
        secure_serving=True,
        cert_path=pki.write_server_dir(folder / "server"),
        client_ca_file=ca_file,
    )
    return replace(settings, server=server)
