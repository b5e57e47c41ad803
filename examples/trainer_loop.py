#!/usr/bin/env python3
"""A trainer's generation controller on llmhealth, against vLLM-compatible servers.

One event loop runs the probe pump (Prober feeding FleetHealth, with the stall watch) and
the rollouts (Selector leases, which report each request's end to the ledger). Between
steps the controller rebuilds dead shards and syncs weights; one sync aborts partway, and
only the completed refit that follows brings the shards back into the serving set.

    python examples/trainer_loop.py URL [URL ...]

Restarting a shard is the trainer's business (a Ray actor, a process); here it is the
simulator's ``POST /sim/restart``, so run this against ``llmhealth simulate``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

from llmhealth import (
    FleetHealth,
    FleetPolicy,
    NoServingBackend,
    Prober,
    Selector,
    StallWatch,
    State,
)


async def rollout(client: httpx.AsyncClient, fleet: FleetHealth, selector: Selector) -> bool:
    """One generation on the least busy serving shard; a failure is retried once elsewhere
    (a 4xx, the request's own fault, is not counted against the shard: the lease's rule)."""
    tried: set[int | str] = set()
    for _ in range(2):
        try:
            with selector.lease(exclude=tried) as shard:
                tried.add(shard)
                url = f"{fleet.base_url_of(shard)}/v1/completions"
                body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
                (await client.post(url, json=body)).raise_for_status()
                return True
        except NoServingBackend:
            return False  # nowhere else to try
        except httpx.HTTPError:
            continue
    return False


async def probe_pump(prober: Prober, stall: StallWatch, interval: float) -> None:
    """seed 001's probe loop: every interval, probe, then ask whether the fleet progresses.

    The Prober reads each backend at most once per its own wait (5 s by default), however
    short this interval: two reads are two waits to the verdict logic."""
    while True:
        for result in await prober.probe():
            for t in result.transitions:
                if t.from_state is not t.to_state:
                    print(f"probe: shard {result.key} {t.from_state} -> {t.to_state}: {t.reason}")
        if stall.stalled(time.monotonic(), stall_timeout=60.0):
            print("stall watch: work pending and nothing finished for 60 s")
        await asyncio.sleep(interval)


async def rebuild(client: httpx.AsyncClient, fleet: FleetHealth) -> None:
    """Restart every DEAD shard; a replacement holds stale weights until the next refit."""
    for shard in fleet.absent_shards():
        if fleet.state_of(shard) is not State.DEAD:
            continue
        print(f"restarting shard {shard} ({fleet.snapshot()[shard].last_error})")
        if fleet.mark_restarting(shard).to_state is not State.RESTARTING:
            # Past the restart budget the ledger retired it: no restart, for good.
            print(f"shard {shard} retired: {fleet.snapshot()[shard].last_error}")
            continue
        try:
            url = f"{fleet.base_url_of(shard)}/sim/restart"
            (await client.post(url, json={"mode": "idle"})).raise_for_status()
        except httpx.HTTPError as exc:
            fleet.mark_restart_failed(shard, error=str(exc) or type(exc).__name__)
            continue
        fleet.mark_loaded(shard)


def sync_weights(fleet: FleetHealth, version: int, *, abort: bool) -> None:
    """Push weights to every shard whose process is alive (serving or STALE)."""
    if abort:
        # The sync broke partway: every serving shard may hold a mix of old and new weights.
        for shard in fleet.serving_shards():
            fleet.mark_weights_partial(shard)
        print(f"weight sync {version} aborted; suspected before it: {fleet.suspected_shards()}")
    for shard in fleet.keys:
        if fleet.state_of(shard) is State.STALE:
            fleet.report_refit(shard, weight_version=version)  # the only way back in
        elif shard in fleet.serving_shards():
            fleet.record_weight_version(shard, weight_version=version)  # a stamp only
    print(f"weight sync {version} done; serving {fleet.serving_shards()}")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--abort-step", type=int, default=2, help="the sync that aborts")
    parser.add_argument("--request-timeout", type=float, default=2.0)
    parser.add_argument("--probe-interval", type=float, default=0.5)
    args = parser.parse_args()

    fleet = FleetHealth(args.urls, policy=FleetPolicy(unhealthy_threshold=2))
    selector = Selector(fleet)
    stall = StallWatch(started_at=time.monotonic())
    timeout = args.request_timeout
    async with (
        Prober(fleet, timeout=timeout, answer_timeout=timeout, stall=stall) as prober,
        httpx.AsyncClient(timeout=timeout) as client,
    ):
        pump = asyncio.create_task(probe_pump(prober, stall, args.probe_interval))
        try:
            for step in range(1, args.steps + 1):
                done = await asyncio.gather(
                    *(rollout(client, fleet, selector) for _ in range(args.batch))
                )
                print(f"step {step}: {sum(done)} of {args.batch} rollouts")
                await rebuild(client, fleet)
                sync_weights(fleet, step, abort=step == args.abort_step)
                fleet.raise_if_exhausted()
        finally:
            pump.cancel()
    for shard, health in fleet.snapshot().items():
        print(f"shard {shard}: {health.state} weight_version={health.weight_version}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
