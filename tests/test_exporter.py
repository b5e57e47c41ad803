"""llmhealth's own metrics page: synthetic views rendered the way a scrape renders them.

Each test publishes an ``ExportView`` to a ``FleetCollector``, renders it with
``prometheus_client.generate_latest`` and parses the text back with prometheus_client's
own parser, so what is checked is the exposition a Prometheus server would read. The last
tests serve the page over real HTTP on a loopback port the kernel picks.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from llmhealth import exporter
from llmhealth.classify import VerdictKind
from llmhealth.exporter import BackendView, ClusterView, ExportView, FleetCollector, serve
from llmhealth.ledger import State
from llmhealth.report import FleetSummary

VERDICTS = [str(kind) for kind in VerdictKind]
STATES = [str(state) for state in State]

BACKEND_FAMILIES = {
    "llmhealth_backend_verdict": "gauge",
    "llmhealth_backend_state": "gauge",
    "llmhealth_backend_serving": "gauge",
    "llmhealth_backend_running_requests": "gauge",
    "llmhealth_backend_waiting_requests": "gauge",
    "llmhealth_backend_engine_steps_per_second": "gauge",
    "llmhealth_backend_generated_tokens_per_second": "gauge",
    "llmhealth_backend_probe_duration_seconds": "gauge",
    "llmhealth_backend_in_place_recoveries": "gauge",
    "llmhealth_backend_probe_errors": "counter",
    "llmhealth_backend_restarts": "counter",
    "llmhealth_backend_probe_task_restarts": "counter",
    "llmhealth_backend_examinations": "counter",
}
FLEET_FAMILIES = {
    "llmhealth_fleet_serving_backends": "gauge",
    "llmhealth_fleet_min_healthy": "gauge",
    "llmhealth_fleet_membership_epoch": "gauge",
    "llmhealth_fleet_floor_breached": "gauge",
    "llmhealth_fleet_reads_per_wait": "gauge",
}
ALWAYS_FAMILIES = {
    "llmhealth_fleet_seconds_since_last_finished_request": "gauge",
    "llmhealth_fleet_stalled": "gauge",
    "llmhealth_last_cycle_timestamp_seconds": "gauge",
    "llmhealth_cycle_duration_seconds": "gauge",
}


def busy(name: str) -> BackendView:
    return BackendView(
        name=name,
        kind="backend",
        verdict="busy",
        state="healthy",
        serving=True,
        running=4,
        waiting=8,
        steps_per_s=400.5,
        tokens_per_s=1602.0,
        probe_seconds=0.004,
        examinations=12,
    )


def wedged(name: str) -> BackendView:
    return BackendView(
        name=name,
        kind="backend",
        verdict="wedged",
        state="dead",
        serving=False,
        running=4,
        waiting=8,
        steps_per_s=0.0,
        tokens_per_s=0.0,
        probe_seconds=0.006,
        in_place_recoveries=3,
        examinations=4,
    )


def proxy(name: str) -> BackendView:
    return BackendView(
        name=name,
        kind="proxy",
        verdict="up",
        state=None,
        serving=None,
        probe_seconds=0.002,
        examinations=12,
    )


FLEET_VIEW = ExportView(
    backends=(busy("gpu0"), wedged("gpu1"), proxy("lb")),
    fleet=FleetSummary(
        serving=1, min_healthy=2, epoch=3, floor_breached=True, message="floor breached"
    ),
    seconds_since_finished=12.5,
    fleet_stalled=True,
    last_cycle_at=1_800_000_000.25,
    cycle_seconds=0.031,
    reads_per_wait=0.78,
    probe_errors={("gpu1", "unresponsive"): 2, ("gpu0", "down"): 1},
    restarts={("gpu1", "ok"): 1, ("gpu1", "failed"): 3},
    probe_task_restarts={"gpu0": 0, "gpu1": 2, "lb": 0},
)


class Page:
    """One rendered exposition: the raw text and the families prometheus_client parsed."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, family: str) -> list[Sample]:
        return list(self.families[family].samples)

    def value(self, family: str, **labels: str) -> float:
        matching = [s.value for s in self.samples(family) if s.labels == labels]
        assert len(matching) == 1, (family, labels, self.samples(family))
        return matching[0]

    def backends_of(self, family: str) -> set[str]:
        return {s.labels["backend"] for s in self.samples(family)}

    def ones(self, family: str, backend: str, label: str) -> list[str]:
        """The label values whose series is 1 for one backend."""
        return [
            s.labels[label]
            for s in self.samples(family)
            if s.labels["backend"] == backend and s.value == 1.0
        ]


