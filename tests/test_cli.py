"""The command line: exit codes, the three formats, config errors, the installed entry point."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import typer
from pytest_httpserver import HTTPServer
from typer.core import TyperGroup
from typer.testing import CliRunner
from werkzeug import Request, Response

from llmhealth.classify import Decision, Read, decide
from llmhealth.cli import app, main
from tests.test_classify import deferred

CAPTURES = Path(__file__).parent.parent / "fixtures" / "vllm-0.32"
MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
COMPLETION = {"choices": [{"index": 0, "text": "!"}]}
runner = CliRunner()


def serve_idle(server: HTTPServer) -> str:
    server.expect_request("/metrics").respond_with_data((CAPTURES / "idle-1.txt").read_text())
    server.expect_request("/v1/models").respond_with_json(MODELS)
    server.expect_request("/v1/completions", method="POST").respond_with_json(COMPLETION)
    return server.url_for("").rstrip("/")


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_healthy_idle_backend_exits_0_with_a_table(httpserver: HTTPServer) -> None:
    url = serve_idle(httpserver)
    result = runner.invoke(app, ["check", url, "--wait", "0.1"])
    assert result.exit_code == 0, result.output
    assert "idle" in result.output
    assert "answered" in result.output


def test_an_engine_holding_only_a_deferred_request_is_asked_and_idle_not_wedged(
    httpserver: HTTPServer,
) -> None:
    # One request waits, deferred by vLLM (its grammar compiling), and no counter moves:
    # the whole check, over real HTTP, asks the tiny request and does not condemn.
    text = deferred((CAPTURES / "prefill2-after.txt").read_text(), waiting=1, deferred=1)
    httpserver.expect_request("/metrics").respond_with_data(text)
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    httpserver.expect_request("/v1/completions", method="POST").respond_with_json(COMPLETION)
    url = httpserver.url_for("").rstrip("/")
    result = runner.invoke(app, ["check", url, "--wait", "0.1", "--format", "json"])
    assert result.exit_code == 0, result.output
    (backend,) = json.loads(result.output)["backends"]
    assert (backend["verdict"], backend["state"], backend["requests_sent"]) == (
        "idle",
        "healthy",
        1,
    )


def test_json_has_the_documented_fields(httpserver: HTTPServer) -> None:
    url = serve_idle(httpserver)
    down = closed_port_url()
    result = runner.invoke(app, ["check", url, down, "--format", "json"])
    assert result.exit_code == 2, result.output
    document = json.loads(result.output)
    assert document["exit_code"] == 2
    assert isinstance(document["checked_at"], float)
    idle, dead = document["backends"]
    assert set(idle) >= {
        "name",
        "url",
        "kind",
        "verdict",
        "healthy",
        "running",
        "waiting",
        "steps_per_s",
        "tokens_per_s",
        "requests_sent",
        "evidence",
    }
    assert (idle["verdict"], idle["healthy"], idle["requests_sent"]) == ("idle", True, 1)
    assert (idle["running"], idle["waiting"], idle["kind"]) == (0, 0, "backend")
    assert (dead["verdict"], dead["healthy"], dead["requests_sent"]) == ("down", False, 0)
    assert dead["evidence"] == "down: connection refused"


def test_nagios_prints_one_status_line_with_perfdata(httpserver: HTTPServer) -> None:
    url = serve_idle(httpserver)
    result = runner.invoke(app, ["check", url, "--format", "nagios"])
    assert result.exit_code == 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1
    status, perfdata = lines[0].split(" | ")
    assert status.startswith("LLMHEALTH OK - 1 idle (")
    name = url.removeprefix("http://")
    assert f"'{name} healthy'=1" in perfdata
    assert f"'{name} running'=0" in perfdata


def test_a_proxy_down_is_critical() -> None:
    result = runner.invoke(app, ["check", "--proxy", closed_port_url(), "--format", "nagios"])
    assert result.exit_code == 2
    assert result.output.startswith("LLMHEALTH CRITICAL - 1 down")


def test_a_config_file_names_backends_and_proxies(httpserver: HTTPServer, tmp_path: Path) -> None:
    url = serve_idle(httpserver)
    httpserver.expect_request("/lb/v1/models").respond_with_json(MODELS)  # another server
    config = tmp_path / "fleet.toml"
    # A state of its own: without one, run as root, it wrote the machine's own
    # /var/lib/llmhealth/state.json (and audit log) at every run of the suite.
    config.write_text(
        f'wait = "1s"\nstate = "{tmp_path / "state.json"}"\n[[backend]]\nname = "gpu0"\n'
        f'url = "{url}"\n[[proxy]]\nname = "lb"\nurl = "{url}/lb"\n'
    )
    result = runner.invoke(app, ["check", "--config", str(config), "--format", "json"])
    assert result.exit_code == 0, result.output
    names = [(b["name"], b["kind"], b["verdict"]) for b in json.loads(result.output)["backends"]]
    assert names == [("gpu0", "backend", "idle"), ("lb", "proxy", "up")]


def run(
    entry_point: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [entry_point, *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )


def test_the_installed_command_checks_a_real_server(
    entry_point: str, httpserver: HTTPServer
) -> None:
    url = serve_idle(httpserver)
    result = run(entry_point, "check", url, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["backends"][0]["verdict"] == "idle"


def test_a_backend_a_config_edit_forgets_is_written_in_the_audit_trail(
    httpserver: HTTPServer, tmp_path: Path
) -> None:
    """A check with a smaller config forgets a RETIRED backend and its restart budget;
    without a line in the trail nothing would say where the retirement went."""
    url = serve_idle(httpserver)
    state = tmp_path / "state.json"
    full, subset = tmp_path / "full.toml", tmp_path / "subset.toml"
    full.write_text(
        f'[[backend]]\nname = "a"\nurl = "{url}"\n'
        f'[[backend]]\nname = "b"\nurl = "{closed_port_url()}"\n'
    )
    subset.write_text(f'[[backend]]\nname = "a"\nurl = "{url}"\n')
    check = ["check", "--state", str(state), "--wait", "0.1", "--format", "json"]
    assert runner.invoke(app, [*check, "--config", str(full)]).exit_code in (0, 1, 2)
    retired = runner.invoke(app, ["retire", "b", "--reason", "bad GPU", "--state", str(state)])
    assert retired.exit_code == 0, retired.output
    assert runner.invoke(app, [*check, "--config", str(subset)]).exit_code == 0
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    forgotten = [json.loads(line) for line in lines if '"forgotten"' in line]
    assert [(r["backend"], r["from"], r["to"]) for r in forgotten] == [("b", "retired", None)]
    assert forgotten[0]["reason"] == "b: no longer configured; forgotten (retired)"
    # Added back, it is still retired: only a reset undoes an operator's retirement.
    assert runner.invoke(app, [*check, "--config", str(full)]).exit_code in (0, 1, 2)
    shown = runner.invoke(app, ["status", "--state", str(state), "--format", "json"])
    states = {b["name"]: b["state"] for b in json.loads(shown.output)["backends"]}
    assert states == {"a": "healthy", "b": "retired"}


def test_check_sends_a_retired_backend_no_tiny_request_until_a_reset(
    httpserver: HTTPServer, tmp_path: Path
) -> None:
    """An operator who retired a server may have taken it for something else: check
    still reads it, and leaves its request slots alone until a reset asks for proof."""
    url = serve_idle(httpserver)
    state = str(tmp_path / "state.json")
    check = ["check", url, "--state", state, "--wait", "0.1", "--format", "json"]

    def completions() -> int:
        return sum(request.path == "/v1/completions" for request, _ in httpserver.log)

    assert runner.invoke(app, check).exit_code == 0
    assert completions() == 1
    name = url.removeprefix("http://")
    assert runner.invoke(app, ["retire", name, "--reason", "lent", "--state", state]).exit_code == 0
    retired = runner.invoke(app, check)
    backend = json.loads(retired.output)["backends"][0]
    assert (backend["verdict"], backend["state"]) == ("idle", "retired")
    assert "no request sent: it is retired" in backend["evidence"]
    assert completions() == 1
    assert runner.invoke(app, ["reset", name, "--state", state]).exit_code == 0
    readmitted = json.loads(runner.invoke(app, check).output)["backends"][0]
    assert readmitted["state"] == "healthy" and completions() == 2


@pytest.mark.parametrize(
    "models",
    [Response("no", status=401), Response('{"data": []}', content_type="application/json")],
    ids=["key refused", "no model listed"],
)
def test_a_tiny_request_never_sent_is_not_counted_as_sent(
    httpserver: HTTPServer, models: Response
) -> None:
    """`requests_sent` is the tiny requests sent (README, BackendResult): a backend whose
    model list turned the key away, or listed nothing, showed 1 beside the evidence
    "tiny request not sent", and no POST had gone out."""
    httpserver.expect_request("/metrics").respond_with_data((CAPTURES / "idle-1.txt").read_text())
    httpserver.expect_request("/v1/models").respond_with_response(models)
    url = httpserver.url_for("").rstrip("/")
    result = runner.invoke(app, ["check", url, "--wait", "0.1", "-f", "json"])
    (backend,) = json.loads(result.output)["backends"]
    assert "tiny request not sent" in backend["evidence"], backend["evidence"]
    assert not [request for request, _ in httpserver.log if request.method == "POST"]
    assert backend["requests_sent"] == 0, backend


def test_a_tiny_request_whose_connection_was_refused_is_not_counted_as_sent() -> None:
    """The POST goes on a fresh connection: a backend that stopped listening right after
    its model list (a restart, a crash) never got it, and `requests_sent` said 1."""
    metrics = (CAPTURES / "idle-1.txt").read_bytes()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)  # ends the thread should the check never come
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    posts: list[bytes] = []

    def serve() -> None:
        with listener, contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        head += conn.recv(65536)
                    if head.startswith(b"POST"):
                        posts.append(head)
                    models = head.startswith(b"GET /v1/models")
                    if models:
                        # Closed before the answer goes out, so the POST that follows it
                        # is refused; closed after, it could still land in the backlog.
                        listener.close()
                    body = json.dumps(MODELS).encode() if models else metrics
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nConnection: close\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                    )
                if models:
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    result = runner.invoke(app, ["check", url, "--wait", "0.1", "-f", "json"])
    thread.join(5)
    (backend,) = json.loads(result.output)["backends"]
    assert not posts
    assert "tiny request failed" in backend["evidence"], backend["evidence"]
    assert backend["requests_sent"] == 0, backend


@pytest.mark.slow
def test_a_check_without_a_backends_key_variable_exits_3_asking_nothing(
    entry_point: str, httpserver: HTTPServer, tmp_path: Path
) -> None:
    """Without its key every request is a 401, which the ledger read as the backend's
    failure: a cron job missing the variable condemned a healthy backend, CRITICAL."""
    url = serve_idle(httpserver)
    config = tmp_path / "fleet.toml"
    config.write_text(f'[[backend]]\nname = "a"\nurl = "{url}"\napi_key_env = "A_KEY"\n')
    without = {name: value for name, value in os.environ.items() if name != "A_KEY"}
    # As a unit's ExecReload runs it: the reload it guards would be refused.
    checked = run(entry_point, "config", "check", str(config), env=without)
    assert checked.returncode == 3
    assert "'a': its api_key_env names A_KEY, which is not set (or empty) here" in (checked.stderr)
    state = str(tmp_path / "state.json")
    refused = run(entry_point, "check", "-c", str(config), "--state", state, env=without)
    assert refused.returncode == 3
    assert "its api_key_env names A_KEY, which is not set" in refused.stderr
    assert httpserver.log == [] and not Path(state).exists()
    keyed = {**without, "A_KEY": "s3cret"}
    assert run(entry_point, "check", "-c", str(config), "--state", state, env=keyed).returncode == 0
    assert run(entry_point, "config", "check", str(config), env=keyed).returncode == 0


def test_no_arguments_print_the_help_and_exit_3_with_a_reason(entry_point: str) -> None:
    """An empty argument variable in a script: UNKNOWN with a reason, not a traceback and
    an exit 1 that a plugin runner reads as WARNING."""
    result = run(entry_point)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "llmhealth: no command given" in result.stderr
    assert "Usage: llmhealth" in result.stdout


def test_a_terminal_that_cannot_print_an_arrow_still_gets_the_verdicts_exit_code(
    entry_point: str, tmp_path: Path
) -> None:
    """The table says "→" and the verbs do; on a latin-1 stdout printing raised after the
    state was saved, and the exit code said UNKNOWN where the fleet was CRITICAL."""
    state = str(tmp_path / "state.json")
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    done = run(
        entry_point, "check", "http://127.0.0.1:9", "--state", state, "--timeout", "1", env=env
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    retired = run(
        entry_point, "retire", "127.0.0.1:9", "--reason", "bad GPU", "--state", state, env=env
    )
    assert retired.returncode == 0, retired.stderr
    assert "\\u2192" in retired.stdout


def test_a_bare_url_of_a_configured_backend_is_refused_not_a_crash(
    entry_point: str, tmp_path: Path
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n')
    result = run(entry_point, "check", "--config", str(config), "http://127.0.0.1:9/")
    assert result.returncode == 3
    assert "the same URL is given twice: http://127.0.0.1:9" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("configured", "given", "named"),
    [
        ("backend", ["--proxy", "http://127.0.0.1:9/"], "--proxy"),
        # A bare URL at a configured proxy's address was told "Invalid value for --proxy".
        ("proxy", ["HTTP://127.0.0.1:9/"], "URL"),
    ],
)
def test_a_proxy_at_a_backends_url_is_refused(
    entry_point: str, tmp_path: Path, configured: str, given: list[str], named: str
) -> None:
    # The proxy's pool was read as one backend: each read's /metrics from whichever server
    # it chose, and the backend's restart command run on that evidence.
    config = tmp_path / "fleet.toml"
    config.write_text(f'[[{configured}]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n')
    result = run(entry_point, "check", "--config", str(config), *given)
    assert result.returncode == 3
    assert "http://127.0.0.1:9 is given as a backend and as a proxy" in result.stderr
    assert f"Invalid value for {named}:" in result.stderr


def test_one_bare_url_given_as_a_backend_and_as_a_proxy_is_refused_as_such(
    entry_point: str,
) -> None:
    # Both named by their URL, they were told only "the same backend or proxy is named twice".
    result = run(entry_point, "check", "http://127.0.0.1:9", "--proxy", "http://127.0.0.1:9/")
    assert result.returncode == 3
    assert "http://127.0.0.1:9 is given as a backend and as a proxy" in result.stderr
    assert "Invalid value for --proxy:" in result.stderr


def test_a_state_path_that_is_the_configured_audit_log_is_refused(
    entry_point: str, tmp_path: Path
) -> None:
    """Each save renames the state over the file: the audit records would vanish."""
    audit = tmp_path / "audit.jsonl"
    config = tmp_path / "fleet.toml"
    config.write_text(f'audit_log = "{audit}"\n[[backend]]\nurl = "http://127.0.0.1:9"\n')
    result = run(entry_point, "check", "--config", str(config), "--state", str(audit))
    assert result.returncode == 3
    assert "is the state file or its lock" in result.stderr
    assert not audit.exists()


def test_an_audit_log_that_is_the_state_file_through_a_linked_directory_is_refused(
    entry_point: str, tmp_path: Path
) -> None:
    """One path through a link to the state's directory, the other not: one file, and
    each save renamed the state over the records appended to it."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'state = "{tmp_path / "link" / "state.json"}"\n'
        f'audit_log = "{tmp_path / "real" / "state.json"}"\n'
        '[[backend]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    )
    held = run(entry_point, "hold", "a", "--for", "1h", "--reason", "x", "--config", str(config))
    assert held.returncode == 3
    assert "is the state file or its lock" in held.stderr
    assert not (tmp_path / "real" / "state.json").exists()


