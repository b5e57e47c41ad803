"""`llmhealth route` as operators run it: a real process over real simulated backends.

The story the router exists for: a backend whose engine keeps stepping (busy to every
probe) but which never answers a real request is condemned by traffic alone, after a
handful of client-visible failures, each bounded by first_byte_timeout.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from simproc import child_env, running_simulator
from test_router import free_port

BOUND = 60.0  # seconds any awaited condition may take on a loaded machine; not a claim
FIRST_BYTE = 1.0
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}  # what the simulator serves


@contextlib.contextmanager
def running_route(entry_point: str, config: Path, port: int) -> Iterator[str]:
    """`llmhealth route` on ``port`` until the block ends; always stopped."""
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(
            [entry_point, "route", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=child_env(),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + BOUND
            while True:
                assert process.poll() is None, _text(stderr)
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, f"route not up; stderr:\n{_text(stderr)}"
                time.sleep(0.1)
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        assert process.returncode == 0, _text(stderr)


def _text(stderr: object) -> str:
    assert hasattr(stderr, "seek") and hasattr(stderr, "read")
    stderr.seek(0)
    text: str = stderr.read().decode(errors="replace")
    return text


def write_config(tmp_path: Path, backends: dict[str, str], extra: str = "") -> Path:
    lines = [
        'wait = "0.5s"',
        f'state = "{tmp_path / "state.json"}"',
        "[policy]",
        "unhealthy_threshold = 3",
        "[router]",
        f'first_byte_timeout = "{FIRST_BYTE}s"',
        extra,
    ]
    for name, url in backends.items():
        lines += ["[[backend]]", f'name = "{name}"', f'url = "{url}"']
    path = tmp_path / "llmhealth.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def backend_state(route_url: str, name: str) -> str:
    states: dict[str, str] = httpx.get(route_url + "/health", timeout=5).json()["backends"]
    return states[name]


def test_a_backend_busy_to_probes_but_failing_every_request_is_condemned_by_traffic(
    tmp_path: Path, entry_point: str
) -> None:
    with running_simulator(["busy+unanswered", "idle"], request_seconds=0.05) as sim:
        # "a" sorts first, so with nothing in flight every tie goes to the liar.
        config = write_config(tmp_path, {"a": sim.urls[0], "b": sim.urls[1]})
        with running_route(entry_point, config, free_port()) as route:
            failed, answered = [], 0
            deadline = time.monotonic() + BOUND
            while backend_state(route, "a") != "dead":
                assert time.monotonic() < deadline, "traffic never condemned the wedged backend"
                started = time.monotonic()
                response = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                took = time.monotonic() - started
                if response.status_code == 200:
                    answered += 1
                    continue
                assert response.status_code == 500
                assert response.json()["backend"] == "a"
                failed.append(took)
            # A handful: one per settle until the streak reaches the threshold (3), as the
            # reflex drop keeps "a" out between settles.
            assert 3 <= len(failed) <= 4
            # Each failure bounded by first_byte_timeout (plus generous room for the load).
            assert all(took < FIRST_BYTE + 10 for took in failed)
            for _ in range(5):  # after condemnation every client is answered
                reply = httpx.post(route + "/v1/completions", json=COMPLETION, timeout=BOUND)
                assert reply.status_code == 200
            metrics = httpx.get(route + "/metrics", timeout=5).text
            assert 'llmhealth_backend_state{backend="a",state="dead"} 1.0' in metrics
    document = json.loads((tmp_path / "state.json").read_text())
    (record,) = [b for b in document["ledger"]["backends"] if b["name"] == "a"]
    assert record["condemned_by"] == "request_failures"
    assert "first_byte_timeout" in record["last_error"]
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    condemned = [line for line in audit if line.get("to") == "dead"]
    assert condemned and condemned[0]["backend"] == "a"
    assert condemned[0]["evidence"]["verdict"] == "request_failures"
    # The proof names every failed request of the streak, across the settles it spanned.
    requests = condemned[0]["evidence"]["requests"]
    assert len(requests) == 3
    assert all(r["failure"] == "first_byte_timeout" for r in requests)
    assert [r["at"] for r in requests] == sorted(r["at"] for r in requests)


def test_route_refuses_to_start_without_backends_or_with_a_bad_address(
    tmp_path: Path, entry_point: str
) -> None:
    nothing = subprocess.run(
        [entry_point, "route"], capture_output=True, text=True, timeout=60, check=False
    )
    assert nothing.returncode == 3, nothing.stderr
    assert "nothing to route to" in nothing.stderr
    config = write_config(tmp_path, {"a": "http://127.0.0.1:9"})
    bad = subprocess.run(
        [entry_point, "route", "--config", str(config), "--listen", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 3, bad.stderr
    assert "'nowhere' is not HOST:PORT" in bad.stderr
