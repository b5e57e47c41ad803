"""Config files on disk: the documented shape loads; every mistake names file and key."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from llmhealth.config import (
    MAX_CONFIG_BYTES,
    Backend,
    BadTargetError,
    Cluster,
    Config,
    ConfigError,
    Policy,
    Router,
    check_url,
    load,
    name_for_url,
    parse_duration,
    parse_listen,
    targets_for,
    unset_key_variables,
)
from llmhealth.cycle import ledger_policy
from llmhealth.window import WedgeRules

FULL = """
wait = "5s"
timeout = 5
answer_timeout = "10s"
state = "/var/lib/llmhealth/state.json"
audit_log = "/var/lib/llmhealth/audit.jsonl"

[policy]
unhealthy_threshold = 3
healthy_threshold = 2
min_healthy = 1
restart_on = ["wedged", "down"]
max_concurrent_restarts = 1
restart_budget = 5
restart_budget_window = "24h"
cooldown = "1m"
cooldown_max = "30m"
startup_grace = "15m"

[[backend]]
name = "gpu0"
url = "http://10.0.0.5:8000/"
restart = ["systemctl", "restart", "vllm@0"]
api_key_env = "VLLM_API_KEY"
expected_model = "meta-llama/Llama-3.1-8B-Instruct"

[[backend]]
url = "http://10.0.0.6:8000"

[[proxy]]
name = "lb"
url = "http://10.0.0.1:8080"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "llmhealth.toml"
    path.write_text(text)
    return path


