"""Lock down the local SeaweedFS: only the S3 port, with its keys, gives access.

`weed mini` runs a master, a volume server, a filer and an admin component
besides the S3 gateway, each with an HTTP and a gRPC port on 127.0.0.1.
Unprotected, any local process can write or delete objects through them (the
filer's HTTP and gRPC APIs, or the master's `/col/delete`), bypassing the S3
credentials entirely. `write_security_config` writes the `security.toml`
that weed reads from its `-config_dir` (the data directory):

- mutual TLS on every internal HTTP and gRPC port: a fresh CA and one
  certificate that the components present to each other; a client without
  that certificate fails the TLS handshake;
- JWT signing keys for the filer's and volume server's reads and writes, as a
  second lock should TLS be switched off.

Everything is generated anew at each start (like the S3 keys) and written
owner-only into the data directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SECURITY_FILE = "security.toml"
TLS_DIR = "tls"
_GRPC_ROLES = ("master", "volume", "filer", "s3", "admin", "worker", "client")
_HTTPS_ROLES = ("master", "volume", "filer", "admin")
_VALIDITY = datetime.timedelta(days=3650)


def _write_private(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def _certificate(subject: x509.Name, issuer: x509.Name, public_key, signing_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        ).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(signing_key, hashes.SHA256())


def write_tls_material(directory: Path) -> dict[str, Path]:
    """A new CA and one certificate (server and client use) for 127.0.0.1; returns their paths."""
    directory.mkdir(mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rankflow local SeaweedFS CA")])
    ca = _certificate(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rankflow-weed")])
    cert = _certificate(name, ca_name, key.public_key(), ca_key, ca=False)
    paths = {"ca": directory / "ca.crt", "cert": directory / "weed.crt", "key": directory / "weed.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        paths["key"],
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return paths


def security_toml(tls: dict[str, Path]) -> str:
    def quoted(path: Path) -> str:
        return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ["# Written by rankflow (infra/services/s3_security.py) at each start; do not edit."]
    for section in ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read"):
        lines += [f"[{section}]", f'key = "{secrets.token_hex(32)}"', "expires_after_seconds = 10"]
    lines += ["[access]", "ui = false", "[filer.expose_directory_metadata]", "enabled = false"]
    lines += ["[grpc]", f"ca = {quoted(tls['ca'])}"]
    for role in _GRPC_ROLES:
        lines += [f"[grpc.{role}]", f"cert = {quoted(tls['cert'])}", f"key = {quoted(tls['key'])}"]
    for role in _HTTPS_ROLES:
        lines += [
            f"[https.{role}]",
            f"cert = {quoted(tls['cert'])}",
            f"key = {quoted(tls['key'])}",
            f"ca = {quoted(tls['ca'])}",
        ]
    lines += [
        "[https.client]",
        "enabled = true",
        f"cert = {quoted(tls['cert'])}",
        f"key = {quoted(tls['key'])}",
        f"ca = {quoted(tls['ca'])}",
    ]
    return "\n".join(lines) + "\n"


def write_security_config(data_dir: Path) -> Path:
    """Fresh TLS material and JWT keys, and the `security.toml` that makes weed use them."""
    tls = write_tls_material(data_dir / TLS_DIR)
    path = data_dir / SECURITY_FILE
    _write_private(path, security_toml(tls).encode())
    return path
