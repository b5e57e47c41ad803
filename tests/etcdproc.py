"""Test helper: real etcd servers on 127.0.0.1 free ports, data in a temp dir, always stopped.

`with running_etcd(tmp_path) as cluster: cluster.endpoints` gives the client URLs of one
member, or of several with ``members=3``. Each member can be stopped, paused and started
again (same data, same ports) to play an outage. Every process started here is killed
when the block exits, failing test or not, and every wait is bounded.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class EtcdStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    initial_cluster: str
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None
    started_once: bool = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        client = self.endpoint
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            _etcd_binary(),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.initial_cluster,
            "--initial-cluster-state",
            "existing" if self.started_once else "new",
            "--initial-cluster-token",
            "llmhealth-test",
            # Quick elections among local members, and no fsync stalls on a loaded disk.
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--unsafe-no-fsync",
        ]

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log
        )
        self.started_once = True

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused member cannot exit
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT)
        if self._log is not None:
            self._log.close()
            self._log = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1.0) as response:
                return b'"true"' in response.read(4096)
        except OSError:
            return False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@dataclass
class EtcdCluster:
    members: list[Member] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [member.endpoint for member in self.members]

    def wait_healthy(self, members: list[Member] | None = None) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        for member in members or self.members:
            while not member.healthy():
                if member.process is not None and member.process.poll() is not None:
                    raise EtcdStartError(f"etcd {member.name} exited:\n{member.log_text()}")
                if time.monotonic() > deadline:
                    raise EtcdStartError(f"etcd {member.name} not healthy:\n{member.log_text()}")
                time.sleep(0.05)

    def close(self) -> None:
        for member in self.members:
            member.stop()


def _etcd_binary() -> str:
    found = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if found is None:
        raise EtcdStartError("no etcd binary: run 'make tools' (Debian package etcd-server)")
    return found


@contextmanager
def running_etcd(directory: Path, members: int = 1) -> Iterator[EtcdCluster]:
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"m{index}" for index in range(members)]
    ports = [(free_port(), free_port()) for _ in names]
    initial = ",".join(
        f"{name}=http://127.0.0.1:{peer}" for name, (_, peer) in zip(names, ports, strict=True)
    )
    cluster = EtcdCluster(
        [
            Member(
                name, client, peer, directory / f"etcd-{name}", directory / f"{name}.log", initial
            )
            for name, (client, peer) in zip(names, ports, strict=True)
        ]
    )
    try:
        for member in cluster.members:
            member.start()
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.close()