def test_the_documented_example_loads(tmp_path: Path) -> None:
    config = load(write(tmp_path, FULL))
    assert config.wait == 5.0
    assert config.answer_timeout == 10.0
    assert config.policy == Policy(
        restart_on=("wedged", "down"),
        restart_budget_window=86400.0,
        cooldown=60.0,
        cooldown_max=1800.0,
        startup_grace=900.0,
    )
    assert config.backends[0] == Backend(
        "gpu0",
        "http://10.0.0.5:8000",
        ("systemctl", "restart", "vllm@0"),
        "VLLM_API_KEY",
        "meta-llama/Llama-3.1-8B-Instruct",
    )
    assert config.backends[1].name == "10.0.0.6:8000"  # a bare entry is named by host:port
    assert config.proxies[0].name == "lb"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("wiat = 5", "wiat: unknown key"),
        ("[policy]\nunhealthy_threshold = 0", "policy.unhealthy_threshold: 0 is below"),
        ("[policy]\nhealthy_threshold = 1.5", "policy.healthy_threshold: 1.5 is not a whole"),
        ("[policy]\ncooldown = 'soon'", "policy.cooldown: 'soon' is not a duration"),
        ("[policy]\nrestart_on = ['busy']", "policy.restart_on: busy cannot condemn"),
        ("[policy]\ncooldown = '10m'\ncooldown_max = '1m'", "cooldown_max is shorter"),
        ("[policy]\nrecover_in_place = 'yes'", "policy.recover_in_place: 'yes' is not true or"),
        ("[policy]\nmax_in_place_recoveries = -1", "policy.max_in_place_recoveries: -1 is below"),
        ("wait = -1", "wait: -1 must be a positive"),
        ("[[backend]]\nname = 'a'", "backend[0].url: is required"),
        ("[[backend]]\nurl = ['http://a:1']", "backend[0].url: must be a string: the base URL"),
        ("[[proxy]]\nurl = 8080", "proxy[0].url: must be a string: the base URL"),
        ("[[backend]]\nurl = 'ftp://x'", "backend[0].url: 'ftp://x' is not an http(s) URL"),
        (
            "[[backend]]\nurl = 'http://a:1'\n[[backend]]\nname = 'b'\nurl = 'HTTP://A:1/'",
            "backend[0] and backend[1] have the same URL 'HTTP://A:1'",
        ),
        (  # the scheme's own port, said or not: one server (was two backends)
            "[[backend]]\nurl = 'http://a'\n[[backend]]\nname = 'b'\nurl = 'http://a:80'",
            "backend[0] and backend[1] have the same URL 'http://a:80'",
        ),
        ('state = "s\\u0000.json"', "state: 's\\x00.json' holds a NUL character"),
        ("[[backend]]\nurl = 'http://a:1/#x'", "a base URL takes no query, parameters or"),
        ("[[backend]]\nname = \"gpu\\u001b[2J\"\nurl = 'http://a:1'", "backend[0].name: 'gpu\\x1b"),
        ("[[backend]]\nname = 'gpu|0'\nurl = 'http://a:1'", "have no '|'"),
        ("[[proxy]]\nname = \"lb\\r\"\nurl = 'http://a:1'", "proxy[0].name: 'lb\\r' must be"),
        ("[[backend]]\nurl = 'http://a:1'\nexpected_model = \"m\\u0007\"", "expected_model:"),
        ("state = 's.json'\naudit_log = './s.json'", "audit_log: the audit log '"),
        ("state = '/s/t.json'\naudit_log = '/s/t.json.lock'", "is the state file or its lock"),
        (
            "[[backend]]\nurl = 'http://a:8000/v1/'",
            "backend[0].url: 'http://a:8000/v1/' ends in /v1: give the server's root",
        ),
        (
            "[[backend]]\nurl = 'http://a:1'\nrestart = 'systemctl restart vllm'",
            "backend[0].restart: must be a list of strings (an argv list, never a shell line)",
        ),
        ("[[backend]]\nurl = 'http://a:1'\nrestart = []", "backend[0].restart: an empty"),
        (
            "[[backend]]\nurl = 'http://a:1'\nrestart = ['systemctl restart vllm@0']",
            "backend[0].restart: its first word is a whole command line: no shell is used",
        ),
        ("[[backend]]\nurl = 'http://a:1'\nrestart = ['', 'x']", "restart: its first word, the"),
        ("on_serving_change = [' ']", "on_serving_change: its first word, the program to run"),
        (
            "[[backend]]\nurl = 'http://a:1'\nrestart = ['./restart.sh', 'gpu0']",
            "backend[0].restart: its program is a relative path",
        ),
        ("[[backend]]\nurl = 'http://a:1'\ncolour = 'red'", "backend[0].colour: unknown key"),
        ("[[proxy]]\nurl = 'http://a:1'\nrestart = ['x']", "proxy[0].restart: unknown key"),
        (
            "[[backend]]\nname='x'\nurl='http://a:1'\n[[proxy]]\nname='x'\nurl='http://b:1'",
            "name used twice: x",
        ),
        ("backend = 3", "backend: must be an array of tables"),
        (
            "[[backend]]\nurl = 'http://a:018100'\n[[backend]]\nname = 'b'\nurl = 'http://a:18100'",
            "backend[0] and backend[1] have the same URL",
        ),
        (  # a proxy's pool read as one backend, its restart command run on that
            "[[backend]]\nurl = 'http://a:1'\n[[proxy]]\nurl = 'HTTP://A:1/'",
            "backend[0] and proxy[0] have the same URL 'HTTP://A:1': a server is either",
        ),
        # Held whole in memory per read or request: a typo's digits made it no bound.
        ("max_body = 16000000000", "max_body: 16000000000 is above the most allowed value"),
        ("[router]\nmax_body = 16000000000", "router.max_body: 16000000000 is above the most"),
        ("[router]\nlisten = 'nowhere'", "router.listen: 'nowhere' is not HOST:PORT"),
        ("[router]\naffinity = 'cookie:x'", "router.affinity: 'cookie:x' is not an affinity"),
        ("[router]\naffinity = 'header:X Session'", "router.affinity: 'header:X Session'"),
        ("[router]\naffinity_slack = 0", "router.affinity_slack: 0 is below"),
        ("[router]\nroutes = ['/metrics']", "router.routes: '/metrics': a route is a path"),
        ("[router]\nroutes = ['v1/x']", "router.routes: 'v1/x': a route is a path"),
        # Matched whole against a request's path: taken, each of these was only 404s.
        ("[router]\nroutes = []", "router.routes: is empty"),
        ("[router]\nroutes = ['/v1/chat/completions?x=1']", "router.routes: '/v1/chat/com"),
        ("[router]\nroutes = ['/v1/*']", "router.routes: '/v1/*': a route is a whole path"),
        ("[router]\nroutes = ['/v1/x#y']", "no query"),
        ("[router]\nroutes = ['/v1/x ']", "white space"),
        ("[router]\nno_backend_status = 200", "router.no_backend_status: 200 is below"),
        ("[router]\nno_backend_status = 700", "router.no_backend_status: 700 is not an HTTP"),
        ("[router]\nfirst_byte_timeout = 'never'", "router.first_byte_timeout: 'never'"),
        ("[router]\nretries = 2", "router.retries: unknown key"),
        (
            "[router]\nfirst_byte_timeout = '1s'\nconnect_timeout = '3s'",
            "router.first_byte_timeout: 1 s must be longer than router.connect_timeout (3 s)",
        ),
        ("[policy]\nrestart_on = ['requests']", "policy.restart_on: requests cannot condemn"),
        ("[policy]\nwedge_after = -5", "policy.wedge_after: -5 must be a positive"),
        ("[policy]\nstartup_wedge_after = 'soon'", "policy.startup_wedge_after: 'soon'"),
        ("max_check_time = 0", "max_check_time: 0 must be a positive"),
        ("timeout = 1e300", "timeout: 1e+300 is longer than 1 h: a unit missed?"),
        ("timeout = 5000", "timeout: 5000 is longer than 1 h"),  # meant in milliseconds
        ("wait = '2h'", "wait: '2h' is longer than 1 h"),
        ("answer_timeout = '61m'", "answer_timeout: '61m' is longer than 1 h"),
        ("[policy]\ncooldown = '400d'", "policy.cooldown: '400d' is longer than 366 days"),
        ("[router]\nfirst_byte_timeout = 1e308", "router.first_byte_timeout: 1e+308 is longer"),
        # Below a millisecond (no timer counts less): `wait = 1e-310` passed, and the reads
        # a check may take (max_check_time over the wait) overflowed, every backend
        # `no_metrics` with an OverflowError and `watch`'s reading tasks dying in a loop.
        ("wait = 1e-310", "wait: 1e-310 is shorter than a millisecond"),
        ("[policy]\nwedge_after = '0.0001s'", "policy.wedge_after: '0.0001s' is shorter than"),
        ("[[backend]]\nurl = 'http://a:1'\nwedge_after = true", "backend[0].wedge_after"),
        ("wait = ", "not valid TOML"),
        ("[cluster]\nprefix = '/f'", "cluster.etcd: is required"),
        # Each said "(an argv list, never a shell line)", a command's hint, of a list that
        # holds none: the fix it suggested was no fix.
        (
            "[cluster]\netcd = 'http://e:2379'",
            'cluster.etcd: must be a list of strings (etcd client URLs, e.g. ["http://',
        ),
        (
            "[policy]\nrestart_on = 'wedged'",
            "restart_on: must be a list of strings (verdicts, e.g.",
        ),
        (
            "[router]\nroutes = '/v1/completions'",
            "router.routes: must be a list of strings (paths,",
        ),
        ("[cluster]\netcd = ['e:2379']", "cluster.etcd: 'e:2379' is not an http(s) URL"),
        # Only host and port are used (POST /v3/... at the root): a gateway path was dropped
        # without a word, and every request went where no etcd answers.
        ("[cluster]\netcd = ['http://e:2379/etcd']", "cluster.etcd: 'http://e:2379/etcd': a"),
        # etcd's own scrape target, or a /v1 path: told to give "the server's root" since
        # "llmhealth reads /metrics and /v1 below it", of an etcd it reads neither from.
        (
            "[cluster]\netcd = ['http://e:2379/metrics']",
            "cluster.etcd: 'http://e:2379/metrics': a path is not used: etcd's gateway",
        ),
        (
            "[cluster]\netcd = ['http://e:2379/v1']",
            "cluster.etcd: 'http://e:2379/v1': a path is not used: etcd's gateway",
        ),
        ("[cluster]\netcd = ['http://e:1']\nprefix = 'f'", "cluster.prefix: 'f' must be"),
        # Shown as it is by `audit` and in errors: an escape in it would drive a terminal.
        ('[cluster]\netcd = ["http://e:1"]\nprefix = "/a\\u001b[2J"', "cluster.prefix: '/a\\x1b"),
        ("[cluster]\netcd = ['http://e:1']\nlease_ttl = '1s'", "cluster.lease_ttl: 1 s: etcd"),
        ("[cluster]\netcd = ['http://e:1']\nlease_ttl = 2.5", "whole seconds"),
        ("[cluster]\netcd = ['http://e:1']\nmember = 'a/b'", "cluster.member: 'a/b' must"),
        ("[cluster]\netcd = ['http://e:1']\nttl = 3", "cluster.ttl: unknown key"),
        ("[cluster]\netcd = ['http://e:1']\naudit_keep = 99", "cluster.audit_keep: 99 is below"),
        (
            "[cluster]\netcd = ['http://e:1']\naudit_keep = 100001",
            "cluster.audit_keep: 100001 is above the most allowed value, 100000",
        ),
        ("[cluster]\netcd = ['http://e:1']\nshard_reads = 1", "cluster.shard_reads: 1 is not true"),
        # Each of these passed, then failed at run time as something else: a host with a
        # space as the server's `down` (exit 2, a restart under restart_on = ["down"]); a
        # NUL as a restart "not run", its budget spent; "/" as an internal error.
        ("[[backend]]\nurl = 'http://gpu 0.lan:80'", "backend[0].url: 'http://gpu 0.lan:80' has"),
        ("[[backend]]\nurl = 'http://a :1'", "has white space in its host and port"),
        ("[[backend]]\nurl = 'http://a:0'", "backend[0].url: 'http://a:0' has port 0"),
        ("[[backend]]\nurl = 'http://a:1'\nrestart = [\"/bin/x\\u0000\"]", "restart: holds a NUL"),
        # Looked up as a path with a space in it: a name past the file system's limit
        # raised OSError (ENAMETOOLONG), `config check` printed a traceback with the
        # command line in it, and a reload to it ended `watch`.
        (
            f"[[backend]]\nurl = 'http://a:1'\nrestart = ['/{'a' * 5000} x']",
            "backend[0].restart: its first word is a whole command line",
        ),
        ('on_serving_change = ["/bin/x", "a\\u0000b"]', "on_serving_change: holds a NUL"),
        ("state = '/'", "state: '/' names a directory, not a file"),
        ("audit_log = '.'", "audit_log: '.' names a directory, not a file"),
        # Each bound one step past where it holds.
        ("[policy]\nmin_healthy = -1", "policy.min_healthy: -1 is below"),
        ("[policy]\nhealthy_threshold = 0", "policy.healthy_threshold: 0 is below"),
        ("[policy]\nmax_concurrent_restarts = 0", "policy.max_concurrent_restarts: 0 is below"),
        ("[policy]\nrestart_budget = 0", "policy.restart_budget: 0 is below"),
        ("max_body = 1023", "max_body: 1023 is below the least allowed value, 1024"),
        ("[router]\nmax_body = 1023", "router.max_body: 1023 is below"),
        ("[router]\nno_backend_status = 399", "router.no_backend_status: 399 is below"),
        ("[router]\nno_backend_status = 600", "router.no_backend_status: 600 is not an HTTP"),
        (
            "[router]\nfirst_byte_timeout = '3s'\nconnect_timeout = '3s'",
            "router.first_byte_timeout: 3 s must be longer than router.connect_timeout",
        ),
        ("[router]\nlisten = '127.0.0.1:0'", "router.listen: '127.0.0.1:0' is not HOST:PORT"),
        ("[router]\nlisten = '127.0.0.1:65536'", "router.listen: '127.0.0.1:65536' is not"),
        ("[cluster]\netcd = ['http://e:1']\nprefix = '/f/'", "cluster.prefix: '/f/' must be"),
        ("[[backend]]\nurl = 'http://a:1/x;y'", "a base URL takes no query, parameters or"),
        ("[[backend]]\nurl = 'http://a:1'\nexpected_model = 'm|x'", "expected_model: 'm|x' must"),
        ("[policy]\nmin_healthy = true", "policy.min_healthy: True is not a whole number"),
        ("[[backend]]\nurl = 'http://a:99999'", "backend[0].url: 'http://a:99999' has a bad port"),
        ("[[backend]]\nname = '  '\nurl = 'http://a:1'", "backend[0].name: '  ' is not a"),
        # false is no duration of nothing: only a zero turns a wedge term off.
        ("[[backend]]\nurl = 'http://a:1'\nwedge_after = false", "backend[0].wedge_after"),
    ],
)
def test_each_mistake_names_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_each_bound_itself_is_taken(tmp_path: Path) -> None:
    text = (
        "wait = '1ms'\ntimeout = '1h'\nmax_body = 1024\n"
        "[policy]\nmin_healthy = 0\ncooldown = '5m'\ncooldown_max = '5m'\n"
        "max_in_place_recoveries = 0\nrestart_budget_window = '366d'\n"
        "[router]\nlisten = '127.0.0.1:65535'\nno_backend_status = 599\n"
        "[cluster]\netcd = ['http://e:1']\nlease_ttl = 2\n"
    )
    config = load(write(tmp_path, text))
    assert (config.wait, config.timeout, config.max_body) == (0.001, 3600.0, 1024)
    policy = config.policy
    assert (policy.min_healthy, policy.cooldown, policy.cooldown_max) == (0, 300.0, 300.0)
    assert policy.max_in_place_recoveries == 0
    assert policy.restart_budget_window == 366 * 86400.0
    assert (config.router.listen, config.router.no_backend_status) == ("127.0.0.1:65535", 599)
    assert config.cluster is not None and config.cluster.lease_ttl == 2.0
    status = load(write(tmp_path, "[router]\nno_backend_status = 400\n")).router
    assert status.no_backend_status == 400


