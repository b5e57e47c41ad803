"""TOML configuration into frozen dataclasses.

Every error names the file and the key, and an unknown key is an error: a typo in a
threshold must not silently leave the default in force on a fleet that restarts servers.
"""

from __future__ import annotations

import math
import os
import re
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from llmhealth.choice import Affinity
from llmhealth.classify import Target
from llmhealth.openfiles import lock_beside, read_regular_file
from llmhealth.text import header_safe, openai_root, refuse_user_info, same_server, up_to_query
from llmhealth.window import WedgeRules

DEFAULT_WAIT = 5.0
DEFAULT_TIMEOUT = 5.0
DEFAULT_ANSWER_TIMEOUT = 10.0
DEFAULT_MAX_BODY = 16 * 1024 * 1024
# The most a `max_body` may say (a /metrics read, a routed request's body): each is held
# whole in memory, one per backend read at once or per client. A typo's extra digits
# (16000000000) made the bound no bound, and one endless answer took the host's memory.
MOST_MAX_BODY: Final = 1024 * 1024 * 1024
DEFAULT_STALL_TIMEOUT = 600.0
DEFAULT_LEASE_TTL = 10.0
DEFAULT_PREFIX = "/llmhealth/default"
MIN_LEASE_TTL = 2.0  # etcd raises shorter leases to its own minimum (about 1.5 s)
DEFAULT_AUDIT_KEEP = 10_000  # audit records kept in etcd: at most 8 KiB each, 80 MiB in all
MIN_AUDIT_KEEP = 100
# At 8 KiB a record, 100,000 is 800 MiB under the prefix, within etcd's default 2 GiB
# quota; an unbounded value let the trail fill the quota, and etcd then refuses every
# write, the state's with it, until an operator defragments and disarms the alarm.
MAX_AUDIT_KEEP = 100_000
DEFAULT_MAX_CHECK_TIME = 300.0
# Each read worker is an interpreter of its own (tens of MB), started at once: a slip such
# as 4000 (the targets "auto" gives one worker) started thousands of processes, and 10**9
# ended `watch` in a MemoryError. "auto" never starts more than the usable cores.
MAX_READ_WORKERS = 256
# A bound against a wrong path (a log, an image, /dev/zero), not against a large fleet:
# 10,000 backends with every key set (restart, cgroup, model) are under 3 MiB of TOML.
# Read whole, a larger file would hold up a reload and could fill the memory.
MAX_CONFIG_BYTES = 8 * 1024 * 1024

# Past a year a duration is a slip (a unit missed, milliseconds written as seconds): 1e300
# was taken, and a read, a restart's grace or a cooldown never ended; `hold --for 1e308`
# printed a 300-digit "until", and a forgotten hold turned restarts off for good.
LONGEST_DURATION = 366 * 86400.0
# A read, a tiny request and the wait between reads: past an hour, a check from cron
# holding the state's lock for hours (`timeout = 5000`, meant in milliseconds).
LONGEST_READ = 3600.0
# No timer here counts less than a millisecond (uvloop's count in them), so a shorter
# duration is a slip: `wait = 1e-310` was taken, and the reads a check may take
# (max_check_time over the wait) overflowed a float: every backend `no_metrics` with an
# OverflowError, and `watch`'s reading tasks died and were started again in a loop.
SHORTEST_DURATION = 0.001
# tomllib's time and memory grow with the square of a key's dotted parts (of a table
# header's too, for each key under it): 20 KB of `a.a.a...` took 400 MB and 2 s, 80 KB
# more memory than the host had, and a header of 10,000 parts over 20,000 short keys 40 s,
# a reload holding the daemon's loop all the while. No config key has more than three
# parts; a run of more, in a key or in a value (a host name), is refused unparsed: the
# worst file left costs a few times what a flat one of its size does.
MAX_KEY_PARTS = 16
_KEY_PART = r"""(?:[A-Za-z0-9_-]++|"(?:[^"\\\n]|\\.)*+"|'[^'\n]*+')"""
# Starting only where no bare key goes on, a run is scanned once (linear, not quadratic).
_DEEP_KEY = re.compile(rf"(?<![A-Za-z0-9_-])(?:{_KEY_PART}[ \t]*+\.[ \t]*+){{{MAX_KEY_PARTS}}}")
_NEVER_IN_A_ROUTE = re.compile(r"[?#*\s\x00-\x1f\x7f]")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_FLOAT_LIMIT = 10**308  # any integer up to it converts to a float
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
# request_failures: condemned by real traffic through `route`; opt-in, since a wedge proven
# by reads is the only cause that says a restart will help.
_VERDICTS_RESTARTABLE = frozenset(
    {"wedged", "unanswered", "unresponsive", "down", "request_failures"}
)


