"""The process's own want of descriptors, said as its own (llmhealth.openfiles)."""

from __future__ import annotations

from pathlib import Path

from tlsproc import make_certificate, run_child, trusting

_BUILT_THEN_AGAIN = """
import errno
from llmhealth.openfiles import default_tls
leave(SPARE)
try:
    default_tls()
    print("built")
except OSError as error:
    print("short", errno.errorcode[error.errno])
give_back()
context = default_tls()
print("trusts", context.cert_store_stats()["x509"], context is default_tls())
"""


def test_a_default_tls_context_built_with_no_descriptor_left_is_ours_and_not_kept(
    tmp_path: Path,
) -> None:
    # Built then, it trusted no one, and was kept for the process's life.
    cert, _ = make_certificate(tmp_path)
    output = run_child(
        _BUILT_THEN_AGAIN.replace("SPARE", "0"), trusting(cert, tmp_path, "a CA file")
    )
    assert output == ["short EMFILE", "trusts 1 True"]


def test_a_ca_file_with_nothing_in_it_gives_a_context_that_is_kept(tmp_path: Path) -> None:
    # The operator's to mend: every handshake says so; not built again per connection.
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    output = run_child(_BUILT_THEN_AGAIN.replace("leave(SPARE)", ""), {"SSL_CERT_FILE": str(empty)})
    assert output == ["built", "trusts 0 True"]