def test_recovery_in_place_is_on_by_default_and_can_be_turned_off_or_capped(
    tmp_path: Path,
) -> None:
    assert Policy().recover_in_place and Policy().max_in_place_recoveries == 3
    text = "[policy]\nrecover_in_place = false\nmax_in_place_recoveries = 1\n"
    policy = load(write(tmp_path, text)).policy
    assert (policy.recover_in_place, policy.max_in_place_recoveries) == (False, 1)
    # What check, watch and route hand the ledger; off there means seed 000's rule.
    ledger = ledger_policy(policy)
    assert (ledger.recover_in_place, ledger.max_in_place_recoveries) == (False, 1)
    assert ledger_policy(Policy()).recover_in_place


def test_the_wedge_window_keys_load_per_policy_and_per_backend(tmp_path: Path) -> None:
    text = """
max_check_time = "8m"
[policy]
wedge_after = "2m"
startup_wedge_after = "6m"
startup_grace = "20m"
[[backend]]
name = "cpu0"
url = "http://10.0.0.7:8000"
wedge_after = "10m"
[[backend]]
name = "gpu0"
url = "http://10.0.0.8:8000"
[[backend]]
name = "fast"
url = "http://10.0.0.9:8000"
wedge_after = 0
"""
    config = load(write(tmp_path, text))
    assert config.max_check_time == 480.0
    cpu0, gpu0, fast = config.backends
    assert config.wedge_rules(cpu0) == WedgeRules(
        wedge_after=600.0, startup_grace=1200.0, startup_wedge_after=360.0
    )
    assert config.wedge_rules(gpu0).wedge_after == 120.0  # the policy's floor
    assert config.wedge_rules(fast).wedge_after == 0.0  # 0: two waits, for this one only
    assert config.wedge_rules().wedge_after == 120.0  # a bare URL gets the policy's