class ConfigError(Exception):
    """A configuration that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class Policy:
    unhealthy_threshold: int = 3
    healthy_threshold: int = 2
    min_healthy: int = 1
    restart_on: tuple[str, ...] = ("wedged",)
    max_concurrent_restarts: int = 1
    restart_budget: int = 5
    restart_budget_window: float = 86400.0
    cooldown: float = 60.0
    cooldown_max: float = 1800.0
    startup_grace: float = 900.0
    restart_timeout: float = 120.0
    # On for check, watch and route: a process condemned by doubt may prove its way back.
    recover_in_place: bool = True
    max_in_place_recoveries: int = 3
    # The wedge window's configured terms (llmhealth.window): a floor for every backend
    # (0: two waits), and the window of a process younger than startup_grace.
    wedge_after: float = 0.0
    startup_wedge_after: float = 300.0


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    url: str
    restart: tuple[str, ...] = ()
    api_key_env: str | None = None
    expected_model: str | None = None
    wedge_after: float | None = None  # this backend's floor; None: the policy's
    cgroup: str | None = None  # cgroup v2 directory of its processes, for CPU evidence


@dataclass(frozen=True, slots=True)
class Proxy:
    name: str
    url: str


DEFAULT_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
)


@dataclass(frozen=True, slots=True)
class Router:
    """``[router]``: how ``llmhealth route`` forwards. Times are seconds, sizes bytes."""

    listen: str | None = None  # HOST:PORT; --listen wins
    routes: tuple[str, ...] = DEFAULT_ROUTES  # forwarded paths; anything else is a JSON 404
    affinity: str | None = None  # "header:NAME" or "body:FIELD": keep a session on a backend
    affinity_slack: int = 4  # requests in flight beyond the least loaded that break affinity
    max_body: int = 16 * 1024 * 1024  # a larger request body gets 413
    body_timeout: float = 30.0  # to receive a whole request body, else 408
    connect_timeout: float = 3.0  # to connect to a backend; a miss is retried elsewhere
    # Response headers from a backend: vLLM sends them for a non-streamed answer only when
    # the whole answer is generated, so this must exceed the longest such generation.
    first_byte_timeout: float = 300.0
    stream_idle_timeout: float = 60.0  # silence in a started response that ends it
    client_timeout: float = 60.0  # a client that takes no data for this long is dropped
    # A client connection with no request in progress (never sent a whole request head, or
    # kept alive after its last answer) is closed after this long: idle sockets are bounded.
    idle_timeout: float = 75.0
    no_backend_status: int = 503


@dataclass(frozen=True, slots=True)
class Cluster:
    """Several daemons on one fleet: etcd holds the lease, the leader key and the record."""

    etcd: tuple[str, ...]
    prefix: str = DEFAULT_PREFIX
    lease_ttl: float = DEFAULT_LEASE_TTL
    member: str | None = None  # default: host name and PID
    audit_keep: int = DEFAULT_AUDIT_KEEP  # the newest audit records kept under the prefix
    shard_reads: bool = False  # each member reads its share; the leader settles them all


# The source of a config no file gave: the defaults, with what the command line said.
COMMAND_LINE: Final = "<command line>"


@dataclass(frozen=True, slots=True)
class Config:
    wait: float = DEFAULT_WAIT
    timeout: float = DEFAULT_TIMEOUT
    answer_timeout: float = DEFAULT_ANSWER_TIMEOUT
    max_body: int = DEFAULT_MAX_BODY
    state: str | None = None
    audit_log: str | None = None
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    on_serving_change: tuple[str, ...] = ()
    max_check_time: float = DEFAULT_MAX_CHECK_TIME
    # `watch`'s reading processes; None is "auto": as many as the fleet's size calls for,
    # up to the cores (readers.worker_count); 1 reads in the daemon's own event loop.
    read_workers: int | None = None
    policy: Policy = field(default_factory=Policy)
    backends: tuple[Backend, ...] = ()
    proxies: tuple[Proxy, ...] = ()
    router: Router = field(default_factory=Router)
    cluster: Cluster | None = None
    source: str = COMMAND_LINE

    def cannot_replace(self, running: Config) -> str | None:
        """Why this config may not replace ``running`` in a live daemon (SIGHUP), or None.

        Where the ledger lives ([cluster], ``state``, ``audit_log``) is chosen when the
        daemon starts: taken half-way, a node that gained a [cluster] would go on acting
        alone on its state file, and one that lost it would settle without the lease."""
        moved = [
            name
            for name, now, before in (
                ("[cluster]", self.cluster, running.cluster),
                ("state", self.state, running.state),
                ("audit_log", self.audit_log, running.audit_log),
            )
            if now != before
        ]
        if not moved:
            return None
        return f"{', '.join(moved)} changed: where the ledger lives takes a restart"

    @property
    def key_variables(self) -> frozenset[str]:
        """The environment variables that hold an API key: no command llmhealth runs gets them."""
        return frozenset(backend.api_key_env for backend in self.backends if backend.api_key_env)

    def wedge_rules(self, backend: Backend | None = None) -> WedgeRules:
        """The wedge window's rules for a configured backend, or for a bare URL."""
        floor = self.policy.wedge_after
        if backend is not None and backend.wedge_after is not None:
            floor = backend.wedge_after
        return WedgeRules(
            wedge_after=floor,
            startup_grace=self.policy.startup_grace,
            startup_wedge_after=self.policy.startup_wedge_after,
        )


def load(path: str | Path) -> Config:
    """Read and validate a config file; any problem is a ConfigError naming file and key."""
    import tomllib  # noqa: PLC0415 - a check of bare URLs reads no file

    where = str(path)
    if not where.strip():  # Path("") is the working directory: "cannot read: Is a directory"
        raise ConfigError("an empty config path: name a file, or leave it out")
    raw = _read_bounded(Path(path), where)
    try:
        # A byte order mark first (saved so by some Windows editors) is not TOML, and
        # tomllib's "Invalid statement (at line 1, column 1)" did not say what was wrong.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text: {exc}") from exc
    if (deep := _DEEP_KEY.search(text)) is not None:
        line = text.count("\n", 0, deep.start()) + 1
        raise ConfigError(
            f"{where}: line {line}: more than {MAX_KEY_PARTS} dotted parts in a row: no key of "
            "a config is that deep"
        )
    try:
        data = tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, and an integer past Python's digit limit
        raise ConfigError(f"{where}: not valid TOML: {exc}") from exc
    except RecursionError:  # tomllib's parser recurses per level of nested arrays
        raise ConfigError(f"{where}: nested too deeply to be a config") from None
    # Paths in the file are the file's: a cron job and an operator's shell in other
    # directories must reach one ledger.
    return from_mapping(data, where, base=Path(path).absolute().parent)


