"""llmhealth's own Prometheus metrics, served by ``watch``.

The daemon hands over one immutable view per cycle and a scrape renders the latest one,
so a scrape never sees half a cycle and never waits for one. Names carry the
``llmhealth_`` prefix and a unit suffix; counters end in ``_total``.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from llmhealth.classify import VerdictKind
from llmhealth.ledger import State
from llmhealth.openfiles import OUT_OF_FILES
from llmhealth.report import FleetSummary, finite


@dataclass(frozen=True, slots=True)
class BackendView:
    name: str
    kind: str  # backend or proxy
    verdict: str | None  # None until the first verdict
    state: str | None  # None for a proxy
    serving: bool | None
    running: int | None = None
    waiting: int | None = None
    steps_per_s: float | None = None
    tokens_per_s: float | None = None
    probe_seconds: float | None = None
    in_place_recoveries: int | None = None  # None for a proxy
    examinations: int | None = None  # None for a target this daemon does not read


@dataclass(frozen=True, slots=True)
class ClusterView:
    """This daemon's place in a cluster, as its last cycle saw it."""

    member: str
    leading: bool  # this daemon may act now
    etcd_up: bool
    leader: str | None = None
    leader_since: float | None = None  # unix time
    fence: int = 0  # the leader key's creation revision; a new value is a new leader
    revision: int = 0  # of the fleet record, as last read or written here
    members: Mapping[str, float] = field(default_factory=dict)  # name -> last report time
    # With shard_reads: the backends each member reads (as its last report says), and,
    # while leading, how many backends the last settle had no fresh published verdict for.
    shares: Mapping[str, int] | None = None
    stale_verdicts: int | None = None


@dataclass(frozen=True, slots=True)
class ExportView:
    backends: tuple[BackendView, ...] = ()
    fleet: FleetSummary | None = None
    seconds_since_finished: float = 0.0
    fleet_stalled: bool = False
    last_cycle_at: float = 0.0
    cycle_seconds: float = 0.0
    reads_per_wait: float | None = None  # None until a target read here is examined
    probe_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)
    restarts: Mapping[tuple[str, str], int] = field(default_factory=dict)
    probe_task_restarts: Mapping[str, int] = field(default_factory=dict)
    cluster: ClusterView | None = None


class FleetCollector(Collector):
    """Renders the latest ExportView; ``publish`` swaps it in atomically."""

    def __init__(self) -> None:
        self._view = ExportView()
        self._lock = threading.Lock()

    def publish(self, view: ExportView) -> None:
        with self._lock:
            self._view = view

    @property
    def view(self) -> ExportView:
        """The view a render now would show: what a page rendered of it stays true for."""
        with self._lock:
            return self._view

    def collect(self) -> Iterator[Metric]:
        view = self.view
        yield from _backend_families(view)
        yield from _fleet_families(view)
        if view.cluster is not None:
            yield from _cluster_families(view.cluster)