def test_the_wedge_window_defaults_are_two_waits_and_five_young_minutes() -> None:
    assert Policy().wedge_after == 0.0
    assert Policy().startup_wedge_after == 300.0


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load(binary)


def test_a_file_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    # Some Windows editors save UTF-8 so: tomllib refused it as "Invalid statement (at
    # line 1, column 1)", which did not say what was wrong.
    marked = tmp_path / "fleet.toml"
    marked.write_bytes(b"\xef\xbb\xbf" + b'wait = "7s"\n[[backend]]\nurl = "http://a:1"\n')
    assert load(marked).wait == 7.0


# Loads a config in a child with its memory capped and its time bounded: a regression
# (a read that blocks, or one that never ends) fails the test rather than hangs or swaps.
LOAD_IN_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from llmhealth.config import ConfigError, load
try:
    load(sys.argv[1])
except ConfigError as exc:
    print("ConfigError:", exc)
else:
    print("loaded")
"""


def load_in_child(path: Path) -> str:
    """What ``load(path)`` did in a child process: "loaded" or "ConfigError: ..."; a
    traceback (MemoryError) or a timeout fails the test."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD_IN_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_fifo_for_a_config_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    """A reload read a FIFO on the daemon's loop: it blocked until a writer came, so the
    daemon neither read, settled, nor heard SIGTERM."""
    fifo = tmp_path / "fleet.toml"
    os.mkfifo(fifo)
    assert load_in_child(fifo) == f"ConfigError: {fifo}: cannot read: not a regular file"


def test_a_key_of_thousands_of_dotted_parts_is_refused_before_tomllib_reads_it(
    tmp_path: Path,
) -> None:
    """tomllib's time and memory grow with the square of a key's parts: 80 KB of
    `a.a.a...` took more memory than the host had (a reload, on the daemon's loop), and a
    deep table header over many short keys held it for minutes."""
    deep = tmp_path / "deep.toml"
    deep.write_text("wait = 5\n" + "a." * 200_000 + "a = 1\n")
    assert load_in_child(deep) == (
        f"ConfigError: {deep}: line 2: more than 16 dotted parts in a row: "
        "no key of a config is that deep"
    )
    header = tmp_path / "header.toml"
    header.write_text("[" + "'a' . " * 20 + "b]\n" + "".join(f"k{i} = 1\n" for i in range(9)))
    assert "line 1: more than 16 dotted parts" in load_in_child(header)
    # A long host name is no key, and well under the bound.
    fine = tmp_path / "fine.toml"
    fine.write_text("[[backend]]\nurl = 'http://vllm-0.vllm.llm.svc.cluster.local:8000'\n")
    assert load_in_child(fine) == "loaded"


def test_a_device_for_a_config_is_refused_unread() -> None:
    """/dev/zero was read until the memory ran out: a MemoryError, and the daemon exited."""
    assert (
        load_in_child(Path("/dev/zero"))
        == "ConfigError: /dev/zero: cannot read: not a regular file"
    )


def test_a_config_past_the_size_bound_is_refused_and_one_at_the_bound_loads(
    tmp_path: Path,
) -> None:
    """A 200 MB file was read whole. The bound is for wrong paths: the largest fleet the
    project is measured at, every key of every backend set, stays well inside it."""
    fleet = "".join(
        f"[[backend]]\nname = 'gpu-node-{i:05d}-vllm'\n"
        f"url = 'http://10.12.{i // 250}.{i % 250}:8000'\n"
        f"restart = ['sudo', 'systemctl', 'restart', 'vllm@gpu-node-{i:05d}.service']\n"
        "api_key_env = 'VLLM_API_KEY'\nexpected_model = 'meta-llama/Llama-3.1-70B-Instruct'\n"
        f"cgroup = '/sys/fs/cgroup/system.slice/vllm@gpu-node-{i:05d}.service'\n\n"
        for i in range(10_000)
    )
    assert len(fleet.encode()) < MAX_CONFIG_BYTES / 2
    backend = "[[backend]]\nname = 'a'\nurl = 'http://127.0.0.1:9'\n"
    padding = MAX_CONFIG_BYTES - len(backend) - 1
    at_bound = write(tmp_path, backend + "#" * padding + "\n")
    assert at_bound.stat().st_size == MAX_CONFIG_BYTES
    assert [b.name for b in load(at_bound).backends] == ["a"]
    past = write(tmp_path, backend + "#" * (padding + 1) + "\n")
    with pytest.raises(ConfigError, match=f"^{past}: larger than {MAX_CONFIG_BYTES >> 20} MiB"):
        load(past)


def test_an_integer_past_pythons_digit_limit_is_invalid_toml_naming_the_file(
    tmp_path: Path,
) -> None:
    """tomllib raises a plain ValueError for it, which was not turned into a ConfigError."""
    path = write(tmp_path, "wait = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match=f"^{path}: not valid TOML: Exceeds the limit"):
        load(path)


@pytest.mark.parametrize(
    "text",
    [
        "wait = {n}\n",
        "[policy]\ncooldown = {n}\n",
        "[policy]\nwedge_after = -{n}\n",
        "[router]\nidle_timeout = {n}\n",
        '[[backend]]\nurl = "http://10.0.0.5:8000"\nwedge_after = {n}\n',
    ],
)
def test_a_duration_written_as_an_integer_past_a_floats_range_is_refused_naming_the_key(
    tmp_path: Path, text: str
) -> None:
    """Within Python's digit limit but past a float's range: float() raised OverflowError,
    which is no ValueError. `config check` ended in a traceback, and a SIGHUP to such a
    file killed `watch` (the reload keeps the running config only on a ConfigError)."""
    path = write(tmp_path, text.format(n="1" + "0" * 400))
    with pytest.raises(ConfigError, match=f"^{path}: .*(wait|cooldown|after|timeout): .*digits"):
        load(path)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(5, 5.0), (0.5, 0.5), ("90s", 90.0), ("15m", 900.0), ("24h", 86400.0), ("250ms", 0.25)],
)
def test_durations_read_as_seconds(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value", [0, -3, "nan", "5 parsecs", True, None, float("inf"), 1e-310, 0.0009, "0.5ms"]
)
def test_nonsense_durations_are_rejected(value: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(value)


@pytest.mark.parametrize(
    "url",
    [
        "http://alice:s3cret@10.0.0.5:8000",
        "http://:s3cret@10.0.0.5:8000",
        "https://s3cret@10.0.0.5",
        "http://alice:s3/cr@t@10.0.0.5:8000",  # '/' and '@' in the password
        "alice:s3cret@10.0.0.5:8000",  # no scheme: still not echoed
        "http://alice:s3cret\uff2010.0.0.5:8000",  # full-width '@': urlsplit's error echoed
    ],
)
@pytest.mark.parametrize("table", ["backend", "proxy", "cluster"])
def test_credentials_in_a_url_are_refused_without_echoing_them(
    tmp_path: Path, url: str, table: str
) -> None:
    path = tmp_path / "fleet.toml"
    if table == "cluster":
        path.write_text(f'[cluster]\netcd = ["http://10.0.0.9:2379", "{url}"]\n')
    else:
        path.write_text(f'[[{table}]]\nname = "gpu0"\nurl = "{url}"\n')
    with pytest.raises(ConfigError) as raised:
        load(path)
    message = str(raised.value)
    assert ("cluster.etcd" if table == "cluster" else f"{table}[0].url") in message
    assert "api_key_env" in message
    assert "s3" not in message and "alice" not in message
    assert "10.0.0.5" in message  # what to write instead


def test_the_router_table_has_documented_defaults_and_takes_each_key(tmp_path: Path) -> None:
    path = tmp_path / "llmhealth.toml"
    path.write_text("")
    assert load(path).router == Router()
    assert Router().routes[0] == "/v1/chat/completions"
    path.write_text(
        "[policy]\nrestart_on = ['wedged', 'request_failures']\n"
        "[router]\nlisten = '[::1]:8300'\naffinity = 'body:user'\naffinity_slack = 2\n"
        "first_byte_timeout = '30s'\nstream_idle_timeout = '1m'\nno_backend_status = 429\n"
        "routes = ['/v1/completions']\nmax_body = 4096\n"
    )
    config = load(path)
    assert config.policy.restart_on == ("wedged", "request_failures")
    assert config.router == Router(
        listen="[::1]:8300",
        routes=("/v1/completions",),
        affinity="body:user",
        affinity_slack=2,
        max_body=4096,
        first_byte_timeout=30.0,
        stream_idle_timeout=60.0,
        no_backend_status=429,
    )
    assert parse_listen("[::1]:8300") == ("::1", 8300)


@pytest.mark.parametrize("host", ["127.0.0.1\\u0000x", "127.0.0.1\\u001b[2J"])
def test_a_router_listen_address_with_a_control_character_is_refused(
    tmp_path: Path, host: str
) -> None:
    """A NUL passed `config check`, then `route` died with "internal error": binding raised
    ValueError ("embedded null character"), not the OSError its start reports."""
    path = write(tmp_path, f'[router]\nlisten = "{host}:8200"\n')
    with pytest.raises(ConfigError, match=f"^{path}: router.listen: .*control character"):
        load(path)


@pytest.mark.parametrize("port", ["\u00b2", "\u0661\u0662\u0663"])
def test_a_listen_port_in_digits_other_than_ascii_is_refused_as_not_host_port(
    tmp_path: Path, port: str
) -> None:
    """A superscript two passed str.isdigit and ended the load in int()'s own message
    ("invalid literal for int() with base 10"); Arabic-Indic digits were taken as port
    123, which no config or `ss` line shows."""
    path = write(tmp_path, f'[router]\nlisten = "127.0.0.1:{port}"\n')
    with pytest.raises(ConfigError, match=f"^{path}: router.listen: .* is not HOST:PORT"):
        load(path)


@pytest.mark.parametrize("workers", [4000, 10**9])
def test_a_number_of_read_workers_no_machine_could_start_is_refused(
    tmp_path: Path, workers: int
) -> None:
    """Each read worker is a process of its own, all started at once: `read_workers =
    1000000000` passed `config check`, then `watch` ended in a MemoryError while making
    them (and 4000, the share "auto" gives one worker, would start 4000 interpreters)."""
    path = write(tmp_path, f"read_workers = {workers}\n")
    with pytest.raises(ConfigError, match=f"^{path}: read_workers: {workers} is above"):
        load(path)
    assert load(write(tmp_path, "read_workers = 256\n")).read_workers == 256


@pytest.mark.parametrize("zero", ["0", "0s", "0m", "0ms", "0.0", "0.0s", " 0 h ", 0, 0.0])
def test_zero_turns_a_wedge_term_off_in_any_unit(tmp_path: Path, zero: object) -> None:
    """`startup_wedge_after = 0` turns that term off (README); written "0m" or "0.0" it
    was refused as "must be a positive, finite duration"."""
    text = f"[policy]\nstartup_wedge_after = {zero!r}\nwedge_after = {zero!r}\n".replace("'", '"')
    policy = load(write(tmp_path, text)).policy
    assert (policy.startup_wedge_after, policy.wedge_after) == (0.0, 0.0)
    with pytest.raises(ConfigError, match=r"wait: .* must be a positive"):
        load(write(tmp_path, "wait = '0m'\n"))


def test_a_cluster_section_has_defaults_for_all_but_the_endpoints(tmp_path: Path) -> None:
    config = load(write(tmp_path, "[cluster]\netcd = ['http://10.0.0.1:2379/']"))
    assert config.cluster == Cluster(("http://10.0.0.1:2379",), "/llmhealth/default", 10.0, None)
    assert load(write(tmp_path, "wait = 5")).cluster is None
    three = load(
        write(
            tmp_path,
            "[cluster]\netcd = ['http://a:2379', 'http://b:2379', 'http://c:2379']\n"
            "prefix = '/llmhealth/prod'\nlease_ttl = '15s'\nmember = 'node-a'\n"
            "audit_keep = 500\nshard_reads = true",
        )
    )
    assert three.cluster == Cluster(
        ("http://a:2379", "http://b:2379", "http://c:2379"),
        "/llmhealth/prod",
        15.0,
        "node-a",
        500,
        shard_reads=True,
    )


def test_a_reload_may_change_the_fleet_but_not_where_the_ledger_lives() -> None:
    running = Config(backends=(Backend("gpu0", "http://127.0.0.1:8000"),))
    cluster = Cluster(etcd=("http://127.0.0.1:2379",))
    more = replace(running, wait=2.0, backends=(*running.backends, Backend("gpu1", "http://h:1")))
    assert more.cannot_replace(running) is None
    for changed, named in [
        (replace(running, cluster=cluster), "[cluster]"),
        (replace(running, state="/srv/state.json"), "state"),
        (replace(running, audit_log="/srv/audit.jsonl"), "audit_log"),
    ]:
        why = changed.cannot_replace(running)
        assert why is not None and why.startswith(named) and "restart" in why
        assert running.cannot_replace(changed) == why  # losing it is refused the same
    clustered = replace(running, cluster=cluster)
    moved = replace(clustered, cluster=replace(cluster, prefix="/other"))
    assert moved.cannot_replace(clustered) is not None


@pytest.mark.parametrize("host", ["gpu..lab", "a" * 64 + ".lab"])
def test_a_host_name_no_request_can_carry_is_a_config_error(tmp_path: Path, host: str) -> None:
    # The router's and the probes' Host header is the name in IDNA form: a name with an
    # empty or over-long label passed the config and then failed every request (the
    # router's reload died on it).
    path = tmp_path / "fleet.toml"
    path.write_text(f'[[backend]]\nname = "gpu0"\nurl = "http://{host}:8000"\n')
    with pytest.raises(ConfigError, match=r"backend\[0\]\.url.*no request can carry"):
        load(path)


def test_a_key_in_a_urls_query_is_refused_and_never_repeated(tmp_path: Path) -> None:
    path = write(tmp_path, "[[backend]]\nurl = 'http://a:1?api_key=s3cret'\n")
    with pytest.raises(ConfigError, match="no query") as refused:
        load(path)
    assert "s3cret" not in str(refused.value)


def test_relative_paths_are_the_config_files_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cron job and an operator's shell in other directories reach one ledger."""
    (tmp_path / "etc").mkdir()
    path = tmp_path / "etc" / "llmhealth.toml"
    path.write_text("state = 'run/state.json'\naudit_log = '~/audit.jsonl'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = load(Path("etc/llmhealth.toml"))
    assert config.state == str(tmp_path / "etc" / "run" / "state.json")
    assert config.audit_log == str(tmp_path / "home" / "audit.jsonl")


def test_a_config_nested_thousands_deep_is_a_config_error(tmp_path: Path) -> None:
    """tomllib recurses per level: a RecursionError killed `config check` and a reload."""
    with pytest.raises(ConfigError, match="nested too deeply"):
        load(write(tmp_path, "x = " + "[" * 5000 + "]" * 5000))


def test_a_url_keeps_its_spelling_and_a_bare_entry_its_name(tmp_path: Path) -> None:
    """Lower-cased, a backend named after its URL got another name on upgrade, and its
    record (a retirement) was forgotten; case only matters when two URLs are compared."""
    config = load(write(tmp_path, "[[backend]]\nurl = 'http://GPU-Host:8000/'\n"))
    assert (config.backends[0].name, config.backends[0].url) == (
        "GPU-Host:8000",
        "http://GPU-Host:8000",
    )


def test_a_home_path_without_a_home_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No HOME and no passwd entry (a service user): expanding "~" raised, a traceback."""
    monkeypatch.delenv("HOME")
    monkeypatch.setattr("pwd.getpwuid", lambda _uid: (_ for _ in ()).throw(KeyError(_uid)))
    with pytest.raises(ConfigError, match=r"state: '~/state\.json': Could not determine home"):
        load(write(tmp_path, "state = '~/state.json'\n"))


@pytest.mark.parametrize("url", ["http://h:8000#", "http://h:8000/?", "http://h:8000/"])
def test_an_empty_query_or_fragment_is_dropped_not_kept(url: str) -> None:
    """Kept, every path appended went into it: GET / for /metrics, a healthy server
    judged no_metrics."""
    assert check_url(url) == "http://h:8000"
    # Case is kept, the scheme's too (urlsplit lower-cases it: a state saved before with
    # HTTP:// was readdressed on upgrade).
    assert check_url("HTTP://GPU-Host:8000/p/") == "HTTP://GPU-Host:8000/p"
    # A host named v1 is a host, not an OpenAI base URL's path.
    assert check_url("http://v1") == "http://v1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # A backend or proxy without a name is named by host:port, and that name keeps
        # the rule an explicit one keeps: it is shown raw in tables and Nagios lines.
        # (A '|', '=' or control character in an ASCII host is refused as no host's.)
        ('[[backend]]\nurl = "http://a\\u200bb:8000"', "backend[0].url: 'http://a\\u200bb:8000'"),
        # '=' ends a perfdata label: "it's a=gpu" and "it's a_gpu" were one graph.
        ("[[backend]]\nname = \"it's a=gpu\"\nurl = 'http://a:1'", "backend[0].name: \"it's a="),
    ],
)
def test_a_name_breaking_the_label_rule_is_refused_explicit_or_from_the_url(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
    assert "no '|' or '='" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[[backend]]\nname = 'none'\nurl = 'http://a:1'", "backend[0].name"),
        ("[[backend]]\nurl = 'http://none'", "backend[0].url"),
    ],
)
def test_a_backend_cannot_take_the_name_the_router_counts_its_own_answers_under(
    tmp_path: Path, text: str, key: str
) -> None:
    """The router counts what it answers itself (a 404, a 503 with nothing serving) under
    backend="none": a backend so named had its answers added to those, and its series
    kept after a reload dropped it."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{key}: ")) as caught:
        load(path)
    assert 'backend="none"' in str(caught.value)


