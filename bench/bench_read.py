"""CPU of the checker per /metrics read: the read client llmhealth uses against httpx.

A server process serves one real 53 KB capture, pre-rendered, from as many ports as there
are connections (keep-alive, Content-Length), so the server costs next to nothing and its
CPU is measured apart (its own process times, read when it exits). The checker side runs
each variant in a fresh child process, concurrent reads over ``CONNECTIONS`` connections,
and reports that process's CPU time per read, extraction included:

- ``wire`` is what `check` and `watch` do now: ``probe.read_metrics`` through
  ``llmhealth.wire`` and ``parse_metrics``;
- ``wire-uvloop`` is the same on uvloop's event loop (the ``uvloop`` extra; left out
  where it is not installed);
- ``httpx`` is the read as probe.py made it before (``AsyncClient.stream``, identity,
  ``aiter_raw``, the same limits), then ``parse_metrics``;
- ``httpcore`` is httpx's transport layer driven directly (one pool per connection),
  the lowest way of driving httpx's stack, then ``parse_metrics``.

``extraction only`` is ``parse_metrics`` on the same body in the same child: the rest of
a read's CPU is the HTTP client's. Target: at most 0.5 ms per read, median.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import Section, Table, spread

HERE = Path(__file__).resolve().parent
CAPTURE = HERE.parent / "fixtures" / "vllm-0.32" / "busy-2.txt"
CONNECTIONS = 100
ROUNDS = 20  # reads per connection per measured run
RUNS = 5  # fresh child processes per variant
HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None
VARIANTS = (
    ("wire", "wire-uvloop", "httpx", "httpcore") if HAS_UVLOOP else ("wire", "httpx", "httpcore")
)
TARGET_MS = 0.5

SERVER = """
import asyncio, sys
body = open(sys.argv[1], "rb").read()
answer = (b"HTTP/1.1 200 OK\\r\\ncontent-type: text/plain; version=1.0.0; charset=utf-8\\r\\n"
          b"content-length: %d\\r\\n\\r\\n" % len(body)) + body