@pytest.mark.slow
def test_bad_arguments_exit_3_not_2(entry_point: str) -> None:
    result = run(entry_point, "check", "not-a-url")
    assert result.returncode == 3
    assert "not an http(s) URL" in result.stderr
    assert run(entry_point, "check").returncode == 3
    assert run(entry_point, "check", "--format", "xml", "http://127.0.0.1:9").returncode == 3


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["check", "http://127.0.0.1:9", "--state", ""], "an empty state path"),
        (["status", "--state", " "], "an empty state path"),
        (["check", "--config", ""], "an empty config path"),
        # Paths naming no file were an internal error with a traceback, past the config.
        (["check", "http://127.0.0.1:9", "--state", "/"], "'/' names a directory"),
        (["status", "--state", ".", "-f", "json"], "'.' names a directory"),
        (["hold", "gpu0", "--for", "1m", "--reason", "x", "--state", "./"], "names a directory"),
        (["audit", "--state", "/"], "'/' names a directory"),
        # A unit's `--serving-file "$UNSET"`: the daemon ran, and fed its balancer nothing.
        (
            ["watch", "http://127.0.0.1:9", "--listen", "off", "--serving-file", ""],
            "an empty serving file path",
        ),
        # A unit's `route --listen "$UNSET"`: it served on the default address instead.
        (["route", "http://127.0.0.1:9", "--listen", ""], "'' is not HOST:PORT"),
        # A host with a space was the server's `down`: CRITICAL (2) for a typo.
        (["check", "http://127.0.0.1 :9", "-f", "nagios"], "white space in its host"),
    ],
)
def test_an_empty_path_exits_3_and_touches_no_default_state(
    entry_point: str, tmp_path: Path, args: list[str], said: str
) -> None:
    # `--state "$UNSET"` was taken for no --state: the default state was locked and
    # rewritten (with --config), or a file named " " made in the working directory.
    environment = {**os.environ, "STATE_DIRECTORY": str(tmp_path)}
    result = subprocess.run(
        [entry_point, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=environment,
        cwd=tmp_path,
    )
    assert result.returncode == 3
    assert said in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_config_key_exits_3_naming_file_and_key(
    entry_point: str, tmp_path: Path
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text('[policy]\nunhealthy_treshold = 3\n[[backend]]\nurl = "http://127.0.0.1:9"\n')
    result = run(entry_point, "check", "--config", str(config))
    assert result.returncode == 3
    assert f"{config}: policy.unhealthy_treshold: unknown key" in result.stderr


def test_an_error_quoting_a_terminal_control_prints_it_escaped(
    entry_point: str, tmp_path: Path
) -> None:
    # A config key (or an etcd answer, a state file's text) quoted in an error message.
    config = tmp_path / "fleet.toml"
    config.write_text('"col\\u001b[2Jour" = 1\n')
    result = run(entry_point, "check", "--config", str(config))
    assert result.returncode == 3
    assert "col\\x1b[2Jour: unknown key" in result.stderr and "\x1b" not in result.stderr


def test_a_missing_config_file_exits_3(entry_point: str, tmp_path: Path) -> None:
    result = run(entry_point, "check", "--config", str(tmp_path / "absent.toml"))
    assert result.returncode == 3
    assert "cannot read" in result.stderr


def test_the_installed_command_exits_2_when_a_backend_is_down(entry_point: str) -> None:
    result = run(entry_point, "check", closed_port_url(), "--format", "nagios")
    assert result.returncode == 2, result.stderr
    assert result.stdout.startswith("LLMHEALTH CRITICAL - 1 down/suspect")


@pytest.mark.slow
def test_a_check_that_cannot_run_still_gives_a_nagios_line_on_stdout(
    entry_point: str, tmp_path: Path
) -> None:
    # A plugin runner reads stdout only: an empty one shows as "no output returned from
    # plugin", hiding the bad key or the missing state the message names.
    bad = tmp_path / "bad.toml"
    bad.write_text('"\\u001b[2Jbogus" = 1\n')  # a key that would clear the screen
    piped = tmp_path / "piped.toml"  # the refusal names the '|' it refuses
    piped.write_text('[[backend]]\nname = "a|b"\nurl = "http://127.0.0.1:9"\n')
    missing = str(tmp_path / "none" / "state.json")
    for args, said in (
        (["check", "--config", str(bad), "--format", "nagios"], "bogus: unknown key"),
        (["check", "--config", str(piped), "-f", "nagios"], "must be printable and"),
        (["status", "--state", missing, "-f", "nagios"], "no state at"),
        (["check", "--format=nagios", "--wait", "soon", "http://127.0.0.1:9"], "soon"),
        (["check", "-f", "nagios", "--timeout", "5000", "http://127.0.0.1:9"], "longer than 1 h"),
        (["check", "-f", "nagios", "--wait", "1e-310", "http://127.0.0.1:9"], "a millisecond"),
    ):
        result = run(entry_point, *args)
        assert result.returncode == 3, result.stderr
        assert result.stdout.startswith("LLMHEALTH UNKNOWN - "), (args, result.stdout)
        assert said in result.stdout and result.stdout.count("\n") == 1
        assert said in result.stderr
        assert "\x1b" not in result.stdout and "|" not in result.stdout
    table = run(entry_point, "status", "--state", missing)
    assert table.returncode == 3 and table.stdout == ""


@pytest.mark.slow
def test_a_check_that_cannot_run_still_gives_a_json_document_on_stdout(
    entry_point: str, tmp_path: Path
) -> None:
    # A script piping `--format json` to a parser got an empty stdout, and no exit_code.
    bad = tmp_path / "bad.toml"
    bad.write_text('"\u001b[2Jbogus" = 1\n')
    for args in (
        ["check", "--config", str(bad), "--format", "json"],
        ["check", "-fjson", "--wait", "soon", "http://127.0.0.1:9"],
        ["status", "--state", str(tmp_path / "none" / "state.json"), "--format=json"],
    ):
        result = run(entry_point, *args)
        assert result.returncode == 3, result.stderr
        document = json.loads(result.stdout)
        assert document["exit_code"] == 3 and document["error"], (args, result.stdout)
        assert "\x1b" not in result.stdout  # JSON escapes it, as every text it holds


def test_config_check_accepts_a_good_file_and_names_the_key_of_a_bad_one(
    entry_point: str, tmp_path: Path
) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n'
        'restart = ["systemctl", "restart", "vllm@0"]\n'
    )
    result = run(entry_point, "config", "check", str(good))
    assert result.returncode == 0, result.stderr
    assert "1 backends (1 with a restart command), 0 proxies" in result.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('[[backend]]\nurl = "http://127.0.0.1:9"\nrestart = "systemctl restart x"\n')
    result = run(entry_point, "config", "check", str(bad))
    assert result.returncode == 3
    assert f"{bad}: backend[0].restart: must be a list of strings" in result.stderr
    empty = tmp_path / "empty.toml"
    empty.write_text('wait = "5s"\n')  # usable with URLs on a command line, else refused
    result = run(entry_point, "config", "check", str(empty))
    assert result.returncode == 0
    assert f"{empty}: note: no [[backend]] or [[proxy]]" in result.stderr


def test_config_check_notes_a_command_whose_program_is_not_found_here(
    entry_point: str, tmp_path: Path
) -> None:
    """A restart program misspelt passed `config check`; under `watch` every restart was
    then "not run", its budget spent until the backend was retired. Noted (the file may be
    checked on another host), without the command line, which may carry a token; the
    operator's file name is shown escaped."""
    config = tmp_path / "fleet\x1b[2J.toml"
    config.write_text(
        'on_serving_change = ["llmhealth-no-such-hook"]\n'
        '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:9"\n'
        'restart = ["/nonexistent/restart-vllm", "--token=s3cret"]\n'
        f'[[backend]]\nname = "gpu1"\nurl = "http://127.0.0.1:10"\nrestart = ["{sys.executable}"]\n'
    )
    result = run(entry_point, "config", "check", str(config))
    assert result.returncode == 0, result.stderr
    notes = result.stderr.splitlines()
    shown = str(config).replace("\x1b", "\\x1b")
    assert notes == [
        f"{shown}: note: backend gpu0: restart: its program is not an executable found here"
        " (an absolute path, or a name on this PATH)",
        f"{shown}: note: on_serving_change: its program is not an executable found here"
        " (an absolute path, or a name on this PATH)",
    ], result.stderr
    assert "\x1b" not in result.stdout + result.stderr
    assert "s3cret" not in result.stdout + result.stderr
    assert f"{shown}: ok: 2 backends (2 with a restart command)" in result.stdout


def test_config_check_for_reload_refuses_a_file_the_daemons_reload_refuses(
    entry_point: str, tmp_path: Path
) -> None:
    """The units' ExecReload: `watch --config FILE` takes its targets from the file alone,
    and refuses a reload to one naming none ("nothing to watch"). `config check` said ok,
    so `systemctl reload` succeeded and the refusal was only in the journal."""
    empty = tmp_path / "empty.toml"
    empty.write_text('wait = "5s"\n')
    result = run(entry_point, "config", "check", "--for-reload", str(empty))
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"{empty}: no [[backend]] or [[proxy]]: nothing to watch" in result.stderr
    good = tmp_path / "good.toml"
    good.write_text('[[proxy]]\nname = "lb"\nurl = "http://127.0.0.1:9"\n')
    result = run(entry_point, "config", "check", "--for-reload", str(good))
    assert result.returncode == 0, result.stderr


def test_a_check_of_a_healthy_proxy_alone_exits_0(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/v1/models").respond_with_json(MODELS)
    url = httpserver.url_for("").rstrip("/")
    result = runner.invoke(app, ["check", "--proxy", url, "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["backends"][0]["verdict"] == "up"
    assert document["fleet"]["floor_breached"] is False


# --- hostile servers, as the operator sees them ---------------------------------------------


def test_a_backend_that_breaks_the_json_parser_costs_no_other_its_report(
    httpserver: HTTPServer, tmp_path: Path
) -> None:
    healthy = serve_idle(httpserver)
    hostile = HTTPServer(host="127.0.0.1")
    hostile.start()
    try:
        hostile.expect_request("/metrics").respond_with_data("", status=404)
        hostile.expect_request("/v1/models").respond_with_data("[" * 200_000)
        state = tmp_path / "state.json"
        urls = [healthy, hostile.url_for("").rstrip("/")]
        options = ["--state", str(state), "--format", "json", "--wait", "0.1"]
        result = runner.invoke(app, ["check", *urls, *options])
    finally:
        hostile.clear()
        hostile.stop()
    assert result.exit_code == 2, result.output
    verdicts = [(b["verdict"], b["healthy"]) for b in json.loads(result.output)["backends"]]
    assert verdicts == [("idle", True), ("no_metrics", False)]
    assert state.exists(), "the run saved its state"


ESCAPES = ("\x1b", "\x9b", "\x07", "\\u001b", "\\u009b", "\\u0007")


def test_control_characters_a_server_sends_reach_no_output(
    httpserver: HTTPServer, tmp_path: Path
) -> None:
    """Table, JSON, Nagios line, state file and audit log: none carries a raw escape."""
    text = (CAPTURES / "idle-1.txt").read_text()
    httpserver.expect_request("/metrics").respond_with_data(
        text.replace('engine="0"', 'engine="0\x1b[2J\x9b"')
    )
    httpserver.expect_request("/v1/models").respond_with_json(
        {"data": [{"id": "tiny\x1b]0;owned\x07"}]}
    )
    httpserver.expect_request("/v1/completions").respond_with_data("no", status=500)
    url = httpserver.url_for("").rstrip("/")
    state = tmp_path / "state.json"
    outputs = {}
    for output in ("table", "json", "nagios"):
        result = runner.invoke(app, ["check", url, "--state", str(state), "--format", output])
        assert result.exit_code == 2, result.output
        outputs[output] = result.output
    outputs["state"] = state.read_text()
    outputs["audit"] = (tmp_path / "audit.jsonl").read_text()
    for where, shown in outputs.items():
        assert not [escape for escape in ESCAPES if escape in shown], (where, shown)
    assert "tiny\\x1b]0;owned\\x07" in outputs["table"]  # escaped, not dropped
    assert "tiny\\\\x1b]0;owned\\\\x07" in outputs["audit"]


SECRET_URL = "http://alice:s3cret@127.0.0.1:9"


def test_a_url_with_a_password_is_refused_on_every_path_and_never_echoed(
    entry_point: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "fleet.toml"
    config.write_text(f'[[backend]]\nname = "gpu0"\nurl = "{SECRET_URL}"\n')
    state = str(tmp_path / "state.json")
    attempts = [
        ["check", SECRET_URL, "--state", state],
        ["check", "--proxy", SECRET_URL, "--state", state],
        ["check", "--config", str(config), "--state", state, "--format", "json"],
        ["check", "--config", str(config), "--state", state, "--format", "nagios"],
        ["config", "check", str(config)],
        ["watch", "--config", str(config), "--state", state],
        ["watch", SECRET_URL, "--state", state],
        ["route", "--config", str(config), "--state", state],
        ["route", SECRET_URL, "--state", state],
        ["status", "--config", str(config), "--state", state],
        ["hold", "gpu0", "--for", "1h", "--reason", "r", "--config", str(config), "--state", state],
    ]
    for argv in attempts:  # through main(), the one place errors become exit codes
        monkeypatch.setattr(sys, "argv", ["llmhealth", *argv])
        with pytest.raises(SystemExit) as exited:
            main()
        shown = capsys.readouterr()
        assert exited.value.code == 3, (argv, shown)
        assert "api_key_env" in shown.err, (argv, shown.err)
        assert "s3cret" not in shown.out + shown.err, argv
        assert "alice" not in shown.out + shown.err, argv
    # Once through the installed command, for what really reaches a terminal.
    installed = run(entry_point, *attempts[0])
    assert installed.returncode == 3
    assert "api_key_env" in installed.stderr
    assert "s3cret" not in installed.stdout + installed.stderr
    assert list(tmp_path.iterdir()) == [config], "nothing was written anywhere"


def test_dry_run_and_no_restart_say_that_verdicts_are_still_saved() -> None:
    """What they do (tests/test_remediation.py): restarts decided or not, verdicts saved."""
    command = typer.main.get_command(app)
    assert isinstance(command, TyperGroup)
    check = command.commands["check"]
    helps = {opt: param.help or "" for param in check.params for opt in param.opts}
    assert "issue and run none" in helps["--dry-run"]
    assert "ledger moves they cause, are still saved" in helps["--dry-run"]
    assert "verdicts are still saved" in helps["--no-restart"]


def test_cluster_lines_from_etcd_reach_the_terminal_printable() -> None:
    # Any member can write its name into etcd; an ESC in it must not drive the terminal.
    from llmhealth.cli import _cluster_lines  # noqa: PLC0415

    cluster = {
        "prefix": "/llmhealth/\x1b]0;owned\x07",
        "revision": 7,
        "leader": {"member": "node-a\x1b[2J", "since": 90.0, "lease": 5, "fence": 3},
        "members": {"node-b\x1b[31m": {"at": 95.0}},
    }
    text = _cluster_lines(cluster, now=100.0)
    assert "\x1b" not in text and "\x07" not in text
    assert "node-a\\x1b[2J leads since 10 s ago" in text
    assert "member node-b\\x1b[31m: last report 5 s ago" in text
    assert text.count("\n") == 1  # the two lines stay two lines


def test_audit_prints_the_local_trail_as_json_lines_with_nothing_raw_for_the_terminal(
    tmp_path: Path,
) -> None:
    from llmhealth.actions import AuditLog  # noqa: PLC0415

    state = tmp_path / "state.json"
    log = AuditLog(tmp_path / "audit.jsonl")
    for index in range(3):
        log.append({"time": 1.0 + index, "backend": "gpu", "event": "restart", "n": index})
    log.append({"time": 9.0, "backend": "gpu", "event": "hold", "reason": "a\x1b[31m\x7fb"})
    with (tmp_path / "audit.jsonl").open("ab") as handle:
        handle.write(b"{torn\n")
    result = CliRunner().invoke(app, ["audit", "--state", str(state), "--last", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [json.loads(line).get("n") for line in lines] == [2, None]
    assert json.loads(lines[1])["reason"] == "a\x1b[31m\x7fb"  # kept, but escaped
    assert "\x1b" not in result.stdout and "\x7f" not in result.stdout
    assert "1 malformed audit lines skipped" in result.stderr


def test_audit_names_a_log_path_holding_a_control_character_escaped(tmp_path: Path) -> None:
    # The count of skipped lines named the log raw: a TOML "\u001b" in audit_log, or an
    # ESC in --state, reached the terminal as a control sequence.
    where = tmp_path / "d\x1b[31mX"
    where.mkdir()
    (where / "audit.jsonl").write_bytes(b'{"time": 1, "event": "x"}\n{torn\n')
    result = CliRunner().invoke(app, ["audit", "--state", str(where / "state.json")])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stderr
    assert "1 malformed audit lines skipped in " in result.stderr
    assert "d\\x1b[31mX" in result.stderr


@pytest.mark.slow
def test_audit_of_a_path_with_no_log_says_so_and_with_no_state_either_exits_3(
    entry_point: str, tmp_path: Path
) -> None:
    # An empty trail with exit 0 read as "nothing happened" where a path was mistyped.
    mistyped = run(entry_point, "audit", "--state", str(tmp_path / "stat.json"))
    assert mistyped.returncode == 3 and mistyped.stdout == ""
    assert f"no state at {tmp_path / 'stat.json'} and no audit log at" in mistyped.stderr
    (tmp_path / "a-directory").mkdir()  # an existing path, and no state either
    assert run(entry_point, "audit", "--state", str(tmp_path / "a-directory")).returncode == 3
    state = tmp_path / "state.json"
    assert run(entry_point, "check", "http://127.0.0.1:9", "--state", str(state)).returncode
    (tmp_path / "audit.jsonl").unlink()  # a state kept, its log gone (rotated away)
    quiet = run(entry_point, "audit", "--state", str(state))
    assert quiet.returncode == 0 and quiet.stdout == ""
    assert "no audit log at" in quiet.stderr and "yet" in quiet.stderr


def test_status_names_each_members_share_when_reads_are_sharded() -> None:
    from llmhealth.cli import _cluster_lines  # noqa: PLC0415

    cluster = {
        "prefix": "/llmhealth/prod",
        "revision": 7,
        "leader": {"member": "a", "since": 90.0, "lease": 5, "fence": 3},
        "members": {"a": {"at": 95.0, "share": 6}, "b": {"at": 99.0, "share": 5}, "c": {}},
    }
    lines = _cluster_lines(cluster, now=100.0).splitlines()
    assert lines[1:] == [
        "  member a: last report 5 s ago, reads 6 backends",
        "  member b: last report 1 s ago, reads 5 backends",
        "  member c: last report no report yet",
    ]


def test_a_backend_llmhealth_could_not_examine_is_unknown_and_never_hides_a_down_one(
    httpserver: HTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our own failure is exit 3 (could not check), not a page for a failed server; a
    backend that is down still makes the run CRITICAL beside it."""
    url = serve_idle(httpserver)
    real_decide = decide

    def broken_on_answers(reads: Sequence[Read], *args: Any, **kwargs: Any) -> Decision:
        """Our bug, on the backend that answered; the refused one is judged as always."""
        if any(read.signals is not None for read in reads):
            raise RecursionError("maximum recursion depth exceeded")
        return real_decide(reads, *args, **kwargs)

    monkeypatch.setattr("llmhealth.probe.decide", broken_on_answers)
    alone = runner.invoke(app, ["check", url, "--format", "nagios"])
    assert alone.exit_code == 3, alone.output
    assert alone.output.startswith("LLMHEALTH UNKNOWN - ")
    document = json.loads(runner.invoke(app, ["check", url, "--format", "json"]).output)
    assert "not judged" in document["backends"][0]["evidence"]
    beside = runner.invoke(app, ["check", url, closed_port_url(), "--format", "nagios"])
    assert beside.exit_code == 2, beside.output


def test_a_verb_with_a_cluster_config_needs_no_state_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record is in etcd: a user with no home had the verb refused over a default
    state path it never uses."""
    from llmhealth import cli  # noqa: PLC0415 - the function under test is private

    config = tmp_path / "fleet.toml"
    config.write_text('[cluster]\netcd = ["http://127.0.0.1:2379"]\n')
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("HOME")
    monkeypatch.setattr("pwd.getpwuid", lambda _uid: (_ for _ in ()).throw(KeyError(_uid)))
    loaded, store, _ = cli._operator_context(str(config), None)
    assert loaded.cluster is not None and str(store.path).endswith("/state")


def test_a_bare_url_whose_host_breaks_the_name_rule_is_refused_naming_it(entry_point: str) -> None:
    """Named by host:port, 'x|y:8000' split the Nagios line's perfdata at its '|'."""
    result = run(entry_point, "check", "http://x|y:8000", "--format", "nagios")
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert result.stdout.startswith("LLMHEALTH UNKNOWN - "), result.stdout
    assert "healthy'=" not in result.stdout, result.stdout
    # Refused as no server's host before its name is made (config.check_url).
    assert "'http://x|y:8000': its host holds '|'" in result.stderr, result.stderr


def overflowing_metrics(hits: list[int]) -> Callable[[Request], Response]:
    """Two engines whose generated-token counters jump to 1.5e308 each: their summed rate
    overflows to inf, which a hostile or broken server can cause at will."""

    def respond(_: Request) -> Response:
        generated = 0.0 if not hits else 1.5e308
        hits.append(1)
        lines = ["process_start_time_seconds 1.7e9"]
        for engine in ("0", "1"):
            labels = f'engine="{engine}",model_name="m"'
            lines += [
                f"vllm:num_requests_running{{{labels}}} 1",
                f"vllm:num_requests_waiting{{{labels}}} 0",
                f"vllm:iteration_tokens_total_count{{{labels}}} {len(hits)}",
                f"vllm:generation_tokens_total{{{labels}}} {generated!r}",
            ]
        return Response("\n".join(lines) + "\n", content_type="text/plain")

    return respond


@pytest.mark.slow
def test_a_rate_overflowing_to_infinity_is_null_in_json_and_absent_from_perfdata(
    entry_point: str, httpserver: HTTPServer
) -> None:
    httpserver.expect_request("/metrics").respond_with_handler(overflowing_metrics([]))
    url = httpserver.url_for("").rstrip("/")
    shown = run(entry_point, "check", url, "--wait", "0.2", "--format", "json")

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON: strict parsers reject it")

    (backend,) = json.loads(shown.stdout, parse_constant=refuse)["backends"]
    assert (backend["verdict"], backend["tokens_per_s"]) == ("busy", None), backend
    httpserver.clear()
    httpserver.expect_request("/metrics").respond_with_handler(overflowing_metrics([]))
    line = run(entry_point, "check", url, "--wait", "0.2", "--format", "nagios").stdout
    assert "running'=2" in line and "tokens_per_s" not in line and "inf" not in line, line


def test_the_piped_table_keeps_verdict_and_state_whole_and_shows_model_ids_as_written(
    entry_point: str, httpserver: HTTPServer, tmp_path: Path
) -> None:
    """Not on a terminal the table is 132 wide: 87-character names cut verdict to 'id…'
    and state to 'he…'; and rich read a model id's ':fire:' as an emoji code."""
    httpserver.expect_request("/metrics").respond_with_data((CAPTURES / "idle-1.txt").read_text())
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": "llama:fire:"}]})
    httpserver.expect_request("/v1/completions", method="POST").respond_with_json(COMPLETION)
    long = "gpu-" * 20 + "rack1-"
    config = tmp_path / "long.toml"
    config.write_text(
        f'[[backend]]\nname = "{long}a"\nurl = "{httpserver.url_for("").rstrip("/")}"\n'
        f'[[backend]]\nname = "{long}b"\nurl = "{closed_port_url()}"\n'
    )
    args = ("--config", str(config), "--state", str(tmp_path / "s.json"), "--wait", "0.1")
    result = run(entry_point, "check", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    table = result.stdout.split(f"{long}a: ")[0]
    assert "…" not in table, table
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert any("│ idle " in row and "│ healthy " in row for row in rows), table
    assert any("│ down " in row and "│ suspect " in row for row in rows), table
    assert "by model llama:fire:" in result.stdout and "🔥" not in result.stdout, result.stdout


def test_a_verb_prints_a_stored_hold_reason_escaped(entry_point: str, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[[backend]]\nname = "gpu0"\nurl = "{closed_port_url()}"\n')
    where = ("--config", str(config), "--state", str(tmp_path / "s.json"))
    held = run(entry_point, "hold", "gpu0", "--for", "1h", "--reason", "x\x1b]0;owned\x07", *where)
    released = run(entry_point, "release", "gpu0", *where)
    for result in (held, released):
        assert result.returncode == 0, (result.stdout, result.stderr)
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout, result.stdout
        assert "x\\x1b]0;owned\\x07" in result.stdout, result.stdout


def test_status_without_the_config_judges_the_floor_the_daemon_judged(
    httpserver: HTTPServer, tmp_path: Path
) -> None:
    """`sudo llmhealth status -f nagios` without --config read the service's state (root's
    default path) and judged its floor by the default min_healthy, 1: a fleet its daemon
    called CRITICAL, two serving of three wanted, showed OK."""
    url = serve_idle(httpserver)
    state = tmp_path / "state.json"
    config = tmp_path / "fleet.toml"
    config.write_text(
        f'[policy]\nmin_healthy = 3\n[[backend]]\nname = "a"\nurl = "{url}"\n'
        f'[[backend]]\nname = "b"\nurl = "{url}/b"\n'
    )
    check = ["check", "--config", str(config), "--state", str(state), "--wait", "0.1"]
    assert runner.invoke(app, check).exit_code == 2  # both serve, fewer than three
    for given in (["--config", str(config)], []):
        shown = runner.invoke(app, ["status", "--state", str(state), "-f", "json", *given])
        fleet = json.loads(shown.output)["fleet"]
        assert (shown.exit_code, fleet["min_healthy"], fleet["floor_breached"]) == (2, 3, 1)
    # A verb run without it keeps that floor in the record, as the daemon saved it.
    held = runner.invoke(
        app, ["hold", "a", "--for", "1h", "--reason", "sync", "--state", str(state)]
    )
    assert held.exit_code == 0, held.output
    assert json.loads(state.read_text())["min_healthy"] == 3
    # A config given is what the floor is judged by.
    config.write_text(config.read_text().replace("min_healthy = 3", "min_healthy = 2"))
    given = ["status", "--state", str(state), "-f", "json", "--config", str(config)]
    assert json.loads(runner.invoke(app, given).output)["fleet"]["min_healthy"] == 2


@pytest.mark.parametrize("verb", [("status",), ("hold", "gpu0", "--for", "1h", "--reason", "x")])
def test_a_config_given_as_the_state_is_left_where_it_is(
    entry_point: str, tmp_path: Path, verb: tuple[str, ...]
) -> None:
    """`--state fleet.toml` for `--config fleet.toml`: the config was moved aside as a
    corrupt state, and the next `watch --config fleet.toml` found no config."""
    config = tmp_path / "fleet.toml"
    text = f'[[backend]]\nname = "gpu0"\nurl = "{closed_port_url()}"\n'
    config.write_text(text)
    result = run(entry_point, *verb, "--state", str(config))
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "not a file llmhealth wrote" in result.stderr
    assert config.read_text() == text
    assert not [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]


def run_unread(entry_point: str, *args: str, buffered: bool) -> subprocess.CompletedProcess[str]:
    """``llmhealth ARGS | true``: its stdout a pipe whose reader is gone before it writes.
    ``buffered``: as cron and systemd run it (no PYTHONUNBUFFERED), its output written at
    the end; else every print written at once."""
    env = dict(os.environ)
    if buffered:
        env.pop("PYTHONUNBUFFERED", None)
    else:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [entry_point, *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )
    finally:
        os.close(write_end)


@pytest.mark.slow
@pytest.mark.parametrize("buffered", [True, False])
def test_a_check_whose_reader_is_gone_still_exits_with_its_verdicts_code(
    entry_point: str, buffered: bool
) -> None:
    """`check -f nagios | true` of a down backend exited 1 (click's answer to a broken
    pipe), or 120 (Python's, flushing at exit): WARNING, or no plugin code at all, for a
    CRITICAL fleet, with "Exception ignored ... BrokenPipeError" on stderr."""
    for output in ("nagios", "json", "table"):
        result = run_unread(
            entry_point, "check", closed_port_url(), "-f", output, buffered=buffered
        )
        assert (result.returncode, result.stderr) == (2, ""), (output, result.stderr)


def run_full(entry_point: str, *args: str, full: str) -> subprocess.CompletedProcess[str]:
    """``llmhealth ARGS > /dev/full`` (``full="stdout"``) or ``2> /dev/full``: an output
    on a full disk, written at the end as cron and systemd run it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as device:
        other = subprocess.PIPE
        return subprocess.run(
            [entry_point, *args],
            stdout=device if full == "stdout" else other,
            stderr=device if full == "stderr" else other,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )


@pytest.mark.slow
def test_an_output_on_a_full_disk_changes_no_exit_code(entry_point: str, tmp_path: Path) -> None:
    """`check -f nagios > /dev/full` of a down backend exited 1 (WARNING) with two
    tracebacks, the UNKNOWN line it then tried failing as the verdicts had; a bad config
    with its stderr full exited 1 too; a hold that was saved said "internal error", 3."""
    for output in ("nagios", "json", "table"):
        result = run_full(entry_point, "check", closed_port_url(), "-f", output, full="stdout")
        assert result.returncode == 2, (output, result.stderr)
        # Said on stderr: an empty report.json and exit 0 told nobody anything. The table
        # too, which rich's console dropped as a closed pipe's, with nothing said.
        assert result.stderr == (
            "llmhealth: the output could not be written (No space left on device); "
            "the rest of it was dropped\n"
        ), (output, result.stderr)
    missing = str(tmp_path / "absent.toml")
    for full in ("stdout", "stderr"):
        refused = run_full(entry_point, "check", "--config", missing, "-f", "json", full=full)
        assert refused.returncode == 3, (full, refused.stdout, refused.stderr)
    config = tmp_path / "c.toml"
    config.write_text(f'[[backend]]\nname = "gpu0"\nurl = "{closed_port_url()}"\n')
    where = ("--config", str(config), "--state", str(tmp_path / "s.json"))
    held = run_full(
        entry_point, "hold", "gpu0", "--for", "1h", "--reason", "r", *where, full="stdout"
    )
    assert held.returncode == 0, held.stderr
    assert "the output could not be written" in held.stderr, held.stderr


def test_a_daemon_whose_log_is_on_a_full_disk_still_exits_0_on_sigterm(
    entry_point: str, tmp_path: Path
) -> None:
    """`watch 2>>log` on a full disk (or `watch &` in a terminal that hung up) watched on,
    its lines lost; but what they left buffered failed the interpreter's last flush, and
    a SIGTERM's orderly stop exited 120, which a supervisor takes for a failure."""
    state = tmp_path / "s.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    argv = [entry_point, "watch", closed_port_url(), "--state", str(state), "--wait", "0.1"]
    with open("/dev/full", "w") as device:
        process = subprocess.Popen(
            [*argv, "--listen", "off"], stdout=subprocess.DEVNULL, stderr=device, env=env
        )
    try:
        for _ in range(600):
            if state.exists() or process.poll() is not None:
                break
            time.sleep(0.05)
        assert process.poll() is None and state.exists()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("buffered", [True, False])
def test_a_verb_or_status_whose_reader_is_gone_keeps_its_exit_code(
    entry_point: str, tmp_path: Path, buffered: bool
) -> None:
    """A hold that was saved exited 1, which says "refused, nothing changed"; `status`
    of a fleet under its floor exited 1 or 120 instead of 2."""
    config = tmp_path / "c.toml"
    config.write_text(f'[[backend]]\nname = "gpu0"\nurl = "{closed_port_url()}"\n')
    where = ("--config", str(config), "--state", str(tmp_path / "s.json"))
    held = run_unread(
        entry_point, "hold", "gpu0", "--for", "1h", "--reason", "r", *where, buffered=buffered
    )
    assert (held.returncode, held.stderr) == (0, ""), held.stderr
    assert json.loads((tmp_path / "s.json").read_text())["holds"]["gpu0"]["reason"] == "r"
    # The only backend retired: under the floor (min_healthy 1), CRITICAL.
    assert runner.invoke(app, ["retire", "gpu0", "--reason", "gone", *where]).exit_code == 0
    for output in ("nagios", "json", "table"):
        shown = run_unread(entry_point, "status", *where, "-f", output, buffered=buffered)
        assert (shown.returncode, shown.stderr) == (2, ""), (output, shown.stderr)
    missing = run_unread(
        entry_point,
        "status",
        "--state",
        str(tmp_path / "none.json"),
        "-f",
        "json",
        buffered=buffered,
    )
    assert missing.returncode == 3 and "no state at" in missing.stderr, missing.stderr


def test_audit_skips_lines_too_deep_to_parse_and_prints_only_strict_json(tmp_path: Path) -> None:
    """A line nested 100,000 deep (a hand edit, or any writer of a cluster's etcd trail)
    made `audit` a traceback instead of the trail; a number JSON has not (NaN, 1e999) was
    printed back as NaN or Infinity, which strict parsers (jq, JSON.parse) reject."""
    log = tmp_path / "audit.jsonl"
    log.write_text(
        '{"time": 1, "n": 1}\n'
        + "[" * 100_000
        + "]" * 100_000
        + "\n"
        + '{"time": 2, "x": NaN}\n{"time": 3, "x": 1e999}\n{"time": 4, "x": -Infinity}\n'
        + '{"time": 5, "n": 2}\n'
    )
    (tmp_path / "state.json").write_text("{}")
    for last in ([], ["--last", "1"]):
        result = CliRunner().invoke(app, ["audit", "--state", str(tmp_path / "state.json"), *last])
        assert result.exit_code == 0, result.output
        strict = [json.loads(line, parse_constant=_refused) for line in result.stdout.splitlines()]
        assert [record["n"] for record in strict] == ([1, 2] if not last else [2])
        assert "4 malformed audit lines skipped" in result.stderr


def _refused(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def test_the_tiny_request_asks_for_the_model_id_as_the_server_listed_it(
    httpserver: HTTPServer,
) -> None:
    """A served name with a character that is not printable (a no-break space) was sent
    escaped, "llama\\xa03": the server had no such model, and an idle, healthy backend
    was judged unanswered, CRITICAL. Shown, it is still escaped."""
    asked = _idle_serving(httpserver, [LISTED])
    result = runner.invoke(app, ["check", httpserver.url_for("").rstrip("/"), "-f", "json"])
    _asked_as_listed_and_shown_escaped(asked, result)


LISTED = "llama\u00a03"  # a served id with a character that is not printable


def _idle_serving(httpserver: HTTPServer, ids: list[str]) -> list[str]:
    """An idle vLLM serving ``ids`` that completes for LISTED alone; the models asked for."""
    asked: list[str] = []

    def complete(request: Request) -> Response:
        asked.append(json.loads(request.data)["model"])
        if asked[-1] != LISTED:
            return Response('{"error": "model not found"}', status=404)
        return Response(json.dumps(COMPLETION), content_type="application/json")

    httpserver.expect_request("/metrics").respond_with_data((CAPTURES / "idle-1.txt").read_text())
    httpserver.expect_request("/v1/models").respond_with_json({"data": [{"id": i} for i in ids]})
    httpserver.expect_request("/v1/completions", method="POST").respond_with_handler(complete)
    return asked


def _asked_as_listed_and_shown_escaped(asked: list[str], result: Any) -> None:
    assert asked == [LISTED]
    backend = json.loads(result.output)["backends"][0]
    assert (result.exit_code, backend["verdict"]) == (0, "idle"), backend["evidence"]
    assert "by model llama\\xa03" in backend["evidence"]


def test_audit_skips_a_line_it_can_read_but_not_print_again(tmp_path: Path) -> None:
    """Records are printed as they are read, from one frame deeper than the one that
    parsed them: a line nested just under the parser's limit was read, and printing it
    back raised RecursionError, a traceback ("internal error", exit 3) in place of the
    rest of the trail."""
    log = tmp_path / "audit.jsonl"
    deep = "".join(
        '{"time": 2, "x": ' + "[" * depth + "]" * depth + "}\n" for depth in range(500, 1000)
    )
    log.write_text('{"time": 1, "n": 1}\n' + deep + '{"time": 3, "n": 2}\n')
    (tmp_path / "state.json").write_text("{}")
    result = CliRunner().invoke(app, ["audit", "--state", str(tmp_path / "state.json")])
    assert result.exit_code == 0, result.exception
    shown = [json.loads(line) for line in result.stdout.splitlines()]
    assert shown[0]["n"] == 1 and shown[-1]["n"] == 2
    skipped = 500 - (len(shown) - 2)
    assert f"{skipped} malformed audit lines skipped" in result.stderr


def test_the_tiny_request_asks_for_the_served_id_of_an_expected_model_given_as_shown(
    httpserver: HTTPServer, tmp_path: Path
) -> None:
    """expected_model must be printable, so a served `llama` + no-break space + `3` can
    be named only as llmhealth shows it, `llama\\xa03`: the tiny request asked for that
    text, which the server does not serve, and an idle, healthy backend was unanswered."""
    asked = _idle_serving(httpserver, ["other", LISTED])
    config = tmp_path / "c.toml"
    url = httpserver.url_for("").rstrip("/")
    config.write_text(
        f'[[backend]]\nname = "gpu0"\nurl = "{url}"\nexpected_model = \'llama\\xa03\'\n'
    )
    result = runner.invoke(
        app, ["check", "--config", str(config), "--state", str(tmp_path / "s.json"), "-f", "json"]
    )
    _asked_as_listed_and_shown_escaped(asked, result)


def test_config_check_and_audit_keep_their_exit_code_when_stderr_is_unread(
    entry_point: str, tmp_path: Path
) -> None:
    """`config check FILE 2>&1 | head -0`, `audit ... 2>&1 | tail` with the reader gone:
    their notes on stderr were outside what a reader leaving may end, and a valid config
    exited 1, as a refused one would not even (3), and an audit that printed its trail 1."""
    empty = tmp_path / "empty.toml"
    empty.write_text('wait = "5s"\n')  # valid: targets may come on the command line
    (tmp_path / "s.json").write_text("{}")
    (tmp_path / "audit.jsonl").write_text('{"time": 1}\ntorn\n')
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        audit = ["audit", "--state", str(tmp_path / "s.json")]
        for args in (["config", "check", str(empty)], audit):
            done = subprocess.run(
                [entry_point, *args],
                stdout=subprocess.DEVNULL,
                stderr=write_end,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, args
    finally:
        os.close(write_end)


def test_audit_of_more_records_than_any_trail_holds_prints_them_all(tmp_path: Path) -> None:
    # `--last 99999999999999999999` ended in "internal error" (deque's maxlen overflowed).
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "audit.jsonl").write_text('{"time": 1, "event": "hold"}\n')
    result = runner.invoke(
        app, ["audit", "--last", "9" * 30, "--state", str(tmp_path / "state.json")]
    )
    assert result.exit_code == 0, result.output
    assert '"event": "hold"' in result.stdout


def test_a_state_path_that_is_a_directory_is_refused_before_anything_is_made(
    entry_point: str, tmp_path: Path
) -> None:
    # `--state /var/lib/llmhealth`: exit 3 "cannot read state", leaving a
    # /var/lib/llmhealth.lock beside the directory.
    directory = tmp_path / "llmhealth"
    directory.mkdir()
    result = run(
        entry_point, "hold", "gpu0", "--for", "1h", "--reason", "x", "--state", str(directory)
    )
    assert result.returncode == 3
    assert "is a directory, not a state file" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llmhealth"]


def run_closed(entry_point: str, *args: str, closed: str) -> subprocess.CompletedProcess[str]:
    """``llmhealth ARGS >&-`` (``closed="stdout"``) or ``2>&-``: started with that
    descriptor closed, as a launcher that closes what it does not pass on runs it."""
    redirect = ">&-" if closed == "stdout" else "2>&-"
    return subprocess.run(
        ["sh", "-c", f'exec "$0" "$@" {redirect}', entry_point, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_a_run_started_with_stdout_or_stderr_closed_keeps_its_exit_code(
    entry_point: str, tmp_path: Path
) -> None:
    """Python starts a process whose descriptor 1 or 2 is closed with ``sys.stdout`` (or
    ``sys.stderr``) None: every verb ended in "internal error" tracebacks and exit 1, a
    CRITICAL check read WARNING and a hold that was saved read "refused"."""
    down = closed_port_url()
    quiet = run_closed(entry_point, "check", down, "-f", "nagios", closed="stdout")
    assert (quiet.returncode, quiet.stderr) == (2, ""), quiet.stderr
    mute = run_closed(entry_point, "check", down, "-f", "nagios", closed="stderr")
    assert mute.returncode == 2, mute.stdout
    assert mute.stdout.startswith("LLMHEALTH CRITICAL - 1 down"), mute.stdout
    config = tmp_path / "c.toml"
    config.write_text(f'[[backend]]\nname = "gpu0"\nurl = "{down}"\n')
    where = ("--config", str(config), "--state", str(tmp_path / "s.json"))
    for closed in ("stdout", "stderr"):
        held = run_closed(
            entry_point, "hold", "gpu0", "--for", "1h", "--reason", closed, *where, closed=closed
        )
        assert held.returncode == 0, (closed, held.stdout, held.stderr)
        assert json.loads((tmp_path / "s.json").read_text())["holds"]["gpu0"]["reason"] == closed
    usage = run_closed(entry_point, "check", "--bogus", "-f", "json", closed="stderr")
    assert usage.returncode == 3 and json.loads(usage.stdout)["exit_code"] == 3, usage.stdout


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_daemon_started_with_an_output_closed_watches_on_and_exits_0_on_sigterm(
    entry_point: str, tmp_path: Path, closed: str
) -> None:
    """`watch 2>&-` died at its first log line (exit 1), and `watch >&-` exited 1 on a
    SIGTERM's orderly stop: its last flush of an output Python had set to None."""
    state = tmp_path / "s.json"
    redirect = ">&-" if closed == "stdout" else "2>&-"
    argv = [entry_point, "watch", closed_port_url(), "--state", str(state), "--wait", "0.1"]
    process = subprocess.Popen(
        ["sh", "-c", f'exec "$0" "$@" {redirect}', *argv, "--listen", "off"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    audit = tmp_path / "audit.jsonl"
    try:
        # The backend is down: SUSPECT at the first settle, DEAD at a later one, which
        # only a daemon that lived past the first cycle's log line reaches.
        for _ in range(600):
            if process.poll() is not None or (
                audit.exists() and '"to": "dead"' in audit.read_text()
            ):
                break
            time.sleep(0.05)
        assert process.poll() is None, process.returncode
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_audit_of_a_cluster_prefix_with_no_record_and_no_trail_exits_3(
    entry_point: str, tmp_path: Path
) -> None:
    """As for a file (a mistyped --state), a mistyped [cluster] prefix printed an empty
    trail and exited 0: "nothing happened", where nothing was ever there to read."""
    from tests.etcdproc import running_etcd  # noqa: PLC0415 - only this test needs etcd

    with running_etcd(tmp_path / "etcd") as cluster:
        config = tmp_path / "c.toml"
        endpoints = ", ".join(f'"{endpoint}"' for endpoint in cluster.endpoints)
        config.write_text(
            '[[backend]]\nname = "gpu0"\nurl = "http://127.0.0.1:1"\n'
            f'[cluster]\netcd = [{endpoints}]\nprefix = "/llmhealth/typo"\n'
        )
        empty = run(entry_point, "audit", "--config", str(config))
        assert empty.returncode == 3, (empty.stdout, empty.stderr)
        assert "no state at /llmhealth/typo" in empty.stderr, empty.stderr
        held = CliRunner().invoke(
            app, ["hold", "gpu0", "--for", "1h", "--reason", "r", "--config", str(config)]
        )
        assert held.exit_code == 0, held.output
        shown = CliRunner().invoke(app, ["audit", "--config", str(config)])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.stdout)["event"] == "hold"


def test_a_down_backend_s_evidence_is_its_own_not_an_error_being_handled_around_the_check(
    entry_point: str, httpserver: HTTPServer, tmp_path: Path
) -> None:
    """A `check` with a [cluster] whose etcd answered garbage probed inside the handler of
    etcd's error, and a library caller may check inside its own ``except``: the refused
    connection's error carried that one as its context, and the backend's evidence said
    "cannot connect: no etcd endpoint answered (...)", or the caller's error."""
    from llmhealth.api import check as library_check  # noqa: PLC0415

    httpserver.expect_request("/v3/kv/range").respond_with_data("<html>not etcd</html>")
    httpserver.expect_request("/v3/lease/grant").respond_with_data("<html>not etcd</html>")
    config = tmp_path / "c.toml"
    down = closed_port_url()
    config.write_text(
        f'[[backend]]\nname = "gpu0"\nurl = "{down}"\n'
        f'[cluster]\netcd = ["{httpserver.url_for("").rstrip("/")}"]\n'
    )
    result = run(entry_point, "check", "--config", str(config), "--wait", "0.1", "-f", "json")
    assert result.returncode == 2, (result.stdout, result.stderr)
    (backend,) = json.loads(result.stdout)["backends"]
    assert backend["evidence"] == "down: connection refused", backend["evidence"]
    try:
        raise RuntimeError("the caller's own trouble")
    except RuntimeError:
        report = library_check([down], wait=0.1)
    assert report.to_dict()["backends"][0]["evidence"] == "down: connection refused"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["audit", "--help"], "From etcd with a [cluster] config"),
        (["config", "check", "--help"], "A changed [cluster], state or audit_log"),
        (["route", "--help"], "else the config's [router] listen"),
    ],
)
def test_help_that_names_a_toml_table_shows_its_name(args: list[str], named: str) -> None:
    """Help is read as rich markup, where "[cluster]" is a style tag: it vanished, and
    `audit --help` said "From etcd with a  config"."""
    shown = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    # The panels' borders and the wrapping set aside: the words, in order.
    words = " ".join(shown.output.replace("│", " ").split())
    assert named in words, words


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["check", "--help"], "Default: the config's wait, else 5s."),
        (["check", "--help"], "Default: the config's timeout, else 5s."),
        (["check", "--help"], "Default: the config's answer_timeout, else 10s."),
        (["watch", "--help"], "Default: the config's wait, else 5s."),
        (["demo", "--help"], "watch"),
    ],
)
def test_help_says_what_the_verb_does_by_default(args: list[str], said: str) -> None:
    """`--wait` said "Default 5s" where a config's wait is the default (`check -c` with
    `wait = "1s"` reads every second); `demo` said "check it once", and ran a check,
    `watch`, `route` and a takeover for about 45 s."""
    shown = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    words = " ".join(shown.output.replace("│", " ").split())
    assert said in words, words