def test_a_name_from_a_clean_url_is_its_host_and_port() -> None:
    assert name_for_url("http://10.0.0.5:8000") == "10.0.0.5:8000"
    with pytest.raises(ValueError, match=re.escape("'http://x|y:8000' would be named 'x|y:8000'")):
        name_for_url("http://x|y:8000")


@pytest.mark.parametrize("written", ["sk-proj-4f9a2Bq", "$VLLM_API_KEY", "9LIVES", "", "KEY NAME"])
def test_an_api_key_env_that_names_no_variable_is_refused_without_echoing_it(
    tmp_path: Path, written: str
) -> None:
    """A key pasted where its variable's name goes was taken, looked up, never found,
    and every request went without a key."""
    path = write(
        tmp_path,
        f'[[backend]]\nname = "gpu0"\nurl = "http://10.0.0.5:8000"\napi_key_env = "{written}"\n',
    )
    with pytest.raises(ConfigError) as raised:
        load(path)
    message = str(raised.value)
    assert "backend[0].api_key_env: must name an environment variable" in message
    assert not written or written not in message


def test_a_backend_whose_key_variable_is_unset_is_refused_as_llmhealths_own_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run without the operator's environment (cron, a unit without its EnvironmentFile),
    every request went without the key: a 401, read as the backend's failure, condemned
    a healthy backend and breached the floor."""
    path = write(
        tmp_path,
        '[[backend]]\nname = "gpu0"\nurl = "http://10.0.0.5:8000"\napi_key_env = "GPU0_KEY"\n',
    )
    config = load(path)
    for unset in (None, ""):
        if unset is None:
            monkeypatch.delenv("GPU0_KEY", raising=False)
        else:
            monkeypatch.setenv("GPU0_KEY", unset)
        assert [reason[:40] for reason in unset_key_variables(config)] == [
            "backend 'gpu0': its api_key_env names GP"
        ]
        with pytest.raises(
            BadTargetError, match="'gpu0': its api_key_env names GPU0_KEY, which is not set"
        ):
            targets_for(config, [], [])
    monkeypatch.setenv("GPU0_KEY", "s3cret")
    assert unset_key_variables(config) == []
    assert targets_for(config, [], [])[0].api_key == "s3cret"


@pytest.mark.parametrize("pasted", ["a8F3kd93xQ7Lm2", "hf_AbCdEfGh12345"])
def test_a_key_pasted_as_a_variables_name_is_not_repeated_when_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pasted: str
) -> None:
    """A key of letters and digits alone (vLLM's --api-key is any text; an HF token)
    passes the name rule, names no variable set here, and the refusal printed it into
    every log that quoted it (`config check`, the daemon's reload, a cron mail)."""
    path = write(
        tmp_path,
        f'[[backend]]\nname = "gpu0"\nurl = "http://10.0.0.5:8000"\napi_key_env = "{pasted}"\n',
    )
    monkeypatch.delenv(pasted, raising=False)
    config = load(path)
    (reason,) = unset_key_variables(config)
    assert pasted not in reason, reason
    assert "'gpu0': its api_key_env names a variable" in reason
    with pytest.raises(BadTargetError) as raised:
        targets_for(config, [], [])
    assert pasted not in str(raised.value)


def test_a_program_path_with_a_space_that_exists_is_a_program(tmp_path: Path) -> None:
    """Only a first word that is no file is taken for a shell line written as one."""
    program = tmp_path / "restart vllm.sh"
    program.write_text("#!/bin/sh\n")
    path = write(tmp_path, f'[[backend]]\nurl = "http://a:1"\nrestart = ["{program}", "gpu0"]\n')
    assert load(path).backends[0].restart == (str(program), "gpu0")


@pytest.mark.parametrize(
    ("written", "taken"),
    [
        (
            "/sys/fs/cgroup/system.slice/vllm@0.service",
            "/sys/fs/cgroup/system.slice/vllm@0.service",
        ),
        ("/system.slice/vllm@0.service", "/sys/fs/cgroup/system.slice/vllm@0.service"),
        ("/system.slice/vllm@0.service/", "/sys/fs/cgroup/system.slice/vllm@0.service"),
        ("/init.scope", "/sys/fs/cgroup/init.scope"),
        # Not systemd's: kept as written (a container's view of the host's cgroups).
        (
            "/host/sys/fs/cgroup/system.slice/vllm.service",
            "/host/sys/fs/cgroup/system.slice/vllm.service",
        ),
    ],
)
def test_a_cgroup_is_taken_under_the_cgroup_mount_as_systemd_shows_it(
    tmp_path: Path, written: str, taken: str
) -> None:
    """What `systemctl show -p ControlGroup` prints was read at the file system's root,
    found nothing, and the backend's CPU evidence was lost without a word."""
    path = write(tmp_path, f'[[backend]]\nurl = "http://a:1"\ncgroup = "{written}"\n')
    assert load(path).backends[0].cgroup == taken


def test_a_relative_cgroup_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, '[[backend]]\nurl = "http://a:1"\ncgroup = "system.slice/x"\n')
    with pytest.raises(ConfigError) as raised:
        load(path)
    assert "backend[0].cgroup: 'system.slice/x' is relative" in str(raised.value)


def test_an_empty_hook_is_the_default_written_out(tmp_path: Path) -> None:
    """`on_serving_change = []` was the README's default; an empty restart stays refused."""
    assert load(write(tmp_path, "on_serving_change = []\n")).on_serving_change == ()


@pytest.mark.parametrize("key", ["state", "audit_log"])
def test_a_state_or_audit_log_naming_an_existing_directory_is_refused(
    tmp_path: Path, key: str
) -> None:
    # `state = "/var/lib/llmhealth"`, the state *directory*: `config check` said ok, and
    # `watch` then skipped every cycle ("cannot read state ...: not a regular file").
    (tmp_path / "llmhealth").mkdir()
    path = write(tmp_path, f'{key} = "llmhealth"\n')
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert f"{path}: {key}: 'llmhealth' names a directory, not a file" in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://${VLLM_HOST}:8000",
        "http://$VLLM_HOST:8000",
        "http://gpu%30.lan:8000",
        "http://x|y:8000",
        "http://a=b:80",
    ],
)
def test_a_host_no_server_can_have_is_refused_not_judged_down(tmp_path: Path, url: str) -> None:
    # An environment variable is not expanded in a config: the host "${vllm_host}" passed
    # `config check`, and every check then judged the server `down` (CRITICAL; DEAD after
    # three, restarted under restart_on = ["down"]) for a typo, as a host with a space was.
    path = write(tmp_path, f"[[backend]]\nurl = '{url}'\n")
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert "backend[0].url:" in str(caught.value)
    assert "no host name" in str(caught.value)
    expanded = "(a variable is not expanded here)" in str(caught.value)
    assert expanded == ("$" in url)
    with pytest.raises(ValueError, match="no host name"):
        check_url("http://\x1bc\x1b:8001")  # a bare URL on the command line
    for good in ("http://vllm_0.svc:8000", "http://[fe80::1%25eth0]:8000", "http://bücher.de"):
        check_url(good)  # an underscore, an IPv6 zone, an IDN: hosts that resolve


