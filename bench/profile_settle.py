"""cProfile of one `watch` settle (`settle_fleet` on a state file) over N backends.

The verdicts are judged by `classify.decide` from real vLLM captures in `fixtures/`
(half busy, a quarter idle, a quarter wedged, as `bench_scale.py` simulates), so the
record holds what a real one holds: a sighting with baseline counters per backend. The
first settle writes the state file; the ones after it are the steady state a `watch`
cycle pays, each on the same store and with the record it kept, as the daemon settles.

    ../.venv/bin/python profile_settle.py 3000 [settles] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

from llmhealth.actions import AuditLog
from llmhealth.classify import Answer, Outcome, Read, Target, Verdict, decide
from llmhealth.config import Backend, Config
from llmhealth.cycle import Kept, settle_fleet
from llmhealth.metrics import parse_metrics
from llmhealth.remediate import Mode
from llmhealth.state import StateFile

CAPTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"
WINDOWS = {  # the captures each kind's reads are made from, 5 s apart
    "busy": ("busy-0", "busy-1", "busy-2"),
    "idle": ("idle-1", "idle-2", "idle-2"),
    "wedged": ("dead-1", "dead-2", "dead-3"),
}


def verdicts(at: float) -> dict[str, Verdict]:
    """One verdict per kind, judged from its captures as `examine_once` judges reads."""
    judged = {}
    for kind, names in WINDOWS.items():
        reads = [
            Read(at + 5 * i, parse_metrics((CAPTURES / f"{name}.txt").read_bytes()))
            for i, name in enumerate(names)
        ]
        verdict = decide(reads, max_reads=len(reads))
        if not isinstance(verdict, Verdict):  # an idle engine: its tiny request answered
            verdict = decide(reads, Answer(at + 10, True, "answered"), max_reads=len(reads))
        assert isinstance(verdict, Verdict), (kind, verdict)
        judged[kind] = verdict
    return judged


def kind_of(index: int) -> str:
    return "busy" if index % 4 < 2 else ("idle" if index % 4 == 2 else "wedged")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backends", type=int)
    parser.add_argument("settles", type=int, nargs="?", default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    backends = tuple(
        Backend(f"b{i:05d}", f"http://127.0.{i // 250}.{i % 250 + 1}:8000")
        for i in range(args.backends)
    )
    config = Config(backends=backends)
    targets = [Target(b.name, b.url) for b in backends]
    urls = {b.name: b.url for b in backends}
    with tempfile.TemporaryDirectory(prefix="llmhealth-settle-") as tmp:
        store = StateFile(Path(tmp) / "state.json")
        audit = AuditLog(Path(tmp) / "audit.jsonl")
        kept = Kept()  # the daemon's: what its last settle saved
        for settle in range(args.settles + 1):
            judged = verdicts(time.time())
            outcomes = [Outcome(t, judged[kind_of(i)]) for i, t in enumerate(targets)]
            profile = cProfile.Profile() if settle == args.settles else None
            wall, cpu = time.perf_counter(), time.process_time()
            if profile is not None:
                profile.enable()
            settle_fleet(
                store, config, urls, lambda _r, o=outcomes: o, mode=Mode.ACT, audit=audit, kept=kept
            )
            if profile is not None:
                profile.disable()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            size = (Path(tmp) / "state.json").stat().st_size
            which = "first" if settle == 0 else ("profiled" if profile else "later")
            print(
                f"settle {settle} ({which}): wall {wall:.3f} s, CPU {cpu:.3f} s, "
                f"state {size / 1e6:.1f} MB",
                flush=True,
            )
            if profile is not None:
                for order in ("cumulative", "tottime"):
                    out = io.StringIO()
                    pstats.Stats(profile, stream=out).sort_stats(order).print_stats(args.top)
                    print(out.getvalue(), file=sys.stdout)


if __name__ == "__main__":
    main()