def render(view: ExportView) -> Page:
    collector = FleetCollector()
    collector.publish(view)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return Page(generate_latest(registry).decode())


def test_every_family_is_typed_documented_and_named_with_the_llmhealth_prefix() -> None:
    page = render(FLEET_VIEW)
    expected = BACKEND_FAMILIES | FLEET_FAMILIES | ALWAYS_FAMILIES
    assert {name: f.type for name, f in page.families.items()} == expected
    for name, family in page.families.items():
        assert name.startswith("llmhealth_")
        assert family.documentation.strip(), f"{name} has no HELP text"
    helped = {line.split()[2] for line in page.text.splitlines() if line.startswith("# HELP ")}
    typed = {line.split()[2] for line in page.text.splitlines() if line.startswith("# TYPE ")}
    assert helped == typed


def test_counters_end_in_total_in_the_exposition_and_carry_their_counts() -> None:
    page = render(FLEET_VIEW)
    counter_lines = [
        line
        for line in page.text.splitlines()
        if line.startswith(("llmhealth_backend_probe_errors", "llmhealth_backend_restarts"))
    ]
    assert counter_lines
    assert all(line.split("{", 1)[0].endswith("_total") for line in counter_lines)
    assert "# TYPE llmhealth_backend_restarts_total counter" in page.text
    errors = page.families["llmhealth_backend_probe_errors"]
    assert {(s.labels["backend"], s.labels["kind"]): s.value for s in errors.samples} == {
        ("gpu1", "unresponsive"): 2.0,
        ("gpu0", "down"): 1.0,
    }
    restarts = page.families["llmhealth_backend_restarts"]
    assert {s.name for s in restarts.samples} == {"llmhealth_backend_restarts_total"}
    assert {(s.labels["backend"], s.labels["outcome"]): s.value for s in restarts.samples} == {
        ("gpu1", "ok"): 1.0,
        ("gpu1", "failed"): 3.0,
    }
    task_restarts = page.families["llmhealth_backend_probe_task_restarts"]
    assert {s.labels["backend"]: s.value for s in task_restarts.samples} == {
        "gpu0": 0.0,
        "gpu1": 2.0,
        "lb": 0.0,
    }


def test_each_backend_has_exactly_one_current_verdict_and_one_current_state() -> None:
    page = render(FLEET_VIEW)
    for name, verdict, state in (("gpu0", "busy", "healthy"), ("gpu1", "wedged", "dead")):
        assert page.ones("llmhealth_backend_verdict", name, "verdict") == [verdict]
        assert page.ones("llmhealth_backend_state", name, "state") == [state]
        # Every possible value is present, as 0, so a query never meets an absent series.
        verdicts = [
            s.labels["verdict"]
            for s in page.samples("llmhealth_backend_verdict")
            if s.labels["backend"] == name
        ]
        states = [
            s.labels["state"]
            for s in page.samples("llmhealth_backend_state")
            if s.labels["backend"] == name
        ]
        assert sorted(verdicts) == sorted(VERDICTS)
        assert sorted(states) == sorted(STATES)


def test_a_proxy_has_a_verdict_but_no_ledger_state_and_no_serving_flag() -> None:
    page = render(FLEET_VIEW)
    assert page.ones("llmhealth_backend_verdict", "lb", "verdict") == ["up"]
    assert "lb" not in page.backends_of("llmhealth_backend_state")
    assert "lb" not in page.backends_of("llmhealth_backend_serving")
    assert page.backends_of("llmhealth_backend_state") == {"gpu0", "gpu1"}
    assert page.value("llmhealth_backend_probe_duration_seconds", backend="lb") == 0.002