def test_a_control_character_in_a_urls_path_is_refused(tmp_path: Path) -> None:
    # It passed `config check`; a restart command was then given it in LLMHEALTH_URL,
    # which no process can take with a NUL: `check` died with a traceback, RESTARTING.
    path = write(tmp_path, '[[backend]]\nurl = "http://127.0.0.1:8000/a\\u0000b"\n')
    with pytest.raises(ConfigError, match="control character in its path"):
        load(path)
    with pytest.raises(ValueError, match="control character in its path"):
        check_url("http://127.0.0.1:8000/\x1b[31m")


def test_a_metrics_url_is_refused_for_the_servers_root(tmp_path: Path) -> None:
    # A Prometheus scrape target's address: taken as a root, a healthy idle server was
    # `no_metrics` ("GET /metrics answered HTTP 404", its /v1/models too), CRITICAL and
    # SUSPECT at once, DEAD after three checks; a proxy's /v1/models 404 read `down`.
    path = write(tmp_path, "[[backend]]\nurl = 'http://a:8000/metrics/'\n")
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert "backend[0].url: 'http://a:8000/metrics/' ends in /metrics: give the server's " in (
        str(caught.value)
    )
    assert "root (http://a:8000)" in str(caught.value)
    with pytest.raises(ValueError, match="ends in /metrics"):
        check_url("http://a:8000/gpu0/metrics")  # a bare URL, or behind a path prefix
    assert check_url("http://a:8000/gpu0") == "http://a:8000/gpu0"  # a prefix is a root
    assert check_url("http://metrics") == "http://metrics"  # a host so named too


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("http://a:8000/health", "/health"),  # the old health check's
        ("http://a:8000/v1/models/", "/v1/models"),
        ("https://a/gpu0/v1/chat/completions", "/v1/chat/completions"),
        ("http://a:8000/v1/completions", "/v1/completions"),
    ],
)
def test_a_servers_own_endpoint_is_refused_for_its_root(
    tmp_path: Path, url: str, endpoint: str
) -> None:
    # Copied from an old health check or a client's curl line: read as a root, a healthy
    # idle server answered /health/metrics and /health/v1/models with 404s, `no_metrics`
    # with its tiny request failed, CRITICAL, DEAD after three checks.
    path = write(tmp_path, f"[[backend]]\nurl = '{url}'\n[[proxy]]\nurl = 'http://lb:1'\n")
    with pytest.raises(ConfigError, match=f"ends in {endpoint}: give the server's root"):
        load(path)
    with pytest.raises(ValueError, match=f"ends in {endpoint}"):
        check_url(url)
    assert check_url("http://health") == "http://health"  # a host so named is a root


