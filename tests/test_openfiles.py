"""The process's own want of descriptors, said as its own (llmhealth.openfiles)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# ssl imported first, as every process that reads over https has it: its import would
# otherwise be what fails for want of descriptors.
_BUILT_THEN_AGAIN = """
import errno, os, resource, ssl
from llmhealth.openfiles import default_tls
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
while SHORT:
    try:
        held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
try:
    default_tls()
    print("built")
except OSError as error:
    print("short", errno.errorcode[error.errno])
for descriptor in held:
    os.close(descriptor)
context = default_tls()
print("trusts", context.cert_store_stats()["x509"], context is default_tls())
"""


def run_with_ca_file(script: str, ca_file: Path) -> list[str]:
    """``script``'s lines, run in a child whose default CA file is ``ca_file``."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "SSL_CERT_FILE": str(ca_file)},
    )  # fmt: skip
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed certificate, made by Debian's openssl, as the trust store."""
    where = tmp_path_factory.mktemp("ca")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=llmhealth test CA",
         "-keyout", str(where / "key.pem"), "-out", str(where / "ca.pem")],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return where / "ca.pem"


def test_a_default_tls_context_built_with_no_descriptor_left_is_ours_and_not_kept(
    ca_file: Path,
) -> None:
    # Built then, it trusted no one, and was kept for the process's life.
    script = _BUILT_THEN_AGAIN.replace("SHORT", "True")
    assert run_with_ca_file(script, ca_file) == ["short EMFILE", "trusts 1 True"]


def test_a_ca_file_with_nothing_in_it_gives_a_context_that_is_kept(tmp_path: Path) -> None:
    # The operator's to mend: every handshake says so; not built again per connection.
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    script = _BUILT_THEN_AGAIN.replace("SHORT", "False")
    assert run_with_ca_file(script, empty) == ["built", "trusts 0 True"]