def test_per_backend_gauges_carry_the_values_of_the_view() -> None:
    page = render(FLEET_VIEW)
    assert page.value("llmhealth_backend_serving", backend="gpu0") == 1.0
    assert page.value("llmhealth_backend_serving", backend="gpu1") == 0.0
    assert page.value("llmhealth_backend_running_requests", backend="gpu0") == 4.0
    assert page.value("llmhealth_backend_waiting_requests", backend="gpu1") == 8.0
    assert page.value("llmhealth_backend_engine_steps_per_second", backend="gpu0") == 400.5
    assert page.value("llmhealth_backend_generated_tokens_per_second", backend="gpu0") == 1602.0
    assert page.value("llmhealth_backend_probe_duration_seconds", backend="gpu1") == 0.006
    # At the cap: the dashboard shows why this DEAD backend will not come back by itself.
    assert page.value("llmhealth_backend_in_place_recoveries", backend="gpu1") == 3.0
    assert "lb" not in page.backends_of("llmhealth_backend_in_place_recoveries")
    # A proxy reads no /metrics: it has none of the engine gauges.
    for family in ("running_requests", "waiting_requests", "engine_steps_per_second"):
        assert "lb" not in page.backends_of(f"llmhealth_backend_{family}")


def test_fleet_gauges_carry_the_summary_the_stall_and_the_cycle() -> None:
    page = render(FLEET_VIEW)
    assert page.value("llmhealth_fleet_serving_backends") == 1.0
    assert page.value("llmhealth_fleet_min_healthy") == 2.0
    assert page.value("llmhealth_fleet_membership_epoch") == 3.0
    assert page.value("llmhealth_fleet_floor_breached") == 1.0
    assert page.value("llmhealth_fleet_seconds_since_last_finished_request") == 12.5
    assert page.value("llmhealth_fleet_stalled") == 1.0
    assert page.value("llmhealth_last_cycle_timestamp_seconds") == 1_800_000_000.25
    assert page.value("llmhealth_cycle_duration_seconds") == 0.031
    assert page.value("llmhealth_fleet_reads_per_wait") == 0.78


def test_examinations_are_counted_for_every_target_read_here_and_none_other() -> None:
    page = render(FLEET_VIEW)
    examinations = page.families["llmhealth_backend_examinations"]
    assert {s.name for s in examinations.samples} == {"llmhealth_backend_examinations_total"}
    assert {s.labels["backend"]: s.value for s in examinations.samples} == {
        "gpu0": 12.0,
        "gpu1": 4.0,
        "lb": 12.0,
    }
    # With [cluster] shard_reads another member reads it: no count here, not a zero.
    elsewhere = BackendView(
        name="gpu7", kind="backend", verdict="busy", state="healthy", serving=True
    )
    page = render(ExportView(backends=(busy("gpu0"), elsewhere)))
    assert page.backends_of("llmhealth_backend_examinations") == {"gpu0"}


def test_before_the_first_cycle_the_page_has_no_backends_and_no_fleet_summary() -> None:
    page = render(ExportView())
    assert set(page.families) == set(BACKEND_FAMILIES) | set(ALWAYS_FAMILIES)
    for family in BACKEND_FAMILIES:
        assert page.samples(family) == []
    assert page.value("llmhealth_fleet_stalled") == 0.0
    assert page.value("llmhealth_last_cycle_timestamp_seconds") == 0.0


def test_a_backend_not_judged_yet_has_no_current_verdict_and_no_engine_gauges() -> None:
    fresh = BackendView(name="gpu9", kind="backend", verdict=None, state="healthy", serving=True)
    page = render(ExportView(backends=(fresh,)))
    assert page.ones("llmhealth_backend_verdict", "gpu9", "verdict") == []
    assert len(page.samples("llmhealth_backend_verdict")) == len(VERDICTS)
    assert page.ones("llmhealth_backend_state", "gpu9", "state") == ["healthy"]
    assert page.samples("llmhealth_backend_running_requests") == []
    assert page.samples("llmhealth_backend_probe_duration_seconds") == []


