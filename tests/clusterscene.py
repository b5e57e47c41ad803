"""Test helper: real `llmhealth watch` daemons on one fleet, a real etcd, real faults.

A scene is its own etcd (free ports, data in a temp dir) and a restartable simulated
backend whose restart command writes one line (the fencing token and the member that ran
it) before it really restarts the server: the line count is the number of restarts,
whoever ran them. Used by tests/test_cluster_faults.py (the quick faults) and
e2e/test_cluster.py (pauses, outages, several etcd members, cron beside daemons).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etcdproc import EtcdCluster, running_etcd
from restartable import Server, restartable_fleet
from test_daemon import (
    PATIENCE,
    NotObservedError,
    Page,
    Watch,
    fleet_config,
    watching,
    write_config,
)

from llmhealth.cluster import Etcd, Keys, read_audit

TTL = 3  # seconds; the daemons' renew deadline is 2 s, their retry period 0.4 s
WAIT = 0.5  # the daemons' --wait, from test_daemon.watching
PREFIX = "/llmhealth/faults"


@dataclass
class Restarts:
    """The log every restart command appends to: one line per command that ran."""

    path: Path

    def lines(self) -> list[tuple[int, str]]:
        """(fence, member) per restart; (0, "") for one run by a daemon without a cluster."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        restarts = []
        for line in text.splitlines():
            fence, _, member = line.strip().partition(" ")
            restarts.append((int(fence) if fence else 0, member))
        return restarts

    def argv(self, server: Server, mode: str = "idle") -> list[str]:
        # $0 is the log, "$@" the real restart; nothing a server said reaches this shell.
        script = 'echo "$LLMHEALTH_FENCE $LLMHEALTH_MEMBER" >> "$0"; exec "$@" >> "$0.out" 2>&1'
        return ["sh", "-c", script, str(self.path), *server.restart_argv(mode)]


def member_of(page: Page) -> str:
    samples = page.samples("llmhealth_cluster_leader")
    assert len(samples) == 1, samples
    return samples[0].labels["member"]


def leads(page: Page) -> bool:
    samples = page.samples("llmhealth_cluster_leader")
    return bool(samples) and samples[0].value == 1.0


def inject_wedge(server: Server) -> None:
    """The simulator's own restart into a mode that wedges (a new "process").

    It wedges one second in, once its synthetic load is running: a process that froze
    before taking any work shows none, and is judged by the tiny request instead. It
    says it has been up an hour: a young one's freeze is only proven past its startup
    window (minutes), as a real restart's is.
    """
    switch_mode(server, "wedge:1", age=3600.0)


def switch_mode(server: Server, mode: str, age: float = 0.0) -> None:
    """The simulator's own restart into ``mode``: a new "process" on the same port,
    ``age`` seconds old."""
    body = json.dumps({"mode": mode, "age": age}).encode()
    request = urllib.request.Request(f"{server.url}/sim/restart", data=body, method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=5.0) as response:
        assert response.status == 200


