"""Test PKI: a CA, a server certificate for 127.0.0.1 and localhost, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_file: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_pki(root: Path, name: str = "hfsampler-test") -> Pki:
    """A fresh CA under ``root`` with one server and one client certificate signed by it."""
    root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    life = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=2))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{name} CA"))
        .issuer_name(_name(f"{name} CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(life[0])
        .not_valid_after(life[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
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
        .sign(ca_key, hashes.SHA256())
    )
    (root / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(cn: str, usage: x509.ObjectIdentifier, stem: str) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(life[0])
            .not_valid_after(life[1])
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if usage == ExtendedKeyUsageOID.SERVER_AUTH:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        (root / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, root / f"{stem}.key")

    leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH, "server")
    leaf("hfsampler-client", ExtendedKeyUsageOID.CLIENT_AUTH, "client")
    return Pki(
        root / "ca.pem",
        root / "server.pem",
        root / "server.key",
        root / "client.pem",
        root / "client.key",
    )