def _backend_families(view: ExportView) -> Iterator[Metric]:
    verdict = GaugeMetricFamily(
        "llmhealth_backend_verdict",
        "The latest verdict on a backend or proxy: 1 for the current one.",
        labels=["backend", "verdict"],
    )
    state = GaugeMetricFamily(
        "llmhealth_backend_state",
        "The backend's ledger state: 1 for the current one.",
        labels=["backend", "state"],
    )
    serving = GaugeMetricFamily(
        "llmhealth_backend_serving", "1 when the backend may be handed traffic.", labels=["backend"]
    )
    running = GaugeMetricFamily(
        "llmhealth_backend_running_requests",
        "Requests running, as the backend's /metrics said.",
        labels=["backend"],
    )
    waiting = GaugeMetricFamily(
        "llmhealth_backend_waiting_requests",
        "Requests waiting, as the backend's /metrics said.",
        labels=["backend"],
    )
    steps = GaugeMetricFamily(
        "llmhealth_backend_engine_steps_per_second",
        "Engine steps per second over the last wait.",
        labels=["backend"],
    )
    tokens = GaugeMetricFamily(
        "llmhealth_backend_generated_tokens_per_second",
        "Generated tokens per second over the last wait.",
        labels=["backend"],
    )
    duration = GaugeMetricFamily(
        "llmhealth_backend_probe_duration_seconds",
        "How long the last probe of the backend took.",
        labels=["backend"],
    )
    in_place = GaugeMetricFamily(
        "llmhealth_backend_in_place_recoveries",
        "Times the backend's same process came back from DEAD within restart_budget_window; "
        "at policy.max_in_place_recoveries it stays DEAD for an operator.",
        labels=["backend"],
    )
    examinations = CounterMetricFamily(
        "llmhealth_backend_examinations",
        "Examinations of the target heard (a /metrics read, with the tiny request when one "
        "was sent), decided or not: one per wait while watch keeps up.",
        labels=["backend"],
    )
    for backend in view.backends:
        for kind in VerdictKind:
            verdict.add_metric([backend.name, str(kind)], float(backend.verdict == str(kind)))
        if backend.state is not None:
            for each in State:
                state.add_metric([backend.name, str(each)], float(backend.state == str(each)))
        if backend.serving is not None:
            serving.add_metric([backend.name], float(backend.serving))
        for family, value in (
            (running, backend.running),
            (waiting, backend.waiting),
            (steps, finite(backend.steps_per_s)),
            (tokens, finite(backend.tokens_per_s)),
            (duration, backend.probe_seconds),
            (in_place, backend.in_place_recoveries),
            (examinations, backend.examinations),
        ):
            if value is not None:
                family.add_metric([backend.name], float(value))
    errors = CounterMetricFamily(
        "llmhealth_backend_probe_errors",
        "Failed probes by kind (down, unresponsive, unanswered, no_metrics, key_refused).",
        labels=["backend", "kind"],
    )
    for (name, error), count in sorted(view.probe_errors.items()):
        errors.add_metric([name, error], float(count))
    restarts = CounterMetricFamily(
        "llmhealth_backend_restarts",
        "Restart decisions carried out, by outcome (ok: the command exited 0; failed: it did "
        "not, or no new process was proven within startup_grace; retired).",
        labels=["backend", "outcome"],
    )
    for (name, outcome), count in sorted(view.restarts.items()):
        restarts.add_metric([name, outcome], float(count))
    task_restarts = CounterMetricFamily(
        "llmhealth_backend_probe_task_restarts",
        "Probing tasks that died of an exception (a bug in llmhealth) and were started again.",
        labels=["backend"],
    )
    for name, count in sorted(view.probe_task_restarts.items()):
        task_restarts.add_metric([name], float(count))
    yield from (verdict, state, serving, running, waiting, steps, tokens, duration, in_place)
    yield from (errors, restarts, task_restarts, examinations)


def _fleet_families(view: ExportView) -> Iterator[Metric]:
    fleet = view.fleet
    if fleet is not None:
        yield GaugeMetricFamily(
            "llmhealth_fleet_serving_backends",
            "Backends that may be handed traffic.",
            fleet.serving,
        )
        yield GaugeMetricFamily(
            "llmhealth_fleet_min_healthy",
            "The configured floor of serving backends.",
            fleet.min_healthy,
        )
        yield GaugeMetricFamily(
            "llmhealth_fleet_membership_epoch",
            "Increases by one each time the serving set changes.",
            fleet.epoch,
        )
        yield GaugeMetricFamily(
            "llmhealth_fleet_floor_breached",
            "1 when fewer backends serve than min_healthy.",
            float(fleet.floor_breached),
        )
    yield GaugeMetricFamily(
        "llmhealth_fleet_seconds_since_last_finished_request",
        "Seconds since any backend last finished a request (since start if none has).",
        view.seconds_since_finished,
    )
    yield GaugeMetricFamily(
        "llmhealth_fleet_stalled",
        "1 when work is pending and no backend finished a request within stall_timeout.",
        float(view.fleet_stalled),
    )
    yield GaugeMetricFamily(
        "llmhealth_last_cycle_timestamp_seconds",
        "Unix time the last watch cycle completed.",
        view.last_cycle_at,
    )
    yield GaugeMetricFamily(
        "llmhealth_cycle_duration_seconds",
        "How long the last watch cycle took to settle (ledger, restarts, state file).",
        view.cycle_seconds,
    )
    if view.reads_per_wait is not None:
        yield GaugeMetricFamily(
            "llmhealth_fleet_reads_per_wait",
            "How often the median target read here is examined, per wait (from its average "
            "gap between examinations): 1 while each is read once per wait; lower when "
            "reads fall behind.",
            view.reads_per_wait,
        )