def until(what: str, predicate: Callable[[], bool], timeout: float = PATIENCE) -> float:
    """Poll until ``predicate`` holds; the monotonic time it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


@dataclass
class Scene:
    etcd: EtcdCluster
    gpu: Server
    restarts: Restarts
    config: Path
    folder: Path
    entry_point: str
    # Every backend by name (gpu among them), each with its own restart log.
    servers: dict[str, tuple[Server, Restarts]] = field(default_factory=dict)

    @contextmanager
    def daemon(self, name: str, member: str | None = None, top: str = "") -> Iterator[Watch]:
        """A daemon on the scene's config; ``member`` names it in etcd (default: host and
        PID), for a test whose shares must not depend on a PID; ``top`` adds top-level
        settings (``read_workers = 2``) to its config alone."""
        with watching(
            self.entry_point, self.config_for(name, member, top), self.state(name)
        ) as watch:
            yield watch

    def state(self, name: str) -> Path:
        """A daemon's own state path: in a cluster nothing may be written there."""
        return self.folder / f"{name}-state.json"

    def config_for(self, name: str, member: str | None = None, top: str = "") -> Path:
        """The scene's config, with ``member`` naming the daemon in etcd and ``top`` added."""
        if member is None and not top:
            return self.config
        text = self.config.read_text()
        if member is not None:
            text = text.replace("[cluster]\n", f'[cluster]\nmember = "{member}"\n')
        return write_config(self.folder / f"fleet-{name}.toml", f"{top}\n{text}")

    def audited_restarts(self) -> list[dict[str, object]]:
        """The restarts the fleet's audit trail in etcd holds: one per restart issued."""
        records = read_audit(Etcd(self.etcd.endpoints), Keys(PREFIX)).records
        return [r for r in records if r.get("event") == "restart" and r.get("to") == "restarting"]

    def readmitted_since_restart(self, backend: str = "gpu") -> bool:
        """Whether the trail has ``backend`` back in serving after its latest restart.

        The re-admission itself: a standby's page may still show the state of a record
        read before the wedge was condemned, "healthy" with the restart under way.
        """
        return self._readmitted_since(
            backend, lambda r: r.get("event") == "restart" and r.get("to") == "restarting"
        )

    def readmitted_since_reset(self, backend: str) -> bool:
        """Whether the trail has ``backend`` back in serving after an operator's reset."""
        return self._readmitted_since(backend, lambda r: r.get("event") == "reset")

    def _readmitted_since(self, backend: str, out: Callable[[dict[str, Any]], bool]) -> bool:
        records = read_audit(Etcd(self.etcd.endpoints), Keys(PREFIX)).records
        mine = [r for r in records if r.get("backend") == backend]
        taken_out = [i for i, r in enumerate(mine) if out(r)]
        return bool(taken_out) and any(r.get("to") == "healthy" for r in mine[taken_out[-1] + 1 :])

    @contextmanager
    def explained(self, leader: Watch, backend: str = "gpu") -> Iterator[None]:
        """A wait that fails inside says what the leader saw: its page, its log's tail and
        ``backend``'s audit trail. A standby renders the leader's record, so its own page
        shows that a backend stayed out, not why."""
        try:
            yield
        except (AssertionError, NotObservedError) as failure:
            page = leader.scrape()
            # CI keeps a run's tail: the page's samples that say something, not all of it.
            shown = [
                line
                for line in (page.text if page else "(none)").splitlines()
                if not line.startswith("#") and not line.endswith(" 0.0")
            ]
            log = leader.stderr().splitlines()[-40:]
            try:
                trail = [
                    json.dumps(r, sort_keys=True)
                    for r in read_audit(Etcd(self.etcd.endpoints), Keys(PREFIX)).records
                    if r.get("backend") == backend
                ][-30:]
            except Exception as exc:  # the diagnosis must not hide the failure
                trail = [f"(the audit trail could not be read: {exc!r})"]
            raise AssertionError(
                f"{failure}\n--- the leader's page, samples not 0 ---\n"
                + "\n".join(shown)
                + "\n--- the leader's log, last lines ---\n"
                + "\n".join(log)
                + f"\n--- {backend}'s audit trail, last records ---\n"
                + "\n".join(trail)
            ) from failure

    def audit_command(self) -> list[dict[str, object]]:
        """``llmhealth audit`` as an operator runs it, every record parsed."""
        done = subprocess.run(
            [self.entry_point, "audit", "-c", str(self.config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return [json.loads(line) for line in done.stdout.splitlines()]

    def record(self) -> dict[str, object]:
        found = Etcd(self.etcd.endpoints).get(Keys(PREFIX).state)
        assert found is not None
        value: dict[str, object] = json.loads(found.value)
        return value


@contextmanager
def staged(
    entry_point: str,
    tmp_path: Path,
    etcd_members: int = 1,
    policy: str = "",
    *,
    more: int = 0,
    cluster: str = "",
    also: Sequence[Mapping[str, object]] = (),
) -> Iterator[Scene]:
    """A scene; ``policy`` is the body of a [policy] table for the config, if any, and
    ``cluster`` more lines of its [cluster] table; ``more`` backends beside gpu, and
    ``also`` backend tables of servers the test runs itself (not in ``servers``)."""
    with ExitStack() as stack:
        etcd = stack.enter_context(running_etcd(tmp_path / "etcd-data", etcd_members))
        fleet = stack.enter_context(restartable_fleet(tmp_path))
        servers = {}
        for name in ["gpu", *(f"gpu{index}" for index in range(1, more + 1))]:
            log = tmp_path / ("restarts.log" if name == "gpu" else f"restarts-{name}.log")
            servers[name] = (fleet.start(name, "busy"), Restarts(log))
        text = fleet_config(
            [
                {"name": name, "url": server.url, "restart": restarts.argv(server)}
                for name, (server, restarts) in servers.items()
            ]
            + list(also)
        )
        text += (
            f'\n[cluster]\netcd = {json.dumps(etcd.endpoints)}\nprefix = "{PREFIX}"\n'
            f"lease_ttl = {TTL}\n{cluster}\n"
        )
        if policy:
            text += f"\n[policy]\n{policy}\n"
        config = write_config(tmp_path / "fleet.toml", text)
        gpu, restarts = servers["gpu"]
        yield Scene(etcd, gpu, restarts, config, tmp_path, entry_point, servers)


def two_daemons(
    scene: Scene, stack: ExitStack, members: tuple[str, str] | tuple[None, None] = (None, None)
) -> tuple[Watch, Watch]:
    """The first daemon leads, the second has cycled as a standby."""
    first = stack.enter_context(scene.daemon("a", members[0]))
    first.until("the first daemon leading", leads)
    second = stack.enter_context(scene.daemon("b", members[1]))
    page = second.until("the second daemon cycling", lambda p: p.cycled)
    assert not leads(page)
    return first, second