@pytest.mark.parametrize("endpoint", ["/metrics", "/health"])
def test_an_endpoint_put_after_a_base_url_names_the_root_above_the_v1(endpoint: str) -> None:
    # A base URL with the endpoint put after it: told to give http://a:8000/v1, a root
    # refused in its turn.
    url = f"http://a:8000/gpu0/v1{endpoint}"
    with pytest.raises(ValueError, match=r"give the server's root \(http://a:8000/gpu0\);"):
        check_url(url)


def test_two_names_that_are_one_text_in_two_unicode_forms_are_refused(tmp_path: Path) -> None:
    # "café" composed and decomposed: two backends that status, Nagios perfdata and every
    # log showed as one name, and a verb on "café" acted on whichever form was typed.
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    text = (
        f"[[backend]]\nname = '{composed}'\nurl = 'http://a:1'\n"
        f"[[backend]]\nname = '{decomposed}'\nurl = 'http://b:1'\n"
    )
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert "name used twice" in str(caught.value)


@pytest.mark.parametrize("key", ["s3cret\r", "s3cret\n", "s3cr\u00e9t", "s3\tcret"])
def test_a_key_no_request_header_can_carry_is_refused_like_an_unset_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    # A CR kept from an environment file with Windows line ends (`. keys.env` in a cron
    # script): `config check` and the start said ok, every probe was "not judged: examining
    # it raised ValueError ... or a bug in llmhealth", and `route` forwarded each request
    # without the key, the Authorization line dropped.
    path = write(
        tmp_path,
        '[[backend]]\nname = "gpu0"\nurl = "http://10.0.0.5:8000"\napi_key_env = "GPU0_KEY"\n',
    )
    monkeypatch.setenv("GPU0_KEY", key)
    config = load(path)
    (reason,) = unset_key_variables(config)
    assert "GPU0_KEY" in reason and "s3" not in reason, reason
    assert "no HTTP header can carry" in reason
    with pytest.raises(BadTargetError, match="no HTTP header can carry"):
        targets_for(config, [], [])