def _read_bounded(path: Path, where: str) -> bytes:
    """The file's bytes, if it is a regular file of at most ``MAX_CONFIG_BYTES``: a reload
    runs on the daemon's loop, which a FIFO or a device must not hold (``openfiles``)."""
    try:
        raw = read_regular_file(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    return raw


def from_mapping(data: Mapping[str, Any], where: str, *, base: Path | None = None) -> Config:
    """A config from parsed TOML. ``base``: the directory relative ``state`` and
    ``audit_log`` paths are taken from (the config file's); None leaves them as given."""
    reader = _Reader(where)
    reader.known(
        data,
        "",
        {"wait", "timeout", "answer_timeout", "max_body", "state", "audit_log", "policy"}
        | {"backend", "proxy", "stall_timeout", "on_serving_change", "router", "cluster"}
        | {"max_check_time", "read_workers"},
    )
    policy = _policy(reader, data.get("policy", {}))
    backends = tuple(
        _backend(reader, entry, f"backend[{index}]")
        for index, entry in enumerate(reader.table_list(data, "backend"))
    )
    proxies = tuple(
        _proxy(reader, entry, f"proxy[{index}]")
        for index, entry in enumerate(reader.table_list(data, "proxy"))
    )
    # One text in two Unicode forms ("café" composed and decomposed) is one name to every
    # reader: status, Nagios perfdata and logs showed two backends as one.
    named = Counter(_same_name(backend.name) for backend in backends) + Counter(
        _same_name(p.name) for p in proxies
    )
    duplicates = sorted(name for name, count in named.items() if count > 1)
    if duplicates:
        raise ConfigError(f"{where}: name used twice: {', '.join(duplicates)}")
    _refuse_shared_urls(
        where,
        [(f"backend[{i}]", b.url) for i, b in enumerate(backends)],
        [(f"proxy[{i}]", p.url) for i, p in enumerate(proxies)],
    )
    state = _path(reader, data, "state", base)
    audit_log = _path(reader, data, "audit_log", base)
    if state is not None and audit_log is not None:
        try:
            check_audit_path(Path(state), Path(audit_log))
        except ConfigError as exc:
            raise reader.fail("audit_log", str(exc)) from None
    return Config(
        wait=reader.duration(data, "wait", DEFAULT_WAIT, most=LONGEST_READ),
        timeout=reader.duration(data, "timeout", DEFAULT_TIMEOUT, most=LONGEST_READ),
        answer_timeout=reader.duration(
            data, "answer_timeout", DEFAULT_ANSWER_TIMEOUT, most=LONGEST_READ
        ),
        max_body=reader.integer(
            data, "max_body", DEFAULT_MAX_BODY, minimum=1024, most=MOST_MAX_BODY
        ),
        state=state,
        audit_log=audit_log,
        stall_timeout=reader.duration(data, "stall_timeout", DEFAULT_STALL_TIMEOUT),
        on_serving_change=reader.command(data, "on_serving_change", empty_is_none=True),
        max_check_time=reader.duration(data, "max_check_time", DEFAULT_MAX_CHECK_TIME),
        read_workers=None
        if data.get("read_workers", "auto") == "auto"
        else reader.integer(data, "read_workers", 1, minimum=1, most=MAX_READ_WORKERS),
        policy=policy,
        backends=backends,
        proxies=proxies,
        router=_router(reader, data.get("router", {})),
        cluster=_cluster(reader, data["cluster"]) if "cluster" in data else None,
        source=where,
    )


def parse_duration(value: object, most: float = LONGEST_DURATION) -> float:
    """Seconds from a number or a string such as "90s", "15m", "24h", from a millisecond
    (``SHORTEST_DURATION``) up to ``most``; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int) and abs(value) > _FLOAT_LIMIT:
        # Past a float's range (TOML takes 4,300 digits): float() raises OverflowError,
        # which is no ValueError; and its digits are not repeated.
        raise ValueError(f"an integer of {len(str(abs(value)))} digits is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    else:
        raise ValueError(f"{value!r} is not a duration (a number of seconds, or like '90s', '15m')")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{value!r} must be a positive, finite duration")
    if seconds < SHORTEST_DURATION:
        raise ValueError(
            f"{value!r} is shorter than a millisecond, the least duration a timer here counts"
        )
    if seconds > most:
        longest = f"{most / 86400:g} days" if most >= 86400 else f"{most / 3600:g} h"
        raise ValueError(f"{value!r} is longer than {longest}: a unit missed?")
    return seconds


def _is_zero(value: object) -> bool:
    """Whether ``value`` is a duration of nothing, in any unit (0, "0m", "0.0s"): where 0
    turns a term off, "0m" was refused as "must be a positive duration"."""
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return float(match.group(1)) == 0
    return not isinstance(value, bool) and isinstance(value, int | float) and value == 0


def _same_name(name: str) -> str:
    """A name as compared with another: in Unicode's composed form (NFC), as shown."""
    return unicodedata.normalize("NFC", name)


def name_for_url(url: str) -> str:
    """A bare URL's backend name: host and port, which is what an operator types.

    ValueError naming the URL when that name breaks the rule every name keeps
    (``name_problem``): a host is the URL's to choose, not a promise of a clean name.
    """
    parts = urlsplit(url)
    name = parts.netloc or url
    if (problem := name_problem(name)) is not None:
        raise ValueError(
            f"{url!r} would be named {name!r}, which {problem}; "
            "name it in a config file ([[backend]] name = ...)"
        )
    return name


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a backend or proxy, or None when it can.

    A name is shown as it is: a control character would reach the terminal, a '|' starts
    a Nagios line's performance data, and a perfdata label cannot hold '=' (one written
    as '_' would merge two backends' graphs). "none" is the router's label for the
    answers it gives itself (``llmhealth_router_requests_total{backend="none"}``): a
    backend so named had its answers counted with the router's own, and its series kept
    after a reload dropped it.
    """
    if not name.isprintable() or "|" in name or "=" in name:
        return "must be printable and have no '|' or '=' (Nagios perfdata labels)"
    if name == "none":
        return 'is taken: the router counts its own answers under backend="none"'
    return None


# A server's own endpoints, never a root: what a scrape job, an older health check, a
# client or a curl line copied into a config names the server by.
SERVER_ENDPOINTS: Final = (
    "/metrics",
    "/health",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
)


def check_url(url: str) -> str:
    """A server's root (a backend's or a proxy's): a base URL (``check_base_url``) that is
    not an OpenAI base URL nor one of the server's own endpoints (``SERVER_ENDPOINTS``);
    ValueError otherwise."""
    root = check_base_url(url)
    if (server := openai_root(root)) is not None:
        # An OpenAI base URL: read as a root it gives /v1/metrics, a 404 from a healthy
        # server, and every verdict after it wrong.
        raise ValueError(
            f"{url!r} ends in /v1: give the server's root ({server}); "
            "llmhealth reads /metrics beside /v1"
        )
    path = urlsplit(root).path  # a host named "health" is a root
    if (endpoint := next(filter(path.endswith, SERVER_ENDPOINTS), None)) is not None:
        # The address a Prometheus scrape job names, or an old health check's, or a
        # request's: read as a root it gives /metrics/metrics, /health/v1/models and
        # the like, 404s from a healthy server, judged no_metrics with its tiny request
        # failed: CRITICAL, DEAD after three checks.
        server = root.removesuffix(endpoint)
        # Above a /v1 as well: "http://a:8000/v1/metrics" (a base URL with /metrics put
        # after it) was told to give http://a:8000/v1, a root refused in its turn.
        server = openai_root(server) or server
        raise ValueError(
            f"{url!r} ends in {endpoint}: give the server's root "
            f"({server}); llmhealth reads /metrics and /v1 below it"
        )
    return root


def check_base_url(url: str) -> str:
    """A base URL with scheme and host, without trailing slash; ValueError otherwise.

    A URL with user-info is refused (``text.refuse_user_info``, the one rule for every URL
    llmhealth keeps). An etcd endpoint is checked by this alone: ``check_url``'s "give the
    server's root, llmhealth reads /metrics and /v1 below it" is not true of one (etcd
    serves its own /metrics, a scrape target an operator may copy), whose path is refused
    as not used.
    """
    refuse_user_info(url)
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        # "10.0.0.1:8000?api_key=..." (no scheme) is such a URL: shown up to its query.
        raise ValueError(f"{up_to_query(url)!r} is not an http(s) URL with a host")
    if parts.query or parts.fragment or ";" in parts.path:
        # Every path is appended to the base (a query would swallow "/metrics"), and a
        # query is where a key often goes: it is not repeated here, nor stored.
        raise ValueError(
            f"{up_to_query(url.strip())!r}: a base URL takes no query, parameters or fragment"
            " (an API key goes in api_key_env)"
        )
    if any(character.isspace() for character in parts.netloc):
        # No host name holds a space: resolved, it failed as the server's `down` (exit 2).
        raise ValueError(f"{url!r} has white space in its host and port")
    if not parts.path.isprintable():
        # A NUL ("\\u0000" in TOML) passed `config check`, then reached a restart command's
        # LLMHEALTH_URL, which no process can be given: `check` died with a traceback.
        raise ValueError(f"{url!r} has a control character in its path")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} has a bad port") from exc
    if port == 0:  # nothing listens there; the router read it as the scheme's own port
        raise ValueError(f"{url!r} has port 0")
    if ":" not in parts.hostname:  # an IPv6 literal is no name
        if (odd := _NOT_IN_A_HOST.search(parts.hostname)) is not None:
            # "${VLLM_HOST}": no variable is expanded in a URL, and a host no lookup can
            # find was judged the server's `down` (a CRITICAL for a typo).
            unexpanded = " (a variable is not expanded here)" if odd.group() in "${}" else ""
            raise ValueError(
                f"{url!r}: its host holds {odd.group()!r}, which no host name or address "
                f"holds{unexpanded}"
            )
        try:
            parts.hostname.encode("idna")  # as every request's Host header is written
        except UnicodeError as exc:
            raise ValueError(f"{url!r} has a host name no request can carry: {exc}") from exc
    elif not parts.hostname.isprintable() or not parts.hostname.isascii():
        # An IPv6 zone ("%25eth0") is not checked as a host name is: a NUL there passed,
        # and every restart command was "not run" (its LLMHEALTH_URL), a failed attempt.
        raise ValueError(f"{url!r} has a control character, or one beyond ASCII, in its IPv6 zone")
    elif (odd := _NOT_IN_A_ZONE.search(parts.hostname.partition("%")[2])) is not None:
        # "[fe80::1%25lo;}]" reached an nginx include (`watch --serving-file`) as written,
        # its ";}" ending the upstream block there; RFC 6874 has a zone percent-encode it.
        raise ValueError(
            f"{url!r}: its IPv6 zone holds {odd.group()!r}, which a URL writes percent-encoded"
        )
    if _HOST_AND_PORT.fullmatch(parts.netloc) is None:
        # "http://[::1]x;}:8000": every request went to the bracketed address, the rest
        # dropped unseen, and `watch --serving-file` wrote it whole into an nginx include,
        # where ";}" ended the upstream block and failed every reload of the balancer.
        raise ValueError(f"{url!r} has more than a bracketed address and a port in its host")
    # Rebuilt from its parts, case kept: an empty "?" or "#" left in place made every path
    # appended to it part of the query or the fragment (GET / for /metrics).
    scheme = url.strip().partition(":")[0]  # as written: urlsplit lower-cases it
    return f"{scheme}://{parts.netloc}{parts.path}".rstrip("/")


def _names_one_of(path: Path, others: Sequence[Path]) -> bool:
    """Whether ``path`` names one of ``others``, told apart where their links lead too, as
    the files are opened: one path through a linked directory (``/var/lib/llmhealth`` a
    link to ``/srv/llmhealth``) and the other without name one file."""
    return any(
        Path(resolve(path)) in {Path(resolve(other)) for other in others}
        for resolve in (os.path.abspath, os.path.realpath)
    )


def _with_lock(state: Path) -> tuple[Path, Path, Path]:
    """The state file and its locks: beside the path given and beside the file it leads
    to (``StateFile.locked`` holds both when it is a link)."""
    return state, lock_beside(state), lock_beside(Path(os.path.realpath(state)))


def check_audit_path(state: Path, audit: Path) -> None:
    """ConfigError when the audit log would be the state file or its lock: each save of the
    state renames over the file, and the records appended to it would be lost. Through a
    linked directory too (``_names_one_of``): every audit record went with the next save,
    and ``audit`` printed the state as the trail."""
    if _names_one_of(audit, _with_lock(state)):
        raise ConfigError(f"the audit log {str(audit)!r} is the state file or its lock")


def check_serving_path(serving: Path, state: Path, audit: Path) -> None:
    """ConfigError when ``watch``'s serving file would be the state file, its lock or the
    audit log: each write of the serving list renames it over that file. Over the state,
    the ledger (its holds, retirements and restart budgets) was gone, the file left
    world-readable, and every settle after it skipped as "not a file llmhealth wrote";
    over the lock, two runs each held a lock of their own."""
    if _names_one_of(serving, (*_with_lock(state), audit)):
        raise ConfigError(
            f"the serving file {str(serving)!r} is the state file, its lock or the "
            "audit log: give the balancer a file of its own"
        )


def check_serving_config(serving: Path, config: Path) -> None:
    """ConfigError when ``watch``'s serving file would be its config file: each write of
    the serving list renamed it over the config, the backends gone from it, and the next
    start or SIGHUP refused as an invalid config. Asked in every mode (a cluster's keeps
    no state file here to check the serving file against)."""
    if _names_one_of(serving, (config,)):
        raise ConfigError(
            f"the serving file {str(serving)!r} is the config file: give the balancer "
            "a file of its own"
        )


def check_nginx_servers(serving: Path, targets: Sequence[Target]) -> None:
    """ConfigError when ``watch`` would write a backend into an nginx include
    (``serving`` ends in .conf) as a ``server`` line nginx refuses: an IPv6 address with
    a zone, which nginx's upstream parser does not take ("invalid IPv6 address"), so
    every reload of the balancer failed on the file. Written without its zone, the
    link-local address it names is reachable through no interface."""
    if serving.suffix != ".conf":
        return
    for target in targets:
        host = urlsplit(target.url).hostname or ""
        if target.kind == "backend" and ":" in host and "%" in host:
            raise ConfigError(
                f"backend {target.name!r} ({target.url}) has an IPv6 zone, which nginx "
                f"takes in no upstream server: the serving file {str(serving)!r} would "
                "fail every reload of the balancer (give it a JSON serving file, or an "
                "address without a zone)"
            )


def _path(reader: _Reader, data: Mapping[str, Any], key: str, base: Path | None) -> str | None:
    value = reader.optional_string(data, key)
    if value is None:
        return None
    if "\0" in value:  # no file can be named so: every open would fail, as an internal error
        raise reader.fail(key, f"{value!r} holds a NUL character")
    try:
        path = Path(value).expanduser()
    except RuntimeError as exc:  # "~" with no HOME and no passwd entry for the user
        raise reader.fail(key, f"{value!r}: {exc}") from None
    if not path.name:  # "/", ".": a directory, with no file name to lock or write beside
        raise reader.fail(key, f"{value!r} names a directory, not a file")
    path = base / path if base is not None and not path.is_absolute() else path
    if os.path.isdir(path):
        # `state = "/var/lib/llmhealth"`, the state's directory: every run failed to read
        # or write it, and `watch` skipped every cycle after `config check` said ok.
        raise reader.fail(key, f"{value!r} names a directory, not a file")
    return str(path)


def _refuse_shared_urls(
    where: str, backends: Sequence[tuple[str, str]], proxies: Sequence[tuple[str, str]]
) -> None:
    """Two backends at one URL are one server counted twice, and the ledger, which knows
    a backend by its URL too, refuses them. A backend at a proxy's URL is that proxy's
    pool read as one server: each read's /metrics from whichever server the proxy chose,
    its verdicts about none of them, and its restart command run on that evidence, a
    restart through a proxy. Two proxies at one URL are left alone: no ledger, no
    command."""
    first: dict[str, str] = {}
    for key, url in backends:
        if same_server(url) in first:
            raise ConfigError(
                f"{where}: {first[same_server(url)]} and {key} have the same URL {url!r}"
            )
        first[same_server(url)] = key
    for key, url in proxies:
        if same_server(url) in first:
            raise ConfigError(
                f"{where}: {first[same_server(url)]} and {key} have the same URL {url!r}: "
                "a server is either a backend or a proxy in front of backends"
            )


def _policy(reader: _Reader, data: object) -> Policy:
    table = reader.table(data, "policy")
    fields = {
        "unhealthy_threshold",
        "healthy_threshold",
        "min_healthy",
        "restart_on",
        "max_concurrent_restarts",
        "restart_budget",
        "restart_budget_window",
        "cooldown",
        "cooldown_max",
        "startup_grace",
        "restart_timeout",
        "recover_in_place",
        "max_in_place_recoveries",
        "wedge_after",
        "startup_wedge_after",
    }
    reader.known(table, "policy.", fields)
    defaults = Policy()
    restart_on = reader.string_list(
        table, "policy.restart_on", defaults.restart_on, example='verdicts, e.g. ["wedged"]'
    )
    unknown = sorted(set(restart_on) - _VERDICTS_RESTARTABLE)
    if unknown:
        raise ConfigError(
            f"{reader.where}: policy.restart_on: {', '.join(unknown)} cannot condemn a backend "
            f"to a restart (choose from {', '.join(sorted(_VERDICTS_RESTARTABLE))})"
        )
    policy = Policy(
        unhealthy_threshold=reader.integer(
            table, "policy.unhealthy_threshold", defaults.unhealthy_threshold, minimum=1
        ),
        healthy_threshold=reader.integer(
            table, "policy.healthy_threshold", defaults.healthy_threshold, minimum=1
        ),
        min_healthy=reader.integer(table, "policy.min_healthy", defaults.min_healthy, minimum=0),
        restart_on=restart_on,
        max_concurrent_restarts=reader.integer(
            table, "policy.max_concurrent_restarts", defaults.max_concurrent_restarts, minimum=1
        ),
        restart_budget=reader.integer(
            table, "policy.restart_budget", defaults.restart_budget, minimum=1
        ),
        restart_budget_window=reader.duration(
            table, "policy.restart_budget_window", defaults.restart_budget_window
        ),
        cooldown=reader.duration(table, "policy.cooldown", defaults.cooldown),
        cooldown_max=reader.duration(table, "policy.cooldown_max", defaults.cooldown_max),
        startup_grace=reader.duration(table, "policy.startup_grace", defaults.startup_grace),
        restart_timeout=reader.duration(table, "policy.restart_timeout", defaults.restart_timeout),
        recover_in_place=reader.boolean(
            table, "policy.recover_in_place", defaults.recover_in_place
        ),
        max_in_place_recoveries=reader.integer(
            table, "policy.max_in_place_recoveries", defaults.max_in_place_recoveries, minimum=0
        ),
        wedge_after=reader.duration(
            table, "policy.wedge_after", defaults.wedge_after, zero_is_off=True
        ),
        startup_wedge_after=reader.duration(
            table, "policy.startup_wedge_after", defaults.startup_wedge_after, zero_is_off=True
        ),
    )
    if policy.cooldown_max < policy.cooldown:
        raise ConfigError(f"{reader.where}: policy.cooldown_max is shorter than policy.cooldown")
    return policy


def _router(reader: _Reader, data: object) -> Router:
    table = reader.table(data, "router")
    reader.known(table, "router.", set(Router.__dataclass_fields__))
    defaults = Router()
    listen = reader.optional_string(table, "router.listen")
    if listen is not None:
        try:
            parse_listen(listen)
        except ValueError as exc:
            raise reader.fail("router.listen", str(exc)) from exc
    routes = reader.string_list(
        table, "router.routes", defaults.routes, example='paths, e.g. ["/v1/completions"]'
    )
    if not routes:
        # Taken, every client request was a 404 and the router looked healthy.
        raise reader.fail("router.routes", "is empty: no request would be forwarded")
    bad = [route for route in routes if not route.startswith("/") or route in _ROUTER_OWN]
    if bad:
        raise reader.fail(
            "router.routes",
            f"{bad[0]!r}: a route is a path starting with '/', and not one the router "
            f"answers itself ({', '.join(sorted(_ROUTER_OWN))})",
        )
    # A route is matched whole against a request's path (decoded, without its query): one
    # holding a query, a fragment or a pattern never matched, its requests 404s.
    never = [route for route in routes if _NEVER_IN_A_ROUTE.search(route)]
    if never:
        raise reader.fail(
            "router.routes",
            f"{never[0]!r}: a route is a whole path, matched exactly: no query ('?'), "
            "fragment ('#'), pattern ('*') or white space",
        )
    affinity = reader.optional_string(table, "router.affinity")
    if affinity is not None:
        try:
            Affinity.parse(affinity)
        except ValueError as exc:
            raise reader.fail("router.affinity", str(exc)) from exc
    status = reader.integer(
        table, "router.no_backend_status", defaults.no_backend_status, minimum=400
    )
    if status > 599:
        raise reader.fail("router.no_backend_status", f"{status} is not an HTTP error status")
    connect_timeout = reader.duration(table, "router.connect_timeout", defaults.connect_timeout)
    first_byte_timeout = reader.duration(
        table, "router.first_byte_timeout", defaults.first_byte_timeout
    )
    if first_byte_timeout <= connect_timeout:
        # The first-byte bound runs from the attempt's start, its connect included: ended
        # by it, a connect that never completed was a backend's first-byte failure, and
        # the request that never reached it was not retried elsewhere.
        raise reader.fail(
            "router.first_byte_timeout",
            f"{first_byte_timeout:g} s must be longer than router.connect_timeout "
            f"({connect_timeout:g} s), which it includes",
        )
    return Router(
        listen=listen,
        routes=routes,
        affinity=affinity,
        affinity_slack=reader.integer(
            table, "router.affinity_slack", defaults.affinity_slack, minimum=1
        ),
        max_body=reader.integer(
            table, "router.max_body", defaults.max_body, minimum=1024, most=MOST_MAX_BODY
        ),
        body_timeout=reader.duration(table, "router.body_timeout", defaults.body_timeout),
        connect_timeout=connect_timeout,
        first_byte_timeout=first_byte_timeout,
        stream_idle_timeout=reader.duration(
            table, "router.stream_idle_timeout", defaults.stream_idle_timeout
        ),
        client_timeout=reader.duration(table, "router.client_timeout", defaults.client_timeout),
        idle_timeout=reader.duration(table, "router.idle_timeout", defaults.idle_timeout),
        no_backend_status=status,
    )


_ROUTER_OWN = frozenset({"/v1/models", "/metrics", "/health"})


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a host and a port; ValueError otherwise."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT")
    if not host.isprintable():
        # No host holds one, and a NUL passed `config check` to end `route` with a
        # traceback (asyncio's address lookup raised ValueError, not OSError).
        raise ValueError(f"{value!r} has a control character in its host")
    if ":" not in host:
        try:
            host.encode("idna")  # as the address lookup writes it
        except UnicodeError as exc:
            # "label too long" (a label past 63 characters, or an empty one): a
            # UnicodeError from the lookup, no OSError, ended `route` and `watch` in
            # "internal error".
            raise ValueError(f"{value!r} has a host name no lookup can carry: {exc}") from exc
    return host, int(port)


def _cluster(reader: _Reader, data: object) -> Cluster:
    table = reader.table(data, "cluster")
    reader.known(
        table, "cluster.", {"etcd", "prefix", "lease_ttl", "member", "audit_keep", "shard_reads"}
    )
    endpoints = reader.string_list(
        table, "cluster.etcd", (), example='etcd client URLs, e.g. ["http://10.0.0.1:2379"]'
    )
    if not endpoints:
        raise reader.fail(
            "cluster.etcd", 'is required: etcd client URLs, e.g. ["http://10.0.0.1:2379"]'
        )
    for endpoint in endpoints:
        try:
            checked = check_base_url(endpoint)
        except ValueError as exc:
            raise reader.fail("cluster.etcd", str(exc)) from exc
        if urlsplit(checked).path:
            # Only its host and port are used (etcd_http: POST /v3/... at the root): a
            # gateway's path was dropped without a word, each request sent where no etcd is.
            raise reader.fail(
                "cluster.etcd",
                f"{checked!r}: a path is not used: etcd's gateway is at the root (/v3/...)",
            )
    prefix = reader.optional_string(table, "cluster.prefix") or DEFAULT_PREFIX
    if not prefix.startswith("/") or prefix.endswith("/") or not prefix.isprintable():
        raise reader.fail(
            "cluster.prefix", f"{prefix!r} must be printable, start with '/' and not end with one"
        )
    lease_ttl = reader.duration(table, "cluster.lease_ttl", DEFAULT_LEASE_TTL)
    if lease_ttl < MIN_LEASE_TTL or lease_ttl != round(lease_ttl):
        raise reader.fail(
            "cluster.lease_ttl",
            f"{lease_ttl:g} s: etcd leases are whole seconds, at least {MIN_LEASE_TTL:g}",
        )
    member = reader.optional_string(table, "cluster.member")
    if member is not None and ("/" in member or not member.isprintable()):
        raise reader.fail("cluster.member", f"{member!r} must be printable and have no '/'")
    audit_keep = reader.integer(
        table,
        "cluster.audit_keep",
        DEFAULT_AUDIT_KEEP,
        minimum=MIN_AUDIT_KEEP,
        most=MAX_AUDIT_KEEP,
    )
    return Cluster(
        tuple(check_base_url(e) for e in endpoints),
        prefix,
        lease_ttl,
        member,
        audit_keep,
        reader.boolean(table, "cluster.shard_reads", False),
    )


def _backend(reader: _Reader, data: object, key: str) -> Backend:
    table = reader.table(data, key)
    reader.known(
        table,
        f"{key}.",
        {"name", "url", "restart", "api_key_env", "expected_model", "wedge_after", "cgroup"},
    )
    url = reader.url(table, f"{key}.url")
    restart = reader.command(table, f"{key}.restart")
    return Backend(
        name=reader.name(table, key, url),
        url=url,
        restart=restart,
        api_key_env=reader.variable_name(table, f"{key}.api_key_env"),
        expected_model=reader.label(table, f"{key}.expected_model"),
        wedge_after=(
            reader.duration(table, f"{key}.wedge_after", 0.0, zero_is_off=True)
            if "wedge_after" in table
            else None
        ),
        cgroup=reader.cgroup(table, f"{key}.cgroup"),
    )


def _proxy(reader: _Reader, data: object, key: str) -> Proxy:
    table = reader.table(data, key)
    reader.known(table, f"{key}.", {"name", "url"})
    url = reader.url(table, f"{key}.url")
    return Proxy(name=reader.name(table, key, url), url=url)


class _Reader:
    """Typed access to TOML values; each failure names the file and the dotted key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key}: {message}")

    def known(self, table: Mapping[str, Any], prefix: str, allowed: set[str]) -> None:
        for key in table:
            if key not in allowed:
                raise self.fail(f"{prefix}{key}", "unknown key")

    def table(self, value: object, key: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(key, "must be a table")
        return value

    def table_list(self, data: Mapping[str, Any], key: str) -> list[object]:
        value = data.get(key, [])
        if not isinstance(value, list):
            raise self.fail(key, f"must be an array of tables ([[{key}]])")
        return value

    def _leaf(self, key: str) -> str:
        return key.rsplit(".", 1)[-1]

    def duration(
        self,
        table: Mapping[str, Any],
        key: str,
        default: float,
        *,
        zero_is_off: bool = False,
        most: float = LONGEST_DURATION,
    ) -> float:
        """A positive duration up to ``most``; 0 too where it turns something off."""
        if self._leaf(key) not in table:
            return default
        value = table[self._leaf(key)]
        if zero_is_off and _is_zero(value):
            return 0.0
        try:
            return parse_duration(value, most)
        except ValueError as exc:
            raise self.fail(key, str(exc)) from exc

    def integer(
        self,
        table: Mapping[str, Any],
        key: str,
        default: int,
        *,
        minimum: int,
        most: int | None = None,
    ) -> int:
        value = table.get(self._leaf(key), default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"{value!r} is not a whole number")
        if abs(value) > _FLOAT_LIMIT:
            # Past a float's range: every /metrics scrape of a gauge of it (min_healthy)
            # failed on an OverflowError, and its digits are not repeated.
            raise self.fail(key, f"an integer of {len(str(abs(value)))} digits is too large")
        if value < minimum:
            raise self.fail(key, f"{value} is below the least allowed value, {minimum}")
        if most is not None and value > most:
            raise self.fail(key, f"{value} is above the most allowed value, {most}")
        return value

    def boolean(self, table: Mapping[str, Any], key: str, default: bool) -> bool:
        value = table.get(self._leaf(key), default)
        if not isinstance(value, bool):
            raise self.fail(key, f"{value!r} is not true or false")
        return value

    def optional_string(self, table: Mapping[str, Any], key: str) -> str | None:
        value = table.get(self._leaf(key))
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.fail(key, f"{value!r} is not a non-empty string")
        return value

    def cgroup(self, table: Mapping[str, Any], key: str) -> str | None:
        """A cgroup v2 directory, or one as systemd shows it (``systemctl show -p
        ControlGroup``: /system.slice/..., starting with a slice or scope), taken under
        /sys/fs/cgroup. Taken as written, that one was read at the root of the file
        system and found nothing, and a relative one from wherever llmhealth ran: CPU
        evidence lost without a word."""
        value = self.optional_string(table, key)
        if value is None:
            return None
        if not value.startswith("/"):
            raise self.fail(
                key, f"{value!r} is relative: give /sys/fs/cgroup/... or systemd's ControlGroup"
            )
        top = value.split("/", 2)[1]
        if top.endswith((".slice", ".scope")):  # systemd's: every cgroup it makes is in one
            return CGROUP_ROOT + value.rstrip("/")
        return value  # the mount itself, or one elsewhere (a container's view of the host)

    def variable_name(self, table: Mapping[str, Any], key: str) -> str | None:
        """The name of an environment variable. Not echoed when it is not one: what was
        written there may be the key itself, pasted in, and must not reach a log."""
        value = table.get(self._leaf(key))
        if value is None:
            return None
        if not isinstance(value, str) or _VARIABLE_NAME.fullmatch(value) is None:
            raise self.fail(
                key, "must name an environment variable (letters, digits, '_'), not hold the key"
            )
        return value

    def label(self, table: Mapping[str, Any], key: str) -> str | None:
        """A string shown to operators as it is (tables, Nagios lines, evidence): printable,
        and without the '|' that starts a Nagios line's performance data."""
        value = self.optional_string(table, key)
        if value is not None and (not value.isprintable() or "|" in value):
            raise self.fail(key, f"{value!r} must be printable and have no '|'")
        return value

    def name(self, table: Mapping[str, Any], key: str, url: str) -> str:
        """``key``.name, or the name ``url`` gives (``name_for_url``); either passes
        ``name_problem``, and a failure names the key that holds the culprit."""
        name = self.optional_string(table, f"{key}.name")
        if name is None:
            try:
                return name_for_url(url)
            except ValueError as exc:
                raise self.fail(f"{key}.url", str(exc)) from exc
        if (problem := name_problem(name)) is not None:
            raise self.fail(f"{key}.name", f"{name!r} {problem}")
        return name

    def string_list(
        self, table: Mapping[str, Any], key: str, default: tuple[str, ...], *, example: str
    ) -> tuple[str, ...]:
        """A list of strings; ``example`` says what one holds. One hint for every list, "an
        argv list", told an operator who wrote ``etcd = "http://..."`` or ``restart_on =
        "wedged"`` that a command was expected there."""
        value = table.get(self._leaf(key), list(default))
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.fail(key, f"must be a list of strings ({example})")
        return tuple(value)

    def command(
        self, table: Mapping[str, Any], key: str, *, empty_is_none: bool = False
    ) -> tuple[str, ...]:
        """An argv list run with no shell, or none when the key is absent (or, where
        ``empty_is_none``, an empty list: the default written out). Its program is
        checked here, not when it first runs: a restart that cannot run spends the
        restart budget attempt by attempt until the backend is retired. The program is
        not repeated in a message, as a command line may carry a token."""
        argv = self.string_list(table, key, (), example="an argv list, never a shell line")
        if self._leaf(key) not in table or (empty_is_none and not argv):
            return ()
        if not argv:
            raise self.fail(key, "an empty command; leave the key out")
        if any("\0" in word for word in argv):
            # No process can be given one: every restart would be "not run", its budget spent.
            raise self.fail(key, "holds a NUL character, which no command line can carry")
        program = argv[0]
        if not program.strip():
            raise self.fail(key, "its first word, the program to run, is empty")
        # Only an absolute path is looked at: a relative one is refused below, and one
        # found from here may not be from where the daemon runs.
        spaced = any(character.isspace() for character in program)
        # os.path.exists: a path no lookup can take (ENAMETOOLONG, EACCES) is no program
        # here; Path.exists raised OSError, a traceback from `config check` quoting the
        # command line, and a reload to it ended `watch`.
        if spaced and not (program.startswith("/") and os.path.exists(program)):
            raise self.fail(
                key,
                "its first word is a whole command line: no shell is used, so split it into"
                ' words, e.g. ["systemctl", "restart", "vllm@0"]',
            )
        if "/" in program and not program.startswith("/"):
            raise self.fail(
                key,
                "its program is a relative path, which would be taken from wherever llmhealth"
                " runs (/ under systemd): give an absolute path, or a name found on PATH",
            )
        return argv

    def url(self, table: Mapping[str, Any], key: str) -> str:
        """The base URL at ``key``. One there but not a string (``url = ["http://..."]``)
        was told "is required", of a key the operator could see written; it is said to be
        of the wrong type, and not repeated (it may hold a key)."""
        value = table.get(self._leaf(key))
        if not isinstance(value, str):
            said = "is required" if value is None else "must be a string"
            raise self.fail(key, f"{said}: the base URL, e.g. http://10.0.0.5:8000")
        try:
            return check_url(value)
        except ValueError as exc:
            raise self.fail(key, str(exc)) from exc


CGROUP_ROOT = "/sys/fs/cgroup"  # where cgroup v2 is mounted
# ASCII a host name or IPv4 address never holds: only letters, digits, '-', '.' and '_'
# (a container's service name); other scripts are IDNA's to judge.
_NOT_IN_A_HOST = re.compile(r"[\x00-\x2c/:-@\[-\^`{-\x7f]")
# A URL's host and port: a bracketed address alone in its brackets, or a host that
# ``_NOT_IN_A_HOST`` judges; and what an IPv6 zone holds (RFC 6874: unreserved, or
# percent-encoded).
_HOST_AND_PORT = re.compile(r"(\[[^\[\]]*\]|[^\[\]]*)(:[0-9]*)?")
_NOT_IN_A_ZONE = re.compile(r"[^A-Za-z0-9._~%-]")
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ORDINARY_VARIABLE = re.compile(r"[A-Z_][A-Z0-9_]*")


class BadTargetError(ValueError):
    """A URL that cannot be checked, or two targets with one name; ``hint`` names the input."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def backend_key(backend: Backend) -> str | None:
    """The key in the variable the backend's api_key_env names; None without one, or
    when that variable is unset or empty here."""
    return (os.environ.get(backend.api_key_env) or None) if backend.api_key_env else None


def unset_key_variables(config: Config) -> list[str]:
    """Why each backend whose api_key_env names a variable unset or empty here, or one
    holding a key no request header can carry, cannot be used. Refused at start and
    reload (``targets_for``): a cron job or unit without the operator's environment sent
    every request without its key, each failed as the backend's own fault (a 401), and
    the ledger condemned a healthy backend, the router dropped it."""
    reasons = []
    for backend in config.backends:
        if not backend.api_key_env:
            continue
        key = backend_key(backend)
        if key is None:
            reasons.append(
                f"backend {backend.name!r}: its api_key_env names "
                f"{_shown_variable(backend.api_key_env)}, which is not set (or empty) here; "
                "without its key every request would fail as the backend's fault"
            )
        elif not header_safe(key):
            # A CR an environment file with Windows line ends left: every probe raised as
            # "not judged", and the router sent each request without its Authorization.
            reasons.append(
                f"backend {backend.name!r}: its api_key_env names "
                f"{_shown_variable(backend.api_key_env)}, whose value holds a character no "
                "HTTP header can carry (a control character, such as the CR of a file with "
                "Windows line ends, or one outside ASCII); no request could send it"
            )
    return reasons


def _shown_variable(name: str) -> str:
    """A variable's name as an error may repeat it: a key pasted into api_key_env passes
    the name rule when it is letters and digits alone (vLLM's --api-key is any text, an
    HF token is ``hf_`` and letters), and the error printed it into every log. An
    ordinary name (capitals, digits, '_') is shown; any other is not repeated."""
    if _ORDINARY_VARIABLE.fullmatch(name):
        return name
    return "a variable (its name has lowercase letters, so it may be a key pasted in: not shown)"


def targets_for(config: Config, urls: Sequence[str], proxies: Sequence[str]) -> list[Target]:
    """Every target: configured backends and proxies first, then bare URLs.

    API keys are read here from the environment variables the config names, so a key is
    never written into a config file or a state file; one unset is refused
    (``unset_key_variables``).
    """
    if unset := unset_key_variables(config):
        raise BadTargetError(unset[0])
    targets = [
        Target(
            backend.name,
            backend.url,
            "backend",
            api_key=backend_key(backend),
            model=backend.expected_model,
            rules=config.wedge_rules(backend),
            cgroup=backend.cgroup,
        )
        for backend in config.backends
    ]
    targets += [Target(proxy.name, proxy.url, "proxy") for proxy in config.proxies]
    for kind, given, hint in (("backend", urls, "URL"), ("proxy", proxies, "--proxy")):
        for url in given:
            try:
                checked = check_url(url)
                name = name_for_url(checked)
            except ValueError as exc:
                raise BadTargetError(str(exc), hint) from exc
            targets.append(Target(name, checked, kind, rules=config.wedge_rules()))
    # URLs before names: a bare URL is named by its URL, so one given as a backend and as
    # a proxy was told only "named twice".
    urls = [same_server(target.url) for target in targets if target.kind == "backend"]
    if len(set(urls)) != len(urls):
        twice = sorted({url for url in urls if urls.count(url) > 1})
        raise BadTargetError(f"the same URL is given twice: {', '.join(twice)}", "URL")
    fronted = sorted({same_server(t.url) for t in targets if t.kind == "proxy"}.intersection(urls))
    if fronted:
        # As in a config (``_refuse_shared_urls``): a backend read through a proxy. Named
        # by the argument that gave it: a bare URL at a configured proxy's address was
        # told "Invalid value for --proxy", an option never given.
        given_proxies = {same_server(check_url(url)) for url in proxies}
        raise BadTargetError(
            f"{', '.join(fronted)} is given as a backend and as a proxy: a server is "
            "either a backend or a proxy in front of backends",
            "--proxy" if given_proxies.intersection(fronted) else "URL",
        )
    names = [target.name for target in targets]
    if len(set(names)) != len(names):
        raise BadTargetError("the same backend or proxy is named twice")
    return targets
