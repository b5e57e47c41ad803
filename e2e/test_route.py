"""`llmhealth route` in front of real vLLM 0.32 servers (CPU, tiny model).

The router must be invisible when all is well (a greedy answer through it is the direct
answer, streamed or not), must pass a client's departure on (vLLM aborts the request and
frees its slot, by vLLM's own count), and must keep clients answered while one of two
engines is frozen, until the ledger condemns that backend.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import start_server
from helpers import GENERATED, LLMHEALTH, RUNNING, request, scrape, wait_for, wait_quiet
from vllm_server import MODEL_NAME, VllmServer, free_port

CHAT = "/v1/chat/completions"
GREEDY = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 24,
    "temperature": 0,
}


@contextlib.contextmanager
def routing(tmp_path: Path, backends: dict[str, str], extra: str = "") -> Iterator[str]:
    """`llmhealth route` over ``backends`` until the block ends; always stopped."""
    config = tmp_path / "route.toml"
    lines = ['wait = "5s"', 'timeout = "15s"', f'state = "{tmp_path / "state.json"}"', extra]
    for name, url in backends.items():
        lines += ["[[backend]]", f'name = "{name}"', f'url = "{url}"']
    config.write_text("\n".join(lines) + "\n", encoding="utf-8")
    port = free_port()
    with (tmp_path / "route.log").open("wb") as log:
        process = subprocess.Popen(
            [*LLMHEALTH, "route", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the router to serve", lambda: _serving(url), 60)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _serving(url: str) -> bool:
    with contextlib.suppress(OSError, http.client.HTTPException):
        status, _ = request(url, "GET", "/health", timeout=5)
        return status == 200
    return False


def health(url: str) -> dict[str, Any]:
    _, body = request(url, "GET", "/health", timeout=10)
    document: dict[str, Any] = json.loads(body)
    return document


def chat(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    status, raw = request(url, "POST", CHAT, json.dumps(body).encode(), timeout)
    return status, json.loads(raw)


def streamed_text(url: str, body: dict[str, Any]) -> str:
    """The content of a streamed chat completion, put together from its deltas."""
    _, raw = request(url, "POST", CHAT, json.dumps({**body, "stream": True}).encode(), 120)
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                text += choice.get("delta", {}).get("content") or ""
    return text


def test_a_greedy_chat_completion_through_the_router_is_the_direct_answer(
    server: VllmServer, tmp_path: Path
) -> None:
    status, direct = chat(server.url, GREEDY)
    assert status == 200, direct
    expected = direct["choices"][0]["message"]["content"]
    assert expected
    with routing(tmp_path, {"gpu0": server.url}) as route:
        status, routed = chat(route, GREEDY)
        assert status == 200, routed
        assert routed["choices"][0]["message"]["content"] == expected
        assert streamed_text(route, GREEDY) == expected
        # The router's own list, from what its probes' tiny request saw (the next idle read).
        wait_for("the router to list the model", lambda: _listed(route) == [MODEL_NAME], 60)


def _listed(url: str) -> list[str]:
    _, models = request(url, "GET", "/v1/models")
    return [model["id"] for model in json.loads(models)["data"]]


def test_a_client_that_goes_away_through_the_router_frees_its_vllm_slot(
    server: VllmServer, tmp_path: Path
) -> None:
    before = wait_quiet(server)
    long_stream = {
        "model": MODEL_NAME,
        "prompt": "The health of a server is",
        # The model's whole context (2048) less the prompt: far longer than the abort takes.
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    body = json.dumps(long_stream).encode()
    with routing(tmp_path, {"gpu0": server.url}) as route:
        port = int(route.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            received = b""
            while b"data: {" not in received:  # tokens are flowing to this client
                chunk = client.recv(65536)
                assert chunk, received
                received += chunk
                if len(received) >= 12:  # a refusal (400, say) would never stream
                    assert received.startswith(b"HTTP/1.1 200"), received
            wait_for("vLLM to run the request", lambda: scrape(server.url)[RUNNING] == 1, 60)
        # The client is gone; the router must close its upstream request, and vLLM abort it.
        wait_for("vLLM to abort the request", lambda: scrape(server.url)[RUNNING] == 0, 60)
        after = scrape(server.url)
    assert after[GENERATED] - before[GENERATED] < 2000


def test_with_one_engine_stopped_the_routers_clients_keep_getting_answers(
    server: VllmServer, spare_servers: list[VllmServer], tmp_path: Path
) -> None:
    frozen = VllmServer(free_port(), tmp_path / "vllm-frozen.log")
    spare_servers.append(frozen)
    start_server(frozen)
    small = {**GREEDY, "max_tokens": 4}
    # "gpu0" sorts first: with nothing in flight, ties go to the frozen one.
    backends = {"gpu0": frozen.url, "gpu1": server.url}
    with routing(tmp_path, backends, '[router]\nfirst_byte_timeout = "20s"') as route:
        assert chat(route, small)[0] == 200
        engine = frozen.engine_core_pid()
        os.kill(engine, signal.SIGSTOP)
        try:
            failed, answered = 0, 0
            deadline = time.monotonic() + 300
            while health(route)["backends"]["gpu0"] != "dead":
                assert time.monotonic() < deadline, health(route)
                status, reply = chat(route, small)
                if status == 200:
                    answered += 1
                else:
                    assert status == 500 and reply["backend"] == "gpu0", reply
                    failed += 1
            # Every failure a client saw was a deliberate, bounded 500 (the request client
            # waits 120 s); a handful at most before the backend left the serving set.
            assert failed <= 4, (failed, answered)
            for _ in range(3):
                status, reply = chat(route, small)
                assert status == 200, reply
        finally:
            os.kill(engine, signal.SIGCONT)
