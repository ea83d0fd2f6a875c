"""Throwaway TLS material for tests, made with the ``openssl`` command line.

``make_tls(dir)`` writes a CA, a server certificate for ``127.0.0.1`` and
``localhost`` (subjectAltName IP:127.0.0.1, DNS:localhost; valid for clients too, as
roles that both serve and call present one certificate) and a client certificate,
all signed by that CA, with EC P-256 keys valid for two days, and returns their
paths. A failing ``openssl`` raises with its output: tests fail, never skip.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")


def _signed(d: Path, name: str, cn: str, extensions: str) -> None:
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    (d / f"{name}.ext").write_text(extensions)
    sign = ["-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", *sign, "-out", f"{name}.pem", cwd=d)


def make_tls(dir: str | Path) -> dict[str, str]:
    """CA, server and client certificates under ``dir``: paths ``ca``, ``server_cert``,
    ``server_key``, ``client_cert``, ``client_key``."""
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    ca_ext = ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    _openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=pdps test CA", *ca_ext, cwd=d)
    leaf = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    _signed(d, "server", "localhost", leaf + "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _signed(d, "client", "pdps test client", leaf + "extendedKeyUsage=clientAuth\n")
    return {
        "ca": str(d / "ca.pem"),
        "server_cert": str(d / "server.pem"),
        "server_key": str(d / "server.key"),
        "client_cert": str(d / "client.pem"),
        "client_key": str(d / "client.key"),
    }