def _cluster_families(cluster: ClusterView) -> Iterator[Metric]:
    leader = GaugeMetricFamily(
        "llmhealth_cluster_leader",
        "1 when this daemon leads (may act) now; summed over members, 1 when all is well.",
        labels=["member"],
    )
    leader.add_metric([cluster.member], float(cluster.leading))
    yield leader
    yield GaugeMetricFamily(
        "llmhealth_cluster_etcd_up",
        "1 when etcd answered this daemon's last round.",
        float(cluster.etcd_up),
    )
    yield GaugeMetricFamily(
        "llmhealth_cluster_leader_fence",
        "The leader's fencing token (the leader key's creation revision); 0 with no leader. "
        "Every change is a new leader.",
        float(cluster.fence),
    )
    if cluster.leader_since is not None:
        yield GaugeMetricFamily(
            "llmhealth_cluster_leader_since_timestamp_seconds",
            "Unix time the current leader took the lead.",
            cluster.leader_since,
        )
    yield GaugeMetricFamily(
        "llmhealth_cluster_state_revision",
        "etcd revision of the fleet record as last read or written by this daemon.",
        float(cluster.revision),
    )
    yield GaugeMetricFamily(
        "llmhealth_cluster_members", "Daemons holding a live member key.", len(cluster.members)
    )
    reports = GaugeMetricFamily(
        "llmhealth_cluster_member_last_report_timestamp_seconds",
        "Unix time each member last renewed its member key with a report.",
        labels=["member"],
    )
    for name, at in sorted(cluster.members.items()):
        reports.add_metric([name], at)
    yield reports
    if cluster.shares is not None:
        shares = GaugeMetricFamily(
            "llmhealth_cluster_member_share_backends",
            "Backends each member reads with shard_reads, as its last report says.",
            labels=["member"],
        )
        for name, count in sorted(cluster.shares.items()):
            shares.add_metric([name], float(count))
        yield shares
    if cluster.stale_verdicts is not None:
        yield GaugeMetricFamily(
            "llmhealth_cluster_stale_verdicts",
            "Backends the leader's last settle judged 'stalled' for want of news (a verdict, "
            "an examination) from the member that reads them (shard_reads); only the leader "
            "exports it.",
            float(cluster.stale_verdicts),
        )


# Seconds a scraper may take to send its request, all of it, and to take each part of
# the page: Prometheus does both at once. Without the first, a connection that never sent
# a request held its thread and descriptor for ever (a thousand of them used up the
# daemon's open files, and every settle failed to open the state's lock file), and one
# sending a byte every few seconds held its place as long as it liked.
SCRAPE_TIMEOUT: Final = 10.0
# Scrapes served at once (a thread each). Prometheus scrapes a target one at a time per
# job: a few servers and an operator's curl fit. Past it a connection is closed
# unanswered, so idle sockets cannot pile up threads.
SCRAPES_AT_ONCE: Final = 16
# Seconds the listener waits before accepting again when this process has no descriptor
# left (as asyncio's servers wait, one second): the connection waiting to be taken kept
# the listening socket ready, and each accept failed at once, about 200,000 a second, a
# core and the GIL taken from the loop whose own reads were failing for want of them.
ACCEPT_PAUSE: Final = 1.0
# What a scraper's own doing raises (it timed out, or went away): no traceback for the
# daemon's log, wherever wsgiref or socketserver would print one.
_SCRAPERS_OWN: Final = (TimeoutError, ConnectionError)
# The longest request line read, as wsgiref reads it (longer ones are answered 414).
_MAX_REQUEST_LINE: Final = 65536
# The most a request's header fields take in all (each line and their number alone
# bounded a head to 6 MB): as the router's edge allows (http1.MAX_HEAD_BYTES).
_MAX_FIELDS_BYTES: Final = 65536
_ANY_VERSION: Final = re.compile(r"version=[^;]*")
# Pages kept of one view, one per way of asking (format, compression): every one
# prometheus_client answers, ten content types (text 0.0.4; text 1.0.0 and OpenMetrics in
# each of four escapings; OpenMetrics unversioned), each compressed or not. With eight
# kept, a scraper going round nine or more had the view rendered again at every scrape.
_PAGES_PER_VIEW: Final = 20


