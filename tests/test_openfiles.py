"""The process's own want of descriptors, said as its own, and the links root follows
(llmhealth.openfiles)."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket
import ssl
from pathlib import Path

import pytest
from tlsproc import make_certificate, run_child, trusting

from llmhealth.openfiles import (
    FILE_LIMIT_CEILING,
    UntrustedLinkError,
    connect_one_of,
    output_gone,
    raise_file_limit,
    trust_unread,
    trusted_target,
)

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


def test_a_soft_file_limit_one_short_of_the_hard_one_is_raised_to_it() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = FILE_LIMIT_CEILING if hard == resource.RLIM_INFINITY else hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling - 1, hard))
    try:
        assert raise_file_limit() == ceiling
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == ceiling
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_unknown_issuer_is_our_want_of_descriptors_only_when_we_were_short() -> None:
    refused = ssl.SSLCertVerificationError(1, "certificate verify failed")
    refused.verify_code = 20  # X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY
    assert trust_unread(refused, short=True)
    assert not trust_unread(refused, short=False)


def test_every_address_refusing_alike_raises_that_one_error() -> None:
    # The one error as it is (its type and errno), not an OSError naming it twice.
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    found = socket.getaddrinfo("127.0.0.1", port, socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):
        asyncio.run(connect_one_of("localhost", [found[0], found[0]]))


def test_an_output_over_quota_is_an_output_gone() -> None:
    assert output_gone(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not output_gone(OSError(errno.EACCES, "Permission denied"))


def test_as_root_a_dot_dot_names_the_directory_above(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("as root only")
    (tmp_path / "a").mkdir()
    assert trusted_target(tmp_path / "a" / ".." / "state.json") == tmp_path / "state.json"


def test_as_root_no_more_links_are_followed_than_the_kernel_follows(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("as root only")
    (tmp_path / "link41").symlink_to("state.json")
    for number in range(41, 0, -1):
        (tmp_path / f"link{number - 1}").symlink_to(f"link{number}")
    # 40 links on the way are Linux's limit, and followed; 41 are not.
    assert trusted_target(tmp_path / "link2") == tmp_path / "state.json"
    with pytest.raises(UntrustedLinkError, match="too many levels"):
        trusted_target(tmp_path / "link1")