class Serve(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.pending = transport, b""
    def data_received(self, data):
        self.pending += data
        while b"\\r\\n\\r\\n" in self.pending:
            _, _, self.pending = self.pending.partition(b"\\r\\n\\r\\n")
            self.transport.write(answer)

async def main():
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(Serve, "127.0.0.1", 0) for _ in range(int(sys.argv[2]))]
    print(" ".join(str(s.sockets[0].getsockname()[1]) for s in servers), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the bench closes stdin

asyncio.run(main())
"""


def child(variant: str, ports: list[int], rounds: int) -> dict[str, float]:
    """One measured run in this (fresh) process: CPU per read, and extraction alone."""
    import ssl  # noqa: PLC0415 - the child's imports are part of what it measures

    from llmhealth.classify import Target  # noqa: PLC0415
    from llmhealth.metrics import parse_metrics  # noqa: PLC0415
    from llmhealth.probe import ProbeSettings, new_client, read_metrics  # noqa: PLC0415

    targets = [Target(f"b{port}", f"http://127.0.0.1:{port}") for port in ports]
    settings = ProbeSettings(timeout=30.0)

    async def run() -> float:
        if variant.startswith("wire"):
            clients = [new_client() for _ in ports]

            async def read(index: int) -> None:
                result = await read_metrics(clients[index], targets[index], settings, time.time)
                assert result.signals is not None and result.signals.has_vllm, result

            async def close() -> None:
                await asyncio.gather(*(client.aclose() for client in clients))

        elif variant == "httpx":
            import httpx  # noqa: PLC0415

            tls = ssl.create_default_context()
            pool = [
                httpx.AsyncClient(
                    verify=tls,
                    follow_redirects=False,
                    trust_env=False,
                    limits=httpx.Limits(max_connections=4, max_keepalive_connections=2),
                    headers={"User-Agent": "llmhealth/bench", "Accept-Encoding": "identity"},
                )
                for _ in ports
            ]

            async def read(index: int) -> None:
                async with pool[index].stream(
                    "GET", f"{targets[index].url}/metrics", timeout=httpx.Timeout(30.0)
                ) as response:
                    body = b"".join([chunk async for chunk in response.aiter_raw()])
                assert parse_metrics(body).has_vllm

            async def close() -> None:
                await asyncio.gather(*(client.aclose() for client in pool))

        else:
            import httpcore  # noqa: PLC0415

            tls = ssl.create_default_context()
            pools = [httpcore.AsyncConnectionPool(ssl_context=tls) for _ in ports]
            headers = [(b"Accept-Encoding", b"identity"), (b"User-Agent", b"llmhealth/bench")]

            async def read(index: int) -> None:
                response = await pools[index].request(
                    "GET", f"{targets[index].url}/metrics", headers=headers
                )
                assert parse_metrics(response.content).has_vllm

            async def close() -> None:
                await asyncio.gather(*(pool.aclose() for pool in pools))

        await asyncio.gather(*(read(i) for i in range(len(ports))))  # connect, warm up
        started = time.process_time()
        for _ in range(rounds):
            await asyncio.gather(*(read(i) for i in range(len(ports))))
        cpu = time.process_time() - started
        await close()
        return cpu / (rounds * len(ports))

    if variant == "wire-uvloop":
        import uvloop  # noqa: PLC0415

        factory = uvloop.new_event_loop
    else:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        per_read = runner.run(run())
    body = CAPTURE.read_bytes()
    repeat = 300
    started = time.process_time()
    for _ in range(repeat):
        parse_metrics(body)
    extraction = (time.process_time() - started) / repeat
    return {"read_ms": per_read * 1e3, "extraction_ms": extraction * 1e3}


def measure(runs: int = RUNS, connections: int = CONNECTIONS) -> dict[str, object]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(CAPTURE), str(connections)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    try:
        assert server.stdout is not None
        ports = server.stdout.readline().split()
        for _ in range(runs):
            for variant in VARIANTS:  # alternated: each sees the same load
                done = subprocess.run(
                    [sys.executable, str(HERE / "bench_read.py"), "child", variant, *ports],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=True,
                )
                results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    checker_cpu = (children.ru_utime - before.ru_utime) + (children.ru_stime - before.ru_stime)
    reads = runs * len(VARIANTS) * connections * (ROUNDS + 1)
    return {
        "results": results,
        "server_ms_per_read": server_cpu / reads * 1e3,
        "checker_children_s": checker_cpu,
        "load": os.getloadavg()[0],
    }


def run(runs: int = RUNS) -> list[Section]:
    began = time.monotonic()
    measured = measure(runs)
    results: dict[str, list[dict[str, float]]] = measured["results"]  # type: ignore[assignment]
    rows = []
    for variant in VARIANTS:
        reads = [figure["read_ms"] for figure in results[variant]]
        extraction = [figure["extraction_ms"] for figure in results[variant]]
        http = [r - e for r, e in zip(reads, extraction, strict=True)]
        rows.append(
            [
                variant,
                spread(reads, 3),
                f"{max(reads):.3f}",
                spread(extraction, 3),
                spread(http, 3),
            ]
        )
    ours = statistics.median(figure["read_ms"] for figure in results["wire"])
    before = statistics.median(figure["read_ms"] for figure in results["httpx"])
    verdict = "met" if ours <= TARGET_MS else "**MISSED**"
    return [
        Section(
            title="3e. CPU per /metrics read: llmhealth's read client against httpx",
            command="cd bench && ../.venv/bin/python bench_read.py",
            intro=[
                f"{CONNECTIONS} keep-alive connections to a server process serving the "
                f"real capture `{CAPTURE.name}` ({CAPTURE.stat().st_size:,} bytes) "
                f"pre-rendered; {ROUNDS} concurrent rounds per run, {runs} fresh child "
                "processes per variant, alternated. Figures are the child's own CPU "
                "(process time) per read, median (min-max) over the runs; *HTTP* is a "
                "read's CPU less the extraction's, measured in the same child. "
                f"The server's CPU, apart: {measured['server_ms_per_read']:.3f} ms per "
                f"read. 1-minute load average at the end: {measured['load']:.1f} on "
                f"{os.cpu_count()} cores."
            ],
            tables=[
                Table(
                    [
                        "read client",
                        "CPU ms / read (with extraction)",
                        "max",
                        "extraction ms",
                        "HTTP ms",
                    ],
                    rows,
                )
            ],
            notes=[
                f"Target ≤ {TARGET_MS} ms per read, median: {verdict} ({ours:.3f} ms with "
                f"`wire`, {before:.3f} ms with httpx as before, {before / ours:.1f}x)."
            ],
            seconds=time.monotonic() - began,
        )
    ]


def main() -> None:
    import report  # noqa: PLC0415 - the module, beside the names imported above

    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command")
    kid = sub.add_parser("child")
    kid.add_argument("variant", choices=VARIANTS)
    kid.add_argument("ports", nargs="+", type=int)
    parser.add_argument("--runs", type=int, default=RUNS)
    arguments = parser.parse_args()
    if arguments.command == "child":
        print(json.dumps(child(arguments.variant, arguments.ports, ROUNDS)))
        return
    for section in run(arguments.runs):
        print(report.section_markdown(section))


if __name__ == "__main__":
    main()
