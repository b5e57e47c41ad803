#!/usr/bin/env python3
"""Health check for the model server on this host: one line, exit 0/1/2/3.

A drop-in for a model host's own health script. A server with work is judged by whether
its engine steps between two reads, and is never sent a request; only an idle one gets a
one-token request. --restart-cmd runs only for a proven wedge, never for a slow server.
"""

import argparse
import shlex
import subprocess
import sys

import llmhealth


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds between two reads")
    parser.add_argument("--timeout", type=float, default=5.0, help="bound on one HTTP read")
    parser.add_argument("--restart-cmd", help="run (split like a shell, never by one) on a wedge")
    args = parser.parse_args()
    try:
        report = llmhealth.check([args.url], wait=args.wait, timeout=args.timeout)
    except (ValueError, TypeError) as exc:  # a bad URL or option: we could not check
        print(f"UNKNOWN - {exc}")
        return 3
    backend = report.backends[0]
    line = f"{report.exit_code.name} - {backend.verdict}: {backend.evidence}"
    if backend.verdict is llmhealth.VerdictKind.WEDGED and args.restart_cmd:
        try:
            done = subprocess.run(shlex.split(args.restart_cmd), timeout=600, check=False)
            line += f"; restart command exited {done.returncode}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            line += f"; restart command failed: {exc}"
    print(line)
    return int(report.exit_code)


if __name__ == "__main__":
    sys.exit(main())