def test_backend_names_with_quotes_and_backslashes_survive_the_exposition() -> None:
    odd = 'gpu "7" \\ rack\nB'
    page = render(ExportView(backends=(busy(odd),)))
    assert page.ones("llmhealth_backend_verdict", odd, "verdict") == ["busy"]
    assert page.value("llmhealth_backend_running_requests", backend=odd) == 4.0


@pytest.mark.slow
def test_a_scrape_sees_one_whole_view_while_views_are_being_published() -> None:
    collector = FleetCollector()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    def view(generation: int) -> ExportView:
        backends = tuple(
            BackendView(f"b{i}", "backend", "busy", "healthy", True, running=generation)
            for i in range(50)
        )
        return ExportView(backends=backends, cycle_seconds=float(generation))

    collector.publish(view(0))
    stop = threading.Event()

    def publish() -> None:
        generation = 0
        while not stop.is_set():
            generation += 1
            collector.publish(view(generation))

    publisher = threading.Thread(target=publish)
    publisher.start()
    try:
        for _ in range(30):
            page = Page(generate_latest(registry).decode())
            running = {s.value for s in page.samples("llmhealth_backend_running_requests")}
            assert running == {page.value("llmhealth_cycle_duration_seconds")}
    finally:
        stop.set()
        publisher.join(5.0)
    assert not publisher.is_alive()


@contextmanager
def served(collector: FleetCollector) -> Iterator[int]:
    # Port 0: the kernel picks a free one, so there is no race with other tests.
    server, thread = serve(collector, "127.0.0.1", 0)
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)


