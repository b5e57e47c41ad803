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
from typing import NoReturn

import llmhealth


def main() -> int:
    def unknown(why: object) -> NoReturn:  # bad options too: 3, never argparse's 2 (CRITICAL)
        print(f"UNKNOWN - {why}")
        sys.exit(3)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds between two reads")
    parser.add_argument("--timeout", type=float, default=5.0, help="bound on one HTTP read")
    parser.add_argument("--restart-cmd", type=shlex.split, help="run on a wedge; never by a shell")
    parser.error = unknown  # type: ignore[method-assign]
    args = parser.parse_args()
    try:
        if args.restart_cmd == []:  # found now, not when a wedge needs it
            raise ValueError("argument --restart-cmd: an empty command")
        report = llmhealth.check([args.url], wait=args.wait, timeout=args.timeout)
    except (ValueError, TypeError) as exc:  # a bad URL or option: we could not check
        unknown(exc)
    backend = report.backends[0]
    line = f"{report.exit_code.name} - {backend.evidence}"  # the evidence leads with the verdict
    if backend.verdict is llmhealth.VerdictKind.WEDGED and args.restart_cmd:
        try:  # its output to stderr: a plugin runner takes stdout's first line as the status
            done = subprocess.run(args.restart_cmd, timeout=600, check=False, stdout=sys.stderr)
            line += f"; restart command exited {done.returncode}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            line += f"; restart command failed: {exc}"
    print(line)
    return int(report.exit_code)


if __name__ == "__main__":
    sys.exit(main())