class _QuietServerHandler(ServerHandler):
    """wsgiref's handler, which logs a scraper that stopped reading mid-page with a
    traceback; that is the scraper's doing, and not news for the daemon's log."""

    def log_exception(self, exc_info: Any) -> None:
        if not isinstance(exc_info[1], _SCRAPERS_OWN):
            super().log_exception(exc_info)


class _HeadReader:
    """The request's file while its header fields are read: ``LineTooLong`` (a 431 from
    ``parse_request``) once they pass ``left`` bytes in all."""

    def __init__(self, rfile: Any, left: int) -> None:
        self._rfile, self._left = rfile, left

    def readline(self, size: int = -1) -> bytes:
        cap = self._left + 1 if size < 0 else min(size, self._left + 1)
        line: bytes = self._rfile.readline(cap)
        self._left -= len(line)
        if self._left < 0:
            raise http.client.LineTooLong(f"request header fields over {_MAX_FIELDS_BYTES} bytes")
        return line


class _ScrapeHandler(WSGIRequestHandler):
    """One scrape: its request read within SCRAPE_TIMEOUT in all (``timeout``, set on
    its socket, bounds each read of it and each send of the page), never logged."""

    timeout = SCRAPE_TIMEOUT

    def handle(self) -> None:
        cut_off = threading.Event()

        def cut() -> None:
            cut_off.set()
            with contextlib.suppress(OSError):  # gone already
                self.connection.shutdown(socket.SHUT_RDWR)

        deadline = threading.Timer(self.timeout, cut)
        deadline.start()
        try:
            self.raw_requestline = self.rfile.readline(_MAX_REQUEST_LINE + 1)
            if len(self.raw_requestline) > _MAX_REQUEST_LINE:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return
            rfile = self.rfile
            self.rfile = _HeadReader(rfile, _MAX_FIELDS_BYTES)  # type: ignore[assignment]
            try:
                if not self.parse_request() or cut_off.is_set():
                    return
            finally:
                self.rfile = rfile
        finally:
            deadline.cancel()
        handler = _QuietServerHandler(
            self.rfile,
            self.wfile,  # type: ignore[arg-type]  # a socket file, as wsgiref passes it
            self.get_stderr(),
            self.get_environ(),
            multithread=False,
        )
        handler.request_handler = self  # type: ignore[attr-defined]  # as wsgiref sets it
        handler.run(self.server.get_app())  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: a scrape every few seconds is not news for the daemon's log."""


class _ScrapeServer(ThreadingWSGIServer):
    """prometheus_client's server (a daemon thread per connection), with a cap on them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._places = threading.BoundedSemaphore(SCRAPES_AT_ONCE)
        self._stopping = threading.Event()
        super().__init__(*args, **kwargs)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in OUT_OF_FILES:
                # No descriptor for it: the connection stays queued and the socket
                # ready, so retrying at once only spins (socketserver drops the error).
                self._stopping.wait(ACCEPT_PAUSE)
            raise

    def shutdown(self) -> None:
        self._stopping.set()  # a pause for descriptors delays no stop
        super().shutdown()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._places.acquire(blocking=False):
            self.shutdown_request(request)  # every place taken: closed unanswered
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._places.release()  # no thread started to release it
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._places.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A scraper that timed out or went away: its own doing, and no traceback for the
        daemon's log (socketserver prints one for any error). Anything else still is."""
        if not isinstance(sys.exc_info()[1], _SCRAPERS_OWN):
            super().handle_error(request, client_address)