def test_a_control_character_in_an_ipv6_zone_is_refused(tmp_path: Path) -> None:
    # A zone is not checked as a host name is: "%25lo\u0000" passed `config check`, the
    # backend was judged down, and a restart command given it in LLMHEALTH_URL was "not
    # run" each time, a failed attempt, until its budget retired the backend.
    path = write(tmp_path, '[[backend]]\nname = "a"\nurl = "http://[fe80::1%25lo\\u0000x]:8000"\n')
    with pytest.raises(ConfigError, match="control character"):
        load(path)
    with pytest.raises(ValueError, match="control character"):
        check_url("http://[fe80::1%25\x1b[31m]:8000")
    assert check_url("http://[fe80::1%25eth0]:8000") == "http://[fe80::1%25eth0]:8000"
    # Written as it is in a request's Host header (``wire``), which is ASCII.
    with pytest.raises(ValueError, match="one beyond ASCII, in its IPv6 zone"):
        check_url("http://[fe80::1%25ethé]:8000")


@pytest.mark.parametrize(
    ("url", "refusal"),
    [
        ("http://[::1]x;}:8000", "more than a bracketed address and a port"),
        ("http://gpu[::1]:8000", "more than a bracketed address and a port"),
        ("http://[::1]]:8000", "more than a bracketed address and a port"),
        ("http://[fe80::1%25lo;}server{]:8000", "its IPv6 zone holds ';'"),
    ],
)
def test_a_host_with_text_an_nginx_include_would_read_as_syntax_is_refused(
    tmp_path: Path, url: str, refusal: str
) -> None:
    # Each passed: requests went to the bracketed address, and `watch --serving-file
    # upstream.conf` wrote "server [::1]x;}:8000;", ending the upstream block, so that
    # every `nginx -s reload` after it failed and the balancer kept a stale set.
    path = write(tmp_path, f'[[backend]]\nname = "a"\nurl = "{url}"\n')
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        load(path)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        check_url(url)
    for good in ("http://[::1]:8000", "http://[::1]", "http://[fe80::1%25eth0.7_a~b]:8000"):
        assert check_url(good) == good


@pytest.mark.parametrize(
    "text",
    [
        "[policy]\nmin_healthy = {n}\n",
        "[policy]\nunhealthy_threshold = {n}\n",
        "[router]\nmax_body = {n}\n",
    ],
)
def test_a_whole_number_past_a_floats_range_is_refused_naming_the_key(
    tmp_path: Path, text: str
) -> None:
    """As a duration so written: `min_healthy = 1000...0` (401 digits) passed `config
    check`, then every /metrics scrape of `watch` and `route` failed on an OverflowError
    (its gauge is a float)."""
    path = write(tmp_path, text.format(n="1" + "0" * 400))
    with pytest.raises(ConfigError, match=f"^{path}: .*(healthy|threshold|max_body): .*digits"):
        load(path)


@pytest.mark.parametrize("host", ["a" * 64, "a..b", "x." + "b" * 64])
def test_a_listen_host_no_lookup_can_carry_is_refused(tmp_path: Path, host: str) -> None:
    """A label past 63 characters passed `config check`, then `route` (and `watch
    --listen`) died in "internal error": the lookup's IDNA step raised UnicodeError."""
    path = write(tmp_path, f'[router]\nlisten = "{host}:8200"\n')
    with pytest.raises(ConfigError, match=f"^{path}: router.listen: .*no lookup can carry"):
        load(path)
    with pytest.raises(ValueError, match="no lookup can carry"):
        parse_listen(f"{host}:9100")
