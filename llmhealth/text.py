"""Text made safe to show and keep: a server's words escaped, a URL's secrets refused.

Pure. A label value, a header or a model id is the server's to choose; an ESC in one
would drive the operator's terminal, a newline would forge a log line, a bidi override
would reorder what they read. Everything a server said passes through ``printable``
where it enters llmhealth (probe.py), before any table, log, audit line or state file.
Every URL llmhealth keeps (backends, proxies, etcd endpoints, a library caller's base
URLs, a replacement's new address) passes through ``refuse_user_info`` first.
"""

from __future__ import annotations

import re
import unicodedata

_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")  # one percent-encoded byte (RFC 3986 2.1)


def printable(text: str) -> str:
    """``text`` with every non-printable character written as its Python escape.

    ``\\x1b[31m`` becomes the six visible characters ``\\x1b[31m``: nothing is lost to
    the reader, and nothing reaches a terminal as a control sequence.
    """
    if text.isprintable():  # the common case: one scan in C
        return text
    return "".join(
        character if character.isprintable() else repr(character)[1:-1] for character in text
    )


def nagios_text(text: str) -> str:
    """``text`` fit for a Nagios plugin's line: printable (``printable``), and each '|',
    which starts the performance data and would cut the message there, shown as the
    broken bar '¦' (one that latin-1 has too)."""
    return printable(text).replace("|", "\N{BROKEN BAR}")


def same_server(url: str) -> str:
    """A URL as a key for "the same server": scheme and host compared case-blind (DNS and
    HTTP are), the port as a number (``:018100`` is ``:18100``, an empty one none), the
    scheme's own port and the trailing slash dropped. The URL itself is kept as its user
    wrote it: a backend named after it keeps its name, and a caller's lookup by it still
    works."""
    scheme, sep, rest = url.rstrip("/").partition("://")
    if not sep:
        return url.rstrip("/")
    scheme, (host, slash, path) = scheme.lower(), rest.partition("/")
    name, colon, port = host.lower().rpartition(":")
    if colon and "]" not in port and (port == "" or (port.isascii() and port.isdigit())):
        port = port.lstrip("0") or ("0" if port else "")
        host = name if port in ("", _DEFAULT_PORTS.get(scheme)) else f"{name}:{port}"
    else:
        host = host.lower()
    return f"{scheme}://{host}{slash}{path}"


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def other_server(url: str, than: str) -> bool:
    """Whether ``url`` names another server than ``than`` (``same_server``'s rule), the
    texts compared first: on a settle's path they are nearly always equal."""
    return url != than and same_server(url) != same_server(than)


def openai_root(url: str) -> str | None:
    """The server's root when ``url`` is an OpenAI base URL (its path ends in ``/v1``, as
    clients and routers know backends by), else None: llmhealth reads ``/metrics``
    beside ``/v1``, so a backend is its root."""
    _, sep, rest = url.partition("://")
    path = "/" + rest.partition("/")[2] if sep else url
    if not path.rstrip("/").endswith("/v1"):
        return None  # a host named v1 is no base URL
    return url.rstrip("/").removesuffix("/v1")


def up_to_query(url: str) -> str:
    """A URL as an error may repeat it: cut before its query, parameters or fragment,
    where keys go (``?api_key=...``), with "..." where something was cut."""
    cut = min((at for at in map(url.find, "?#;") if at >= 0), default=-1)
    return url if cut < 0 else url[:cut] + "..."


def refuse_user_info(url: str) -> None:
    """ValueError when ``url`` carries a user name or password (``http://alice:s3cret@host``).

    Such a URL would be shown in every report, stored in the state file and the audit
    log, and exported as a label. The error never repeats what came before the ``@``: a
    password may itself hold ``/`` or ``@``, so only what follows the last one is safe;
    nor a query or fragment, where keys go too: an ``@`` only there (``?user=bob@x&key=``)
    shows nothing of the URL.

    Read as NFKC, as ``urlsplit`` reads a host: an '@' typed by a CJK input method (the
    full-width or small commercial at, U+FF20 or U+FE6B) passed here, and ``urlsplit``'s
    own error then repeated the whole of user, password and host.
    """
    if "@" not in url and url.isascii():
        return
    url = unicodedata.normalize("NFKC", url)
    if "@" in url:
        before_query = url[: min((at for at in map(url.find, "?#") if at >= 0), default=len(url))]
        host = before_query.rpartition("@")[2] if "@" in before_query else ""
        shown = printable(up_to_query(host.strip())) or "host:port"
        raise ValueError(
            "a URL with a user name or password in it (before '@') is not accepted; "
            f"give 'http(s)://{shown}' and put a key in the environment (for a backend, "
            "the variable its api_key_env names)"
        )


def header_safe(text: str) -> bool:
    """Whether ``text`` can go in an HTTP header as it is: ASCII with no CR, LF or other
    control character, so nothing ends the line early. The one rule for what llmhealth
    sends (``wire``), the keys a config names (``config.unset_key_variables``) and those
    the library is given (``Prober``)."""
    return text.isprintable() and text.isascii()


def dialable(host: str) -> str:
    """The host of a URL as the resolver takes it. An IPv6 address's zone is written
    "fe80::1%25eth0" in a URL (RFC 6874; the config accepts it) and "fe80::1%eth0" to the
    resolver: passed as written, no such address ever resolved, and a healthy backend
    (or an etcd endpoint) read as down every time."""
    address, escaped, zone = host.partition("%25")
    if not escaped or ":" not in address:
        return host
    return f"{address}%{_PERCENT.sub(lambda code: chr(int(code[1], 16)), zone)}"


def url_host(host: str) -> str:
    """A listen address's host as a URL writes it, ``dialable`` undone: an IPv6 address in
    brackets, its zone's '%' written "%25" (RFC 6874). Written bare, `watch --listen
    [::1]:9464` logged "metrics on http://::1:9464/metrics", a URL no client takes."""
    if ":" not in host:
        return host
    address, percent, zone = host.partition("%")
    return f"[{address}%25{zone}]" if percent else f"[{address}]"
