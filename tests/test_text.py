"""printable: what a server sent, shown without any control or format character."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmhealth.config import check_url
from llmhealth.text import (
    dialable,
    header_safe,
    nagios_text,
    openai_root,
    other_server,
    printable,
    refuse_user_info,
    same_server,
    url_host,
)


@pytest.mark.parametrize(
    ("sent", "shown"),
    [
        ("engine 0", "engine 0"),
        ("0\x1b[2J", "0\\x1b[2J"),  # clear screen
        ("a\nforged log line", "a\\nforged log line"),
        ("tab\there", "tab\\there"),
        ("\x9b31m", "\\x9b31m"),  # the one-byte C1 CSI
        ("abc\u202edcba", "abc\\u202edcba"),  # right-to-left override
        ("modèle-日本", "modèle-日本"),  # printable non-ASCII stays as it is
        ("bell\x07", "bell\\x07"),
    ],
)
def test_control_and_format_characters_are_escaped_and_the_rest_kept(sent: str, shown: str) -> None:
    assert printable(sent) == shown


@given(st.text())
def test_anything_at_all_comes_out_printable(sent: str) -> None:
    assert printable(sent).isprintable()


@given(st.text().filter(str.isprintable))
def test_printable_text_is_left_alone(sent: str) -> None:
    assert printable(sent) == sent


SECRET_URLS = [
    "http://alice:s3cret@10.0.0.5:8000",
    "http://:s3cret@10.0.0.5:8000",
    "https://s3cret@10.0.0.5",
    "http://alice:s3/cr@t@10.0.0.5:8000",  # '/' and '@' in the password
    "http://alice:p@ss-s3cret@10.0.0.5:8000",  # what follows its first '@' is secret too
    "alice:s3cret@10.0.0.5:8000",  # no scheme
    # A CJK input method's '@' (full-width, small): urlsplit's NFKC check repeated it all.
    "http://alice:s3cret\uff2010.0.0.5:8000",
    "http://alice:s3cret\ufe6b10.0.0.5:8000",
]


@pytest.mark.parametrize("url", SECRET_URLS)
def test_a_url_with_user_info_is_refused_showing_only_what_follows_the_last_at(
    url: str,
) -> None:
    with pytest.raises(ValueError) as raised:
        refuse_user_info(url)
    message = str(raised.value)
    assert "s3" not in message and "alice" not in message
    assert "10.0.0.5" in message and "api_key_env" in message


@pytest.mark.parametrize(
    "url",
    [
        "10.0.0.1:8000?api_key=sk-SECRET",  # no scheme
        "ftp://10.0.0.1/?token=sk-SECRET",
        "http://10.0.0.1:8000/?api_key=sk-SECRET",
        "http://10.0.0.1:8000/v1;key=sk-SECRET",
        "http://alice@10.0.0.1:8000/?api_key=sk-SECRET",
        "http://10.0.0.1:8000/?user=bob@example.com&api_key=sk-SECRET",
        "http://10.0.0.1:8000/#me@x&api_key=sk-SECRET",
    ],
)
def test_a_refused_url_is_never_repeated_past_its_query(url: str) -> None:
    # The scheme check came first and repeated the whole URL, key and all.
    with pytest.raises(ValueError) as raised:
        check_url(url)
    assert "SECRET" not in str(raised.value)


def test_a_url_without_user_info_passes() -> None:
    refuse_user_info("http://10.0.0.5:8000/v1")


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("http://Host:8000/", "HTTP://host:8000"),
        ("http://host", "http://host:80/"),
        ("https://host:443", "https://HOST"),
        ("http://[::1]:80", "http://[::1]"),
        ("http://127.0.0.1:018100", "http://127.0.0.1:18100"),  # two rows for one server
        ("http://host:", "http://host"),
        ("http://host:0080", "http://host"),
        ("http://[::1]:0443", "http://[::1]:443/"),
    ],
)
def test_urls_of_one_server_have_one_key(one: str, other: str) -> None:
    assert same_server(one) == same_server(other)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("http://host:443", "http://host"),  # https's port, not http's
        ("http://host:8080", "http://host:80"),
        ("http://host:8080", "http://host"),
        ("http://host/a", "http://host/b"),
        ("http://host:0", "http://host"),
        ("http://[::1]", "http://[::18]"),
    ],
)
def test_urls_of_two_servers_have_two_keys(one: str, other: str) -> None:
    assert same_server(one) != same_server(other)


def test_other_server_takes_a_url_written_another_way_for_the_same_server() -> None:
    assert not other_server("http://h:80/", "HTTP://H")
    assert not other_server("http://h:018100", "http://h:18100")
    assert other_server("http://h:8000", "http://h:8001")
    assert other_server("http://h/a", "http://h/b")


@pytest.mark.parametrize(
    ("host", "dialled"),
    [
        ("fe80::1%25eth0", "fe80::1%eth0"),
        ("fe80::1%25en%2D1", "fe80::1%en-1"),
        ("fe80::1", "fe80::1"),
        ("gpu%25a.example", "gpu%25a.example"),  # a name has no zone
        ("10.0.0.1", "10.0.0.1"),
    ],
)
def test_an_ipv6_zone_is_dialled_as_the_resolver_writes_it(host: str, dialled: str) -> None:
    assert dialable(host) == dialled


@pytest.mark.parametrize(
    ("host", "written"),
    [
        ("::1", "[::1]"),
        ("fe80::1%eth0", "[fe80::1%25eth0]"),
        ("127.0.0.1", "127.0.0.1"),
        ("gpu0.example", "gpu0.example"),
    ],
)
def test_a_listen_host_is_written_in_a_url_as_a_client_reads_it(host: str, written: str) -> None:
    assert url_host(host) == written
    assert dialable(written.strip("[]")) == host  # the resolver is given it back as it was


def test_a_nagios_line_shows_a_pipe_as_a_broken_bar_so_the_message_is_not_cut() -> None:
    assert nagios_text("model a|b\x1b[2J") == "model a\N{BROKEN BAR}b\\x1b[2J"


@pytest.mark.parametrize(
    ("text", "safe"),
    [("sk-abc123", True), ("sk-abc\r\nX-Evil: 1", False), ("sk-caf\u00e9", False), ("", True)],
)
def test_only_printable_ascii_goes_into_a_header(text: str, safe: bool) -> None:
    assert header_safe(text) is safe


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://10.0.0.5:8000/v1", "http://10.0.0.5:8000"),
        ("http://10.0.0.5:8000/v1/", "http://10.0.0.5:8000"),
        ("http://10.0.0.5:8000/api/v1", "http://10.0.0.5:8000/api"),
        ("http://10.0.0.5:8000", None),
        ("http://v1", None),  # a host named v1 is no base URL
        ("http://10.0.0.5:8000/apiv1", None),  # nor a path that only ends in "v1"
    ],
)
def test_an_openai_base_url_is_known_by_its_v1_path(url: str, root: str | None) -> None:
    assert openai_root(url) == root