_Page = tuple[str, list[tuple[str, str]], bytes]


class _PagePerView:
    """The page rendered once per published view and way of asking, one render at a time.

    A render of a 10,000-backend view takes 1.6 s of CPU and 24 MB; rendered per scrape,
    eight scrapes at once (a pair of Prometheus servers, retries, an operator's curl)
    took 800 MB and stalled the event loop that reads the fleet for 300 ms at a time.
    """

    def __init__(self, collector: FleetCollector, app: WSGIApplication) -> None:
        self._collector = collector
        self._app = app
        self._lock = threading.Lock()
        self._of: ExportView | None = None
        self._pages: dict[tuple[str, ...], _Page] = {}

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> list[bytes]:
        method = environ.get("REQUEST_METHOD")
        if method != "GET":
            # Answered here: prometheus_client before 0.21 (pyproject allows 0.20) has no
            # 405, and rendered the whole view for a HEAD or POST, uncached and beside
            # any render under way (1.6 s of CPU and 24 MB at 10,000 backends each).
            allow = [("Allow", "OPTIONS,GET")]
            if method == "OPTIONS":
                start_response("200 OK", allow)
                return [b""]
            start_response("405 Method Not Allowed", allow)
            return [b"# HTTP 405 Method Not Allowed; use OPTIONS or GET\n"]
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("200 OK", [])  # an empty icon, for a browser
            return [b""]
        # Keyed on what makes pages differ, not on text a scraper chooses: keyed on its path
        # and query, each new one rendered the whole view again (1.6 s of CPU at 10,000
        # backends). Every path is the page; a query, prometheus_client's name[] filter
        # too, is dropped, and the whole page served.
        try:
            content_type = choose_encoder(str(environ.get("HTTP_ACCEPT", "")))[1]
        except (TypeError, ValueError):
            # A version it cannot compare (`version="1.0.0"`, quoted as HTTP allows, or
            # `version=latest`) raises in prometheus_client: a 500 and a traceback in the
            # daemon's log per scrape. Such a scraper gets the text page, as one asking
            # for nothing in particular does.
            content_type = choose_encoder("")[1]
        if content_type.startswith("application/openmetrics-text"):
            # Its version is the scraper's text, echoed: a page per version asked. Every
            # version renders this page alike (it has no native histograms); its
            # escaping is one of four.
            content_type = _ANY_VERSION.sub("version=1.0.0", content_type)
        environ = {**environ, "QUERY_STRING": "", "HTTP_ACCEPT": content_type}
        asked = (content_type, str(gzip_accepted(str(environ.get("HTTP_ACCEPT_ENCODING", "")))))
        with self._lock:
            view = self._collector.view
            if view is not self._of:
                self._of, self._pages = view, {}
            page = self._pages.get(asked)
            if page is None:
                page = self._render(environ)
                if page[0].startswith("200") and len(self._pages) < _PAGES_PER_VIEW:
                    self._pages[asked] = page  # only a page: never an error in its place
        status, headers, body = page
        start_response(status, list(headers))
        return [body]

    def _render(self, environ: WSGIEnvironment) -> _Page:
        answer: list[tuple[str, list[tuple[str, str]]]] = []

        def keep(status: str, headers: list[tuple[str, str]], _exc: object = None) -> object:
            answer.append((status, headers))
            return None

        body = b"".join(self._app(environ, keep))  # type: ignore[arg-type]
        status, headers = answer[0]
        return status, headers, body


def serve(collector: FleetCollector, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Serve /metrics on host:port from a thread; the caller shuts the server down."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(_ScrapeServer):
        address_family = family  # an IPv6 listen address needs its family at bind

    # Bound to the address as resolved, whole: an IPv6 link-local one's zone
    # ("fe80::1%eth0") is its scope ID, the fourth field. Given as (host, port), as
    # make_server gives it, the zone was dropped and every such bind failed (EINVAL),
    # where `route` listens there.
    server = Server(address, _ScrapeHandler)
    server.set_app(_PagePerView(collector, make_wsgi_app(registry)))
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