def test_serve_answers_a_real_scrape_on_loopback_and_then_shuts_down() -> None:
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    with served(collector) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        response = httpx.get(url, timeout=5.0)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        page = Page(response.text)
        assert page.ones("llmhealth_backend_state", "gpu1", "state") == ["dead"]
        # Only llmhealth's own families: no process or platform collectors mixed in.
        assert set(page.families) == set(BACKEND_FAMILIES | FLEET_FAMILIES | ALWAYS_FAMILIES)
        # A new view is what the next scrape shows.
        collector.publish(ExportView(backends=(busy("gpu1"),)))
        again = Page(httpx.get(url, timeout=5.0).text)
        assert again.ones("llmhealth_backend_state", "gpu1", "state") == ["healthy"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=2.0)


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_let_go_and_a_full_house_is_turned_away(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Held for ever before: a thread and a descriptor each, until the daemon had no file
    # left to open its state's lock with and every settle was skipped.
    monkeypatch.setattr(exporter._ScrapeHandler, "timeout", 2.0)
    monkeypatch.setattr(exporter, "SCRAPES_AT_ONCE", 2)
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    with served(collector) as port, contextlib.ExitStack() as held:
        url = f"http://127.0.0.1:{port}/metrics"
        silent = [
            held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
            for _ in range(2)
        ]
        turned_away = held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
        assert turned_away.recv(1) == b""  # closed at once, unanswered: both places taken
        for connection in silent:
            assert connection.recv(1) == b""  # let go after the handler's timeout
        assert httpx.get(url, timeout=5.0).status_code == 200  # the places are free again
    assert "Traceback" not in capsys.readouterr().err  # a scraper's timeout is not news


def test_a_request_head_of_megabytes_is_refused_not_parsed() -> None:
    """Each field line and the number of lines were bounded, not their sum: a head of
    about 6 MB was read and parsed, for each of the sixteen scrape places at once."""
    collector = FleetCollector()
    collector.publish(ExportView())
    fields = b"".join(b"X-%d: %s\r\n" % (n, b"a" * 60_000) for n in range(90))
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n"
    with served(collector) as port, socket.create_connection(("127.0.0.1", port), 10) as sock:

        def send() -> None:
            with contextlib.suppress(OSError):  # a server that stops reading ends it
                sock.sendall(head)

        sender = threading.Thread(target=send)
        sender.start()
        status_line = sock.makefile("rb").readline()  # read while the head goes out
        sender.join(30.0)
    assert status_line.split()[1] == b"431", status_line


@pytest.mark.slow
def test_a_client_dribbling_its_request_is_cut_off_and_its_place_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler's timeout bounds each read: a byte every few seconds kept a place
    for as long as the client liked, and sixteen such clients failed every scrape."""
    monkeypatch.setattr(exporter._ScrapeHandler, "timeout", 1.0)
    monkeypatch.setattr(exporter, "SCRAPES_AT_ONCE", 2)
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Dribble: " + b"a" * 200

    def dribble(port: int) -> bool:
        """True when the server closed the connection while a byte a 0.3 s came in."""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for byte in request:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return True
                readable, _, _ = select.select([sock], [], [], 0.3)
                if readable:
                    with contextlib.suppress(OSError):
                        return sock.recv(1) == b""
                    return True
        return False  # the whole dribble (about a minute) was taken

    with served(collector) as port:
        results: list[bool] = []
        dribblers = [
            threading.Thread(target=lambda: results.append(dribble(port))) for _ in range(2)
        ]
        for thread in dribblers:
            thread.start()
        for thread in dribblers:
            thread.join(90.0)
        assert results == [True, True]
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).status_code == 200


@pytest.mark.slow  # waits out a send timeout with both socket buffers full
def test_a_scraper_that_stops_reading_mid_page_leaves_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(exporter._ScrapeHandler, "timeout", 1.0)
    collector = FleetCollector()
    collector.publish(ExportView(backends=tuple(busy(f"gpu{n}") for n in range(2_000))))
    with served(collector) as port:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(10.0)
            # Unread, the page fills both buffers; the server gives up on its next send.
            select.select([], [], [], 2.0)
            with contextlib.suppress(OSError):
                while sock.recv(1 << 16):
                    pass
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).status_code == 200
    assert "Traceback" not in capsys.readouterr().err


def counting_renders(collector: FleetCollector) -> list[ExportView]:
    """The views the collector renders from here on, one entry a render."""
    renders: list[ExportView] = []
    collect = collector.collect

    def counted() -> Iterator[Any]:
        renders.append(collector.view)
        return collect()

    collector.collect = counted  # type: ignore[method-assign]
    return renders


@pytest.mark.slow
def test_one_view_is_rendered_once_however_many_scrape_it() -> None:
    """A render of 10,000 backends takes seconds of CPU and tens of MB: eight scrapers at
    once rendered eight times over, and starved the loop that reads the fleet."""
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    renders = counting_renders(collector)
    with served(collector) as port:
        url = f"http://127.0.0.1:{port}/metrics"

        def scrape(**headers: str) -> httpx.Response:
            return httpx.get(url, timeout=10.0, headers=headers)

        pages: list[bytes] = []
        scrapers = [
            threading.Thread(target=lambda: pages.append(scrape().content)) for _ in range(6)
        ]
        for thread in scrapers:
            thread.start()
        for thread in scrapers:
            thread.join(30.0)
        assert len(pages) == 6 and len(set(pages)) == 1 and len(renders) == 1
        # A path or query of the scraper's choosing is the same page, not a new render:
        # keyed on them, every new one rendered the whole view again.
        for n in range(12):
            for asked in (f"{url}?cachebust={n}", f"http://127.0.0.1:{port}/{n}"):
                assert httpx.get(asked, timeout=10.0).content == pages[0]
        assert len(renders) == 1
        # Nor an OpenMetrics version it chose: echoed in the content type, it was a
        # page, and a render, per version asked.
        for n in range(12):
            accept = f"application/openmetrics-text; version=1.0.{n}"
            answer = httpx.get(url, timeout=10.0, headers={"Accept": accept})
            assert answer.headers["content-type"].startswith(
                "application/openmetrics-text; version=1.0.0"
            )
        assert len(renders) == 2
        # Another way of asking is another page; a new view, a new render.
        plain = scrape(**{"Accept-Encoding": "identity"})
        assert "content-encoding" not in plain.headers
        assert Page(plain.text).ones("llmhealth_backend_state", "gpu1", "state") == ["dead"]
        assert len(renders) == 3
        collector.publish(ExportView(backends=(busy("gpu1"),)))
        assert Page(scrape().text).ones("llmhealth_backend_state", "gpu1", "state") == ["healthy"]
        assert len(renders) == 4
        # Another method's answer (prometheus_client's 405, an empty OPTIONS) is not the
        # page: kept in its place, a balancer's HEAD failed every scrape until a new view.
        collector.publish(ExportView(backends=(wedged("gpu1"),)))
        assert httpx.head(url, timeout=10.0).status_code == 405
        assert httpx.options(url, timeout=10.0).status_code == 200
        assert Page(scrape().text).ones("llmhealth_backend_state", "gpu1", "state") == ["dead"]
        # Nor a render: prometheus_client 0.20, which pyproject allows, rendered the whole
        # view for any method, uncached, however many were sent.
        assert len(renders) == 5
        for method in ("HEAD", "POST", "PUT", "DELETE"):
            answer = httpx.request(method, f"{url}?name[]=x", timeout=10.0, content=b"{}")
            assert answer.status_code == 405 and answer.headers["allow"] == "OPTIONS,GET"
        assert httpx.get(f"http://127.0.0.1:{port}/favicon.ico", timeout=10.0).content == b""
        assert len(renders) == 5


def test_a_rate_past_a_floats_range_is_left_out_not_exported_as_infinity() -> None:
    """One backend's +Inf made every sum over the fleet +Inf on a dashboard; JSON, the
    table and perfdata leave such a rate out already."""
    page = render(ExportView(backends=(replace(busy("gpu0"), tokens_per_s=math.inf),)))
    assert page.samples("llmhealth_backend_generated_tokens_per_second") == []
    assert page.value("llmhealth_backend_engine_steps_per_second", backend="gpu0") == 400.5


def _cluster_samples(view: ClusterView) -> dict[str, list[Sample]]:
    collector = FleetCollector()
    collector.publish(ExportView(cluster=view))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_shares_and_stale_verdicts_are_exported_only_when_reads_are_sharded() -> None:
    plain = _cluster_samples(ClusterView("a", True, True, "a", members={"a": 1.0, "b": 1.0}))
    assert "llmhealth_cluster_member_share_backends" not in plain
    assert "llmhealth_cluster_stale_verdicts" not in plain
    assert [s.value for s in plain["llmhealth_cluster_members"]] == [2.0]
    sharded = _cluster_samples(
        ClusterView(
            "a",
            True,
            True,
            "a",
            members={"a": 1.0, "b": 1.0},
            shares={"a": 5, "b": 7},
            stale_verdicts=2,
        )
    )
    shares = {
        s.labels["member"]: s.value for s in sharded["llmhealth_cluster_member_share_backends"]
    }
    assert shares == {"a": 5.0, "b": 7.0}
    assert [s.value for s in sharded["llmhealth_cluster_stale_verdicts"]] == [2.0]


@pytest.mark.parametrize(
    "accept",
    [
        'application/openmetrics-text; version="1.0.0"',  # a quoted parameter, as HTTP allows
        "application/openmetrics-text; version=latest",
        "text/plain; version=x",
    ],
)
def test_an_accept_header_the_encoder_chooser_cannot_read_gets_the_text_page_not_a_500(
    accept: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """prometheus_client's choose_encoder raises TypeError on a version that is not
    dotted digits: the scraper got a 500 and the daemon's log a traceback per scrape."""
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    with served(collector) as port:
        answer = httpx.get(
            f"http://127.0.0.1:{port}/metrics", timeout=5.0, headers={"Accept": accept}
        )
    assert answer.status_code == 200, answer.status_code
    assert answer.headers["content-type"].startswith("text/plain")
    assert Page(answer.text).ones("llmhealth_backend_state", "gpu1", "state") == ["dead"]
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow
def test_every_way_of_asking_is_rendered_once_per_view_however_often_asked() -> None:
    """prometheus_client answers ten content types (text 0.0.4; text 1.0.0 and OpenMetrics
    in each of four escapings; OpenMetrics unversioned), each compressed or not: twenty
    pages. Eight were kept, so a scraper going round nine or more ways of asking had the
    whole view rendered at every scrape (1.6 s of CPU at 10,000 backends, with the GIL)."""
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    renders = counting_renders(collector)
    escapings = ["underscores", "dots", "values", "allow-utf-8"]
    accepts = [
        "text/plain; version=0.0.4",
        "application/openmetrics-text",
        *(f"text/plain; version=1.0.0; escaping={e}" for e in escapings),
        *(f"application/openmetrics-text; version=1.0.0; escaping={e}" for e in escapings),
    ]
    with served(collector) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        rendered = []
        for _ in range(3):
            for accept in accepts:
                for encoding in ("gzip", "identity"):
                    headers = {"Accept": accept, "Accept-Encoding": encoding}
                    answer = httpx.get(url, timeout=10.0, headers=headers)
                    assert answer.status_code == 200
            rendered.append(len(renders))
    assert rendered == [rendered[0]] * 3, rendered


def test_zero_counts_and_rates_are_exported_as_zero_not_left_out() -> None:
    """A backend with nothing running, a stopped engine, no recoveries yet: each a 0
    sample, not a missing series (an alert on ``== 0`` or ``> 0`` needs the sample)."""
    idle = replace(busy("gpu0"), running=0, waiting=0, steps_per_s=0.0, tokens_per_s=0.0)
    page = render(ExportView(backends=(replace(idle, in_place_recoveries=0, examinations=0),)))
    for family in (
        "llmhealth_backend_running_requests",
        "llmhealth_backend_waiting_requests",
        "llmhealth_backend_engine_steps_per_second",
        "llmhealth_backend_generated_tokens_per_second",
        "llmhealth_backend_in_place_recoveries",
    ):
        assert page.value(family, backend="gpu0") == 0.0, family
    assert page.value("llmhealth_backend_examinations", backend="gpu0") == 0.0


def test_a_leader_with_no_stale_verdicts_exports_zero() -> None:
    """The leader of a sharded cluster with every verdict fresh says 0; only a member
    that does not lead leaves the gauge out."""
    leading = ClusterView(
        "a", True, True, "a", members={"a": 1.0}, shares={"a": 3}, stale_verdicts=0
    )
    assert [s.value for s in _cluster_samples(leading)["llmhealth_cluster_stale_verdicts"]] == [0.0]


def test_a_scrapers_name_filter_is_neither_applied_nor_kept_for_the_next_scraper() -> None:
    """Every scraper is served the whole page: a ``name[]`` query, if prometheus_client
    applied it, would be kept as the page of this view and served to every other
    scraper with most families missing."""
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    with served(collector) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        whole = set(BACKEND_FAMILIES | FLEET_FAMILIES | ALWAYS_FAMILIES)
        filtered = httpx.get(f"{url}?name[]=llmhealth_fleet_stalled", timeout=5.0)
        assert set(Page(filtered.text).families) == whole
        assert set(Page(httpx.get(url, timeout=5.0).text).families) == whole


def test_a_request_line_past_its_bound_is_answered_414() -> None:
    collector = FleetCollector()
    collector.publish(ExportView())
    path = b"/metrics?" + b"a" * (exporter._MAX_REQUEST_LINE + 100)
    with served(collector) as port, socket.create_connection(("127.0.0.1", port), 10) as sock:
        with contextlib.suppress(OSError):  # a server that stops reading ends the send
            sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status_line = sock.makefile("rb").readline()
    assert status_line.split()[1] == b"414", status_line[:80]


def test_serve_listens_on_an_ipv6_address() -> None:
    """The listen address's family is the server's: an IPv6 one failed at bind."""
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server, thread = serve(collector, "::1", 0)
    try:
        answer = httpx.get(f"http://[::1]:{server.server_address[1]}/metrics", timeout=5.0)
        assert Page(answer.text).ones("llmhealth_backend_state", "gpu1", "state") == ["dead"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)


def test_a_request_cut_off_at_its_deadline_is_not_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head cut off unfinished reads as ended (the socket's EOF): answered, it had
    the view rendered for a connection already shut."""
    monkeypatch.setattr(exporter._ScrapeHandler, "timeout", 1.0)
    collector = FleetCollector()
    collector.publish(FLEET_VIEW)
    renders = counting_renders(collector)
    with served(collector) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line after
            assert sock.recv(1) == b""  # cut off at the deadline, unanswered
        for thread in threading.enumerate():
            if "process_request_thread" in thread.name:
                thread.join(10.0)  # the handler is done with the connection
    assert renders == []


# Run in a network namespace of its own (unshare -n), where loopback gets a link-local
# address: exit 77 when that cannot be set up here, else the status of a scrape.
_LINK_LOCAL_SCRAPE = """
import sys
import socket
from llmhealth.exporter import FleetCollector, serve
try:
    server, thread = serve(FleetCollector(), "fe80::1%lo", 0)
except OSError as exc:
    print(f"serve: {exc}")
    sys.exit(1)
with socket.create_connection(("fe80::1%lo", server.server_address[1]), timeout=10) as s:
    s.sendall(b"GET /metrics HTTP/1.0\\r\\n\\r\\n")
    print(s.makefile("rb").readline().decode().strip())
server.shutdown()
server.server_close()
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="root, util-linux unshare and iproute2 ip (a network namespace of its own)",
)
def test_serve_listens_on_an_ipv6_link_local_address_with_its_zone() -> None:
    """``--listen [fe80::1%eth0]:9464``: the zone is the address's scope. Bound as
    (host, port), it was dropped, and the bind failed with EINVAL where `route` listens."""
    setup = "ip link set lo up && ip -6 addr add fe80::1/64 dev lo nodad || exit 77"
    done = subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            f'{setup}; exec "$0" -c "$1"',
            sys.executable,
            _LINK_LOCAL_SCRAPE,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode == 77 or "unshare:" in done.stderr:
        pytest.skip(f"no network namespace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split()[1] == "200", done.stdout


# A listener in a process with no descriptor left: it counts its accept attempts while a
# scraper's connection waits, then gives the descriptors back and answers it.
_OUT_OF_FILES_SCRAPE = """
import os, resource, sys, time
from llmhealth import exporter
from llmhealth.exporter import FleetCollector, serve
attempts = 0
accept = exporter._ScrapeServer.get_request
def counted(server):
    global attempts
    attempts += 1
    return accept(server)
exporter._ScrapeServer.get_request = counted
server, thread = serve(FleetCollector(), "127.0.0.1", 0)
print(server.server_address[1], flush=True)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
while True:
    try:
        held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        break
print("full", flush=True)
sys.stdin.readline()  # the scraper has connected
time.sleep(0.5)
before = attempts
time.sleep(1.0)
print(attempts - before, flush=True)
for descriptor in held:
    os.close(descriptor)
sys.stdin.readline()  # the scraper has its answer
server.shutdown()
server.server_close()
"""


@pytest.mark.slow
def test_a_listener_out_of_descriptors_waits_to_accept_again_not_spins() -> None:
    """Each accept failed at once while a connection waited (about 200,000 a second),
    a core and the GIL taken from the loop, itself short of descriptors. It waits."""
    with subprocess.Popen(
        [sys.executable, "-c", _OUT_OF_FILES_SCRAPE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            port = int(child.stdout.readline())
            assert child.stdout.readline().strip() == "full"
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                child.stdin.write("connected\n")
                child.stdin.flush()
                attempts = int(child.stdout.readline())
                with sock.makefile("rb") as answer:
                    status_line = answer.readline()  # taken once descriptors are back
                child.stdin.write("answered\n")
                child.stdin.flush()
            assert child.wait(timeout=30) == 0
        finally:
            if child.poll() is None:
                child.kill()
    assert attempts <= 5, attempts
    assert status_line.split()[1] == b"200", status_line
