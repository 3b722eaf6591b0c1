"""TLS material for the ext_proc port: the user's certificate or a generated self-signed one."""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from endpoint_picker.errors import ConfigError


def load_certificate(cert_dir: Path) -> tuple[bytes, bytes]:
    """Read ``tls.key`` and ``tls.crt`` (Kubernetes TLS-secret names) from ``cert_dir``."""
    try:
        return (cert_dir / "tls.key").read_bytes(), (cert_dir / "tls.crt").read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS material: {exc}", "--cert-path") from exc


def load_client_ca(path: Path) -> bytes:
    """The PEM bundle of CA certificates ext_proc clients must present a certificate from.

    Parsed here so a wrong file fails at start with one line, not as a gRPC core abort or as
    every handshake failing later.
    """
    try:
        pem = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", "--client-ca-file") from exc
    try:
        x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ConfigError(
            f"{path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", "--client-ca-file"
        ) from exc
    return pem


def self_signed_certificate(hostnames: tuple[str, ...] = ("localhost",)) -> tuple[bytes, bytes]:
    """A fresh key and a self-signed certificate, valid for ten years (Envoy does not verify)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "endpoint-picker")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in hostnames]), False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def server_ssl_context(tls: tuple[bytes, bytes], client_ca: bytes | None) -> ssl.SSLContext:
    """A TLS server context from PEM (key, certificate chain), requiring a client certificate
    signed by ``client_ca`` when given; ALPN offers HTTP/2 only, as gRPC needs."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    key, chain = tls
    # The ssl module loads a key and chain from files only: a private temporary folder, gone
    # once loaded.
    with tempfile.TemporaryDirectory(prefix="epp-tls-") as folder:
        key_path, chain_path = os.path.join(folder, "tls.key"), os.path.join(folder, "tls.crt")
        with open(key_path, "wb") as f:
            f.write(key)
        with open(chain_path, "wb") as f:
            f.write(chain)
        context.load_cert_chain(chain_path, key_path)
    if client_ca is not None:
        context.load_verify_locations(cadata=client_ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context
