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


def test_links_are_followed_to_the_file_with_its_directory_made_real(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "alias").symlink_to("data")
    (tmp_path / "second").symlink_to(tmp_path / "alias" / "state.json")
    (tmp_path / "state.json").symlink_to("second")
    assert trusted_target(tmp_path / "state.json") == tmp_path.resolve() / "data" / "state.json"
    assert trusted_target(tmp_path / "plain.json") == tmp_path.resolve() / "plain.json"


def test_as_root_a_path_another_user_could_redirect_is_refused(tmp_path: Path) -> None:
    """Root's writes go only where nobody else can change the way: not below a directory
    of another user's, nor through a link of root's in one (it can be renamed)."""
    if os.geteuid() != 0:
        pytest.skip("as root only")
    service = tmp_path / "service"
    (service / "sub").mkdir(parents=True)
    os.chown(service, 40123, 40123)
    # The directory holding the file may be anyone's: nothing in it is followed.
    assert trusted_target(service / "state.json") == service / "state.json"
    with pytest.raises(UntrustedLinkError, match=r"service, a directory above .* uid 40123"):
        trusted_target(service / "sub" / "state.json")
    (service / "state.json").symlink_to(tmp_path / "elsewhere.json")  # root's own link
    with pytest.raises(UntrustedLinkError, match="above the symbolic link"):
        trusted_target(service / "state.json")
    open_to_all = tmp_path / "shared"
    (open_to_all / "sub").mkdir(parents=True)
    open_to_all.chmod(0o777)
    with pytest.raises(UntrustedLinkError, match="writable by others than root"):
        trusted_target(open_to_all / "sub" / "state.json")
    open_to_all.chmod(0o1777)  # sticky, as /tmp: what root made there stays root's
    assert trusted_target(open_to_all / "sub" / "state.json") == open_to_all / "sub" / "state.json"
