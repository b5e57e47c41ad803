"""Where `llmhealth route` spends its CPU per request: cProfile of the router in-process.

`python profile_router.py [SECONDS] [CLIENTS]` starts `fast_backend.py` and the load
generator of `bench_router.py` (small non-streaming requests) as their own processes,
so only the router's own work is profiled, and prints the functions with the most
cumulative and own time, and the router's CPU per request from the profile's process
clock. The profile costs time of its own (every Python call is counted): its shares are
what matter, not its absolute figures; `bench_router.py` measures the speed.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from bench_router import PYTHON, free_port, load, process

from llmhealth.config import Backend
from llmhealth.config import Router as RouterConfig
from llmhealth.router import Router

HERE = Path(__file__).resolve().parent


async def _profiled(backend: str, seconds: float, clients: int) -> tuple[pstats.Stats, int, float]:
    router = Router(RouterConfig(), [Backend("b0", backend)])
    router.push({"b0": None}, {"b0": "serving"}, 1)
    port = free_port()
    await router.start("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(load, "small", url, "8", "1")  # warm-up: connections
        profile = cProfile.Profile()
        cpu_before = time.process_time()
        profile.enable()
        result = await asyncio.to_thread(load, "small", url, str(clients), str(seconds))
        profile.disable()
        cpu = time.process_time() - cpu_before
    finally:
        await router.close()
    return pstats.Stats(profile), len(result["latencies"]), cpu


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    clients = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    port = free_port()
    with process([PYTHON, str(HERE / "fast_backend.py"), str(port)], ready="ready"):
        stats, answered, cpu = asyncio.run(_profiled(f"http://127.0.0.1:{port}", seconds, clients))
    print(f"{answered} requests answered; {cpu / max(1, answered) * 1000:.3f} ms CPU each")
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        stats.stream = out  # type: ignore[attr-defined]  # pstats prints to its stream
        stats.sort_stats(order).print_stats(30)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
