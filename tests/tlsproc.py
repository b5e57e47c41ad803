"""TLS for tests: a self-signed certificate, a CA directory that trusts it, a server on
127.0.0.1 that answers each connection once, and a child process short of descriptors:
what the probes' and the router's trust-store tests share."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

# A child script's first lines: ``leave(spare)`` lowers the open-file limit and takes
# every descriptor but ``spare``, as a process at its limit has them (called once the
# script has imported what it needs: an import opens files); ``give_back()`` returns
# them. ssl is imported first, as every process that reads over https has it.
SHORT_OF_FILES = """
import os, resource, ssl
"warm".encode("idna")  # imported on first use: a file to open
held = []
def leave(spare):
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    for _ in range(spare):
        os.close(held.pop())
def give_back():
    while held:
        os.close(held.pop())
"""


def make_certificate(where: Path, name: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate for ``name`` (an address, or a host name) and its key,
    made by Debian's openssl."""
    cert, key = where / f"{name}.pem", where / f"{name}.key"
    kind = "IP" if name[0].isdigit() else "DNS"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", f"/CN={name}", "-addext",
         f"subjectAltName={kind}:{name}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


def trusting(cert: Path, where: Path, kind: str) -> dict[str, str]:
    """The environment that makes ``cert`` the one trusted: as ``kind`` "a CA file", or
    "a CA directory" (OpenSSL's hashed name in ``where``, read at each handshake)."""
    if kind == "a CA file":
        return {"SSL_CERT_FILE": str(cert)}
    named = subprocess.run(
        ["openssl", "x509", "-hash", "-noout", "-in", str(cert)],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    (where / f"{named}.0").write_bytes(cert.read_bytes())
    return {"SSL_CERT_FILE": str(where / "none.pem"), "SSL_CERT_DIR": str(where)}


@contextlib.contextmanager
def tls_server(cert: Path, key: Path) -> Iterator[int]:
    """A port on 127.0.0.1 whose every connection gets one 200 over TLS, then a close."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connection.settimeout(5)
            with (
                contextlib.suppress(OSError),
                context.wrap_socket(connection, server_side=True) as tls,
            ):
                tls.recv(65536)
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


def run_child(script: str, environment: Mapping[str, str]) -> list[str]:
    """``script``'s output lines, run after SHORT_OF_FILES in a child whose environment
    has ``environment`` added."""
    done = subprocess.run(
        [sys.executable, "-c", SHORT_OF_FILES + script],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, **environment},
    )  # fmt: skip
    return done.stdout.splitlines()
