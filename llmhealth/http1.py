"""HTTP/1.1 message rules (RFC 9112) that both of the router's sides apply, written once.

Pure: text and bytes in, values or ``FramingError`` out. ``upstream.py`` reads backends'
answers with them and ``edge.py`` reads clients' requests; each turns ``FramingError``
into its own outcome (a broken backend exchange, a 4xx to the client).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final, Protocol

MAX_HEAD_BYTES: Final = 64 * 1024  # start line and fields; a chunk-size line; trailers
# Methods a client may send again on its own (RFC 9110 section 9.2.2): a request that met
# a reused connection closing under it is sent once more only if it is one of these.
IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
MAX_FIELDS: Final = 100  # header fields in one head
MAX_INFORMATIONAL: Final = 8  # 1xx answers skipped before the real one
# Bytes each chunk of a chunked body costs at least, its data and framing together: a
# chunk costs an await or a parse whatever its size, so one-byte chunks (16 million in a
# 16 MiB body) or long extensions would otherwise hold a loop for seconds. The backends'
# answers (``wire``), etcd's (``etcd_http``) and the clients' requests (``edge``) are
# held to it.
CHUNK_COST: Final = 128
TOKEN: Final = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"  # RFC 9110 5.6.2: a method, a field name
_FIELD_NAME: Final = re.compile(TOKEN)
# Control characters a field may not carry (tab is a value's; CR and LF end the line).
_CONTROL: Final = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class FramingError(ValueError):
    """The bytes are not an HTTP/1.x message as RFC 9112 frames it; the text says where,
    ``status`` what a server answers a client's message with (400 unless said)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class HeaderSource(Protocol):
    """What the header rules read: a dict, or ``Fields``."""

    def items(self) -> Iterable[tuple[str, str]]: ...

    def get(self, name: str, /) -> str | None: ...


class Fields:
    """Header fields in the order sent, names' case and repeats kept, looked up without
    regard to case (as HTTP's field names are)."""

    __slots__ = ("_pairs",)

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        self._pairs = list(pairs)

    def items(self) -> list[tuple[str, str]]:
        return self._pairs

    def keys(self) -> list[str]:
        return [name for name, _ in self._pairs]

    def get(self, name: str, default: str | None = None) -> str | None:
        lower = name.lower()
        for field, value in self._pairs:
            if field.lower() == lower:
                return value
        return default

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: str) -> None:
        """Replace every field of this name by one."""
        lower = name.lower()
        self._pairs = [(n, v) for n, v in self._pairs if n.lower() != lower]
        self._pairs.append((name, value))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __len__(self) -> int:
        return len(self._pairs)

    def add(self, name: str, value: str) -> None:
        self._pairs.append((name, value))


def head_lines(head: str) -> list[str]:
    """A head's lines without its blank last line; a bare CR or LF, or a NUL, anywhere in
    it is an error: a field value must never carry a line break to the next hop. (A
    start line has rules of its own; a reason phrase is shown escaped.)"""
    pairs = head.count("\r\n")
    if "\x00" in head or head.count("\r") != pairs or head.count("\n") != pairs:
        raise FramingError("a bare CR or LF, or a NUL, in the head")
    return head.split("\r\n")


def status_line(line: str) -> tuple[str, int, str]:
    """An answer's version, status code and reason phrase (the phrase unescaped).

    A code below 100 is no status (RFC 9110 15): relayed, "HTTP/1.1 99" is a line no
    client reads, and its answer passed for a 1xx without a body. One above 599 is read
    as RFC 9110 says a client does, as a 5xx."""
    version, _, rest = line.partition(" ")
    code, _, reason = rest.partition(" ")
    # isascii: latin-1 "\xb2" is a digit to isdigit() and not to int().
    if version not in ("HTTP/1.1", "HTTP/1.0") or not (
        len(code) == 3 and code.isascii() and code.isdigit() and code[0] != "0"
    ):
        raise FramingError(f"not an HTTP/1.x status line: {line[:80]!r}")
    return version, int(code), reason


def fields(lines: Iterable[str]) -> list[tuple[str, str]]:
    """``name: value`` lines as pairs, values trimmed of spaces and tabs (RFC 9112 5).

    A name that is not a token (a space, a bracket: "Transfer Encoding") or a control
    character in a value went on to the backend, which could read them otherwise. The
    checks take the common case first (a printable line, a name of letters, digits and
    dashes): a regular expression per field cost the router 2 µs per request.
    """
    parsed = []
    for line in lines:
        name, colon, value = line.partition(":")
        if (
            not colon
            or not (
                (name.isascii() and name.replace("-", "").isalnum()) or _FIELD_NAME.fullmatch(name)
            )
            or not (line.isprintable() or not _CONTROL.search(line))
        ):
            raise FramingError(f"malformed header line: {line[:80]!r}")
        parsed.append((name, value.strip(" \t")))
    if len(parsed) > MAX_FIELDS:
        raise FramingError(f"more than {MAX_FIELDS} header fields", 431)
    return parsed


def connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    """The Connection field's options, lower case (``close``, ``keep-alive``, field names)."""
    tokens: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            tokens |= {token.strip().lower() for token in value.split(",") if token.strip()}
    return tokens


def keep_alive(version: str, tokens: set[str]) -> bool:
    """Whether the connection carries another message after this one (RFC 9112 9.3):
    never with ``close``, whatever else is listed (an HTTP/1.0 message saying both
    ``keep-alive`` and ``close`` was kept)."""
    if "close" in tokens:
        return False
    return version != "HTTP/1.0" or "keep-alive" in tokens


def body_fields(headers: Iterable[tuple[str, str]]) -> tuple[str | None, str | None]:
    """The Transfer-Encoding and Content-Length values, repeats joined by commas."""
    coding = length_text = None
    for name, value in headers:
        lower = name.lower()
        if lower == "transfer-encoding":
            coding = value if coding is None else f"{coding}, {value}"
        elif lower == "content-length":
            length_text = value if length_text is None else f"{length_text}, {value}"
    return coding, length_text


def require_chunked(coding: str) -> None:
    """A Transfer-Encoding this side can read: chunked alone. ``gzip, chunked`` was read
    as chunked and its gzip dropped, passing compressed bytes on as the body."""
    if coding.strip().lower() != "chunked":
        raise FramingError(f"unsupported Transfer-Encoding: {coding[:80]}", 501)


def content_length(length_text: str) -> int:
    """One length, however often repeated; anything else is an error (RFC 9112 6.3)."""
    lengths = {part.strip() for part in length_text.split(",")}
    length = lengths.pop()
    if lengths or not length.isascii() or not length.isdigit() or len(length) > 18:
        raise FramingError(f"bad Content-Length: {length_text[:80]}")
    return int(length)


def chunk_size(line: bytes) -> int:
    """A chunk-size line (extensions ignored) as the size it announces."""
    size_text = line.split(b";", 1)[0].strip()
    if not size_text or len(size_text) > 16 or not _is_hex(size_text):
        raise FramingError(f"bad chunk size line: {bytes(line[:40])!r}")
    return int(size_text, 16)


def _is_hex(text: bytes) -> bool:
    return all(byte in b"0123456789abcdefABCDEF" for byte in text)
