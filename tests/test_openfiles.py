"""The process's own want of descriptors, said as its own, and the links root follows
(llmhealth.openfiles)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tlsproc import make_certificate, run_child, trusting

from llmhealth.openfiles import UntrustedLinkError, trusted_target

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


def test_a_link_swapped_while_it_is_read_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked, then read: a link swapped in between led where the check never looked."""
    (tmp_path / "checked").write_text("state")
    (tmp_path / "elsewhere").write_text("not the state")
    link = tmp_path / "state.json"
    link.symlink_to("checked")
    read_link = os.readlink

    def swapped_meanwhile(path: str | os.PathLike[str]) -> str:
        value = read_link(path)
        (tmp_path / "swap").symlink_to("elsewhere")
        os.replace(tmp_path / "swap", link)
        return value

    monkeypatch.setattr(os, "readlink", swapped_meanwhile)
    with pytest.raises(UntrustedLinkError, match="changed while its link was read"):
        trusted_target(link)


def test_links_are_followed_to_the_file_with_its_directory_made_real(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "alias").symlink_to("data")
    (tmp_path / "second").symlink_to(tmp_path / "alias" / "state.json")
    (tmp_path / "state.json").symlink_to("second")
    assert trusted_target(tmp_path / "state.json") == tmp_path.resolve() / "data" / "state.json"
    assert trusted_target(tmp_path / "plain.json") == tmp_path.resolve() / "plain.json"
