"""The command line: thin verbs over the core, and the one place errors become exit codes.

Monitoring convention: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN. Anything that stops a
check from running at all (bad arguments, bad config, our own bug) is 3, never 2, so an
alert on CRITICAL always means a server, not a typo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
import time
import traceback
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from llmhealth import config as config_module
from llmhealth.actions import AuditError
from llmhealth.classify import Target
from llmhealth.ledger import MAX_WEIGHT_VERSION
from llmhealth.openfiles import discard_output, output_may_fail, reader_may_leave
from llmhealth.report import ExitCode
from llmhealth.state import StateError, given_path

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmhealth.actions import Audit
    from llmhealth.cluster import Seat
    from llmhealth.operate import VerbResult
    from llmhealth.report import CycleReport
    from llmhealth.state import MemoryStore, StateFile, Store

# Each verb imports what it alone needs (the cycle and its HTTP client, rich, the daemon,
# the simulator) inside its body: a shell check or a once-a-minute timer pays for the
# interpreter and these few modules, not for every verb's, before its first request.

# Help is read as rich markup, where a TOML table's name is a style tag: "[cluster]" and
# "[router]" vanished from three help texts ("From etcd with a  config"). A help text
# naming one escapes its bracket with a backslash, as rich markup reads it.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Health checks for LLM inference fleets that read the server's own metrics first.",
)


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"
    NAGIOS = "nagios"


def _duration(value: str | None, most: float = config_module.LONGEST_DURATION) -> float | None:
    if value is None:
        return None
    try:
        return config_module.parse_duration(_number_or_text(value), most)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _number_or_text(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


WaitOption = Annotated[
    str | None,
    typer.Option(
        "--wait",
        help="Time between two reads of a backend (e.g. 5, '5s'). Default: the config's "
        "wait, else 5s.",
    ),
]
TimeoutOption = Annotated[
    str | None,
    typer.Option(
        "--timeout",
        help="Bound on one HTTP read, connect to last byte. Default: the config's timeout, "
        "else 5s.",
    ),
]
AnswerTimeoutOption = Annotated[
    str | None,
    typer.Option(
        "--answer-timeout",
        help="Bound on the tiny request. Default: the config's answer_timeout, else 10s.",
    ),
]
ConfigOption = Annotated[
    str | None,
    typer.Option("--config", "-c", help="TOML file listing backends, proxies and policy."),
]
FormatOption = Annotated[
    OutputFormat,
    typer.Option("--format", "-f", help="table for people, json for machines, nagios for plugins."),
]


def _config_or_default(config_file: str | None) -> config_module.Config:
    """The config named, or the defaults when none is (an empty name is refused)."""
    return config_module.load(config_file) if config_file is not None else config_module.Config()


def _state_path(value: str | None) -> str | None:
    if value is not None:
        try:
            given_path(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


StateOption = Annotated[
    str | None,
    typer.Option(
        "--state",
        callback=_state_path,
        help="State file (ledger, holds, budgets). Default with --config: the config's "
        "'state', else $STATE_DIRECTORY, /var/lib/llmhealth (root) or the user's state "
        "directory ($XDG_STATE_HOME when absolute, else ~/.local/state). Bare URLs "
        "without --state or --config keep no state between runs; in a cluster the record "
        "is in etcd.",
    ),
]


UrlsArgument = Annotated[
    list[str] | None,
    typer.Argument(help="Backend base URLs, e.g. http://10.0.0.5:8000 (read directly)."),
]
ProxyOption = Annotated[
    list[str] | None,
    typer.Option("--proxy", help="A proxy's base URL: checked through /v1/models only."),
]


@app.command()
def check(
    urls: UrlsArgument = None,
    proxy: ProxyOption = None,
    config_file: ConfigOption = None,
    state: StateOption = None,
    wait: WaitOption = None,
    timeout: TimeoutOption = None,
    answer_timeout: AnswerTimeoutOption = None,
    output: FormatOption = OutputFormat.TABLE,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Decide restarts and log them, but issue and run none. Verdicts, and the "
            "ledger moves they cause, are still saved.",
        ),
    ] = False,
    no_restart: Annotated[
        bool,
        typer.Option(
            "--no-restart",
            help="No restart decisions at all for this run; verdicts are still saved.",
        ),
    ] = False,
) -> None:
    """Check every backend once, update the ledger, restart proven wedges, print, exit 0-3.

    A backend that shows work is never sent a request: it is judged by whether its engine
    steps between reads. Only a backend with nothing to do gets one tiny request.
    """
    # The cycle brings the HTTP client, the ledger and remediation: only a check needs them.
    from llmhealth.cycle import run_cycle, run_cycle_in_cluster, state_path_for  # noqa: PLC0415
    from llmhealth.openfiles import raise_file_limit  # noqa: PLC0415
    from llmhealth.probe import ProbeSettings  # noqa: PLC0415
    from llmhealth.remediate import Mode  # noqa: PLC0415
    from llmhealth.state import StateFile  # noqa: PLC0415

    loaded, targets = _fleet(urls or [], proxy or [], config_file)
    if not targets:
        raise typer.BadParameter("nothing to check: give backend URLs, --proxy or --config")
    settings = ProbeSettings(
        wait=_duration(wait, config_module.LONGEST_READ) or loaded.wait,
        timeout=_duration(timeout, config_module.LONGEST_READ) or loaded.timeout,
        answer_timeout=_duration(answer_timeout, config_module.LONGEST_READ)
        or loaded.answer_timeout,
        max_body=loaded.max_body,
        max_check_time=loaded.max_check_time,
    )
    mode = Mode.OFF if no_restart else Mode.DRY_RUN if dry_run else Mode.ACT
    raise_file_limit()  # a connection per backend, all at once
    if loaded.cluster is not None:
        report = run_cycle_in_cluster(
            loaded, loaded.cluster, targets, settings, mode=mode, log=_log_quoted
        )
    else:
        # Bare URLs without --state or --config keep no state: a quick look changes nothing.
        keeps_state = state is not None or config_file is not None
        store = StateFile(state_path_for(loaded, state)) if keeps_state else None
        report = run_cycle(loaded, targets, settings, store, mode=mode)
    with output_may_fail(sys.stdout):  # the verdicts' exit code stands without a reader
        _print(report, output)
    from llmhealth.report import exit_code  # noqa: PLC0415

    raise typer.Exit(int(exit_code(report)))


def _daemon_loader(
    urls: list[str],
    proxies: list[str],
    config_file: str | None,
    state: str | None,
    serving_file: str | None = None,
) -> Callable[[], tuple[config_module.Config, list[Target]]]:
    """How `watch` and `route` load their config, at start and on SIGHUP. With --state,
    the config's ``state`` is not where the ledger lives: it is taken as --state, so a
    reload that changed only that key is not refused as moving the ledger. With an nginx
    --serving-file, a backend it cannot name is refused (``check_nginx_servers``)."""

    def load() -> tuple[config_module.Config, list[Target]]:
        try:
            loaded, targets = _fleet(urls, proxies, config_file)
        except typer.BadParameter as exc:  # on SIGHUP this is a config to refuse
            raise config_module.ConfigError(exc.format_message()) from exc
        if serving_file is not None:
            config_module.check_nginx_servers(Path(serving_file), targets)
        if state is not None:
            loaded = dataclasses.replace(loaded, state=state)
        return loaded, targets

    return load


def _daemon_store(
    loaded: config_module.Config, state: str | None, config_file: str | None
) -> Seat | StateFile | MemoryStore:
    """Where `watch` and `route` keep the ledger: with a [cluster], its record in etcd,
    which only the member holding the lease writes (a standby reads it every wait); else
    the state file, with the audit log beside it unless the config names one; on bare
    URLs without --state, in memory for this run alone, as `check` keeps none."""
    if loaded.cluster is not None:
        return _seat(loaded.cluster)
    from llmhealth.cycle import state_path_for  # noqa: PLC0415
    from llmhealth.state import MemoryStore, StateFile  # noqa: PLC0415

    if state is None and config_file is None:
        return MemoryStore()
    return StateFile(state_path_for(loaded, state))


def _seat(cluster: config_module.Cluster) -> Seat:
    from llmhealth.cluster import Seat  # noqa: PLC0415

    return Seat.for_config(cluster, _daemon_log_quoted)


def _daemon_log_quoted(message: str) -> None:
    """``_log_quoted`` for `watch` and `route`: written by the daemon's log thread
    (``LogLines``). Written on the elector's own thread to a log nobody read, it blocked
    that thread, which renewed the lease no more: leadership lost a TTL on, for as long
    as nobody read, and a stop that waited the TTL for the thread."""
    from llmhealth.daemon import LOG_LINES  # noqa: PLC0415
    from llmhealth.text import printable  # noqa: PLC0415

    LOG_LINES.write(printable(message))


def _log_quoted(message: str) -> None:
    """A line on stderr, escaped: etcd's own error texts are quoted in these."""
    from llmhealth.text import printable  # noqa: PLC0415

    # A daemon outlives its log's reader, and a log it cannot write (a full disk): the
    # cluster's elector logs here from its thread, which an error would end.
    with contextlib.suppress(OSError), reader_may_leave(sys.stderr):
        print(printable(message), file=sys.stderr, flush=True)


@app.command()
def watch(
    urls: UrlsArgument = None,
    proxy: ProxyOption = None,
    config_file: ConfigOption = None,
    state: StateOption = None,
    wait: WaitOption = None,
    listen: Annotated[
        str,
        typer.Option(
            "--listen",
            help="HOST:PORT for llmhealth's own /metrics; loopback unless told otherwise. "
            "'off' serves none.",
        ),
    ] = "127.0.0.1:9464",
    serving_file: Annotated[
        str | None,
        typer.Option(
            "--serving-file",
            help="Write the serving set here whenever it changes: JSON, or an nginx "
            "'server' include when the name ends in .conf.",
        ),
    ] = None,
) -> None:
    """Run the check cycle every wait as a daemon: ledger, restarts, metrics, systemd notify.

    SIGHUP reloads the config (an invalid one is reported and the old one kept). SIGTERM
    lets the settle in progress and running restart commands finish (10 s each at most),
    saves what they did, and exits 0; a restart whose command still runs stays on record
    as issued.
    """
    from llmhealth.daemon import Daemon  # noqa: PLC0415 - only the daemon needs these
    from llmhealth.eventloop import run  # noqa: PLC0415
    from llmhealth.openfiles import raise_file_limit  # noqa: PLC0415
    from llmhealth.render import console_for_log  # noqa: PLC0415

    if serving_file is not None and not serving_file.strip():
        # `--serving-file "$UNSET"` in a unit was taken for none given: the daemon ran,
        # and the balancer it should feed was never written to, nor its hook run.
        raise typer.BadParameter(
            "an empty serving file path: name a file, or leave it out",
            param_hint="--serving-file",
        )
    if serving_file is not None and config_file is not None:
        config_module.check_serving_config(Path(serving_file), Path(config_file))
    load = _daemon_loader(urls or [], proxy or [], config_file, state, serving_file)
    loaded, targets = load()
    if not targets:
        raise typer.BadParameter("nothing to watch: give backend URLs, --proxy or --config")
    raise_file_limit()  # a connection kept per backend, and the exporter's scrapers
    daemon = Daemon(
        load,
        _daemon_store(loaded, state, config_file),
        listen=None if listen == "off" else _host_port(listen),
        wait_override=_duration(wait, config_module.LONGEST_READ),
        serving_file=None if serving_file is None else Path(serving_file),
        console=console_for_log(),
    )
    raise typer.Exit(run(daemon.run()))


@app.command()
def route(
    urls: UrlsArgument = None,
    config_file: ConfigOption = None,
    state: StateOption = None,
    wait: WaitOption = None,
    listen: Annotated[
        str | None,
        typer.Option(
            "--listen",
            help="HOST:PORT the router serves on (its /metrics included); else the "
            f"config's \\[router] listen, else {DEFAULT_ROUTE_LISTEN}.",
        ),
    ] = None,
) -> None:
    """Route OpenAI-compatible requests to serving backends, and watch them as `watch` does.

    One process, one ledger: probing, settling, restarts and systemd notify as in `watch`,
    plus real-traffic failures counted against the backend that caused them.
    """
    from llmhealth.cycle import routed_backends  # noqa: PLC0415
    from llmhealth.daemon import Daemon  # noqa: PLC0415
    from llmhealth.eventloop import run  # noqa: PLC0415
    from llmhealth.openfiles import raise_file_limit  # noqa: PLC0415
    from llmhealth.render import console_for_log  # noqa: PLC0415
    from llmhealth.router import Router  # noqa: PLC0415

    load = _daemon_loader(urls or [], [], config_file, state)
    loaded, targets = load()
    backends = routed_backends(loaded, targets)
    if not backends:
        raise typer.BadParameter("nothing to route to: give backend URLs or --config")
    # `--listen "$UNSET"` in a unit is refused, as `watch` refuses it: taken for none
    # given, the router served on the config's or the default address, and nothing told.
    given = listen if listen is not None else loaded.router.listen or DEFAULT_ROUTE_LISTEN
    address = _host_port(given)
    wait_seconds = _duration(wait, config_module.LONGEST_READ)
    raise_file_limit()  # each client connection holds a descriptor; see the systemd unit
    router = Router(loaded.router, backends, retry_after=wait_seconds or loaded.wait)
    daemon = Daemon(
        load,
        _daemon_store(loaded, state, config_file),
        listen=None,
        wait_override=wait_seconds,
        serving_file=None,
        console=console_for_log(),
        router=router,
        router_listen=address,
    )
    raise typer.Exit(run(daemon.run()))


DEFAULT_ROUTE_LISTEN = "127.0.0.1:8200"


def _host_port(value: str) -> tuple[str, int]:
    try:
        return config_module.parse_listen(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--listen") from None


def _operator_context(
    config_file: str | None, state: str | None
) -> tuple[config_module.Config, Store, Audit]:
    """Config (or defaults), the store and the audit trail an operator verb works on.

    In a cluster the store is the etcd record, written with a compare on the revision
    read: a verb never overwrites a settle it did not see (nor a settle the verb); its
    audit record is written with it, into the cluster's trail.
    """
    from llmhealth.actions import AuditLog  # noqa: PLC0415
    from llmhealth.cycle import audit_path_for, state_path_for  # noqa: PLC0415
    from llmhealth.state import StateFile  # noqa: PLC0415

    loaded = _config_or_default(config_file)
    if loaded.cluster is not None:  # the record is in etcd: no state path is needed
        from llmhealth.cluster import Etcd, EtcdStore, Keys  # noqa: PLC0415

        etcd = Etcd(loaded.cluster.etcd)
        store = EtcdStore(etcd, Keys(loaded.cluster.prefix), None)
        return loaded, store, store.audit
    path = state_path_for(loaded, state)
    return loaded, StateFile(path), AuditLog(audit_path_for(loaded, path))


def _verb_exit(result: VerbResult) -> None:
    """0 when the ledger took the event; 1 when its rules refused it (nothing changed)."""
    from llmhealth.text import printable  # noqa: PLC0415

    # The message quotes stored words (a hold's reason, a last error): escaped, not raw.
    stream = sys.stdout if result.applied else sys.stderr
    with output_may_fail(stream):  # saved or refused, whoever reads the message
        print(printable(result.message), file=stream)
    raise typer.Exit(0 if result.applied else 1)


NameArgument = Annotated[str, typer.Argument(help="The backend's name, as in the config.")]


@app.command()
def status(
    config_file: ConfigOption = None,
    state: StateOption = None,
    output: FormatOption = OutputFormat.TABLE,
) -> None:
    """Show the ledger as saved by the last check, without touching any server."""
    from llmhealth.operate import read_record  # noqa: PLC0415
    from llmhealth.render import console_for_output, print_status  # noqa: PLC0415
    from llmhealth.report import (  # noqa: PLC0415
        status_exit_code,
        status_json,
        status_nagios,
        summarize,
    )

    loaded, store, _ = _operator_context(config_file, state)
    record = read_record(store, loaded)
    now = time.time()
    snapshots = record.ledger.snapshots(now)
    fleet = summarize(record.ledger)
    cluster = None
    if loaded.cluster is not None:
        from llmhealth.cluster import EtcdStore, describe  # noqa: PLC0415

        assert isinstance(store, EtcdStore)
        cluster = describe(store.etcd, store.keys, store.revision)
    with output_may_fail(sys.stdout):
        if output is OutputFormat.JSON:
            document = status_json(snapshots, record.holds, fleet, now)
            document = {**document, "cluster": cluster} if cluster else document
            print(json.dumps(document, indent=2, allow_nan=False))
        elif output is OutputFormat.NAGIOS:
            print(status_nagios(snapshots, fleet))
        else:
            print_status(snapshots, record.holds, fleet, now, console_for_output())
            if cluster is not None:
                print(_cluster_lines(cluster, now))
    raise typer.Exit(int(status_exit_code(snapshots, fleet)))


def _cluster_lines(cluster: dict[str, Any], now: float) -> str:
    """Who leads, on which lease, and when each member last reported: under the table."""
    from llmhealth.text import printable  # noqa: PLC0415

    leader = cluster["leader"]
    lines = [
        f"cluster {cluster['prefix']}: "
        + (
            f"{leader['member']} leads since {_ago(now, leader['since'])} "
            f"(lease {leader['lease']}, fence {leader['fence']})"
            if leader
            else "NO LEADER: nobody acts on this fleet"
        )
        + f", record revision {cluster['revision']}"
    ]
    for name, value in cluster["members"].items():
        report = value if isinstance(value, dict) else {}
        at, share = report.get("at"), report.get("share")
        seen = _ago(now, at) if isinstance(at, int | float) else "no report yet"
        reads = f", reads {share} backends" if isinstance(share, int) else ""
        lines.append(f"  member {name}: last report {seen}{reads}")
    # Member names, the prefix and the lease come from etcd, which any member can write:
    # each line is made printable so none of them can drive the operator's terminal.
    return "\n".join(printable(line) for line in lines)


def _ago(now: float, then: float) -> str:
    return f"{max(0.0, now - then):.0f} s ago"


@app.command()
def audit(
    last: Annotated[
        int | None,
        typer.Option("--last", min=0, help="Only the newest N records (default: all kept)."),
    ] = None,
    config_file: ConfigOption = None,
    state: StateOption = None,
) -> None:
    r"""Print the audit trail as JSON lines, oldest first: every ledger move, restart
    decision, command outcome and operator verb, with its evidence.

    From etcd with a \[cluster] config (the trail every leader wrote, with each record's
    member and fence), else from the audit log: the config's audit_log, or the one beside
    the state file.
    """
    from llmhealth.actions import scan  # noqa: PLC0415
    from llmhealth.cycle import audit_path_for, state_path_for  # noqa: PLC0415
    from llmhealth.text import printable  # noqa: PLC0415

    unprintable = 0

    def show(record: dict[str, object]) -> None:
        nonlocal unprintable
        try:
            # ensure_ascii escapes every control character but DEL; nothing a server said
            # reaches the terminal raw.
            line = json.dumps(record, ensure_ascii=True).replace("\x7f", "\\u007f")
        except RecursionError:  # read just under the parser's depth, written from deeper
            unprintable += 1
            return
        print(line)

    loaded = _config_or_default(config_file)
    malformed = 0
    with output_may_fail(sys.stdout):  # `audit | head` reads no further than head does
        if loaded.cluster is not None:
            from llmhealth.cluster import Etcd, Keys, read_audit  # noqa: PLC0415

            etcd, keys = Etcd(loaded.cluster.etcd), Keys(loaded.cluster.prefix)
            shown = 0

            def count_and_show(record: dict[str, object]) -> None:
                nonlocal shown
                shown += 1
                show(record)

            # Printed as parsed, as a file's: held whole as dicts, the trail took seven
            # times its bytes.
            trail = read_audit(etcd, keys, last, count_and_show)
            malformed, where = trail.malformed, loaded.cluster.prefix
            if not shown and not malformed and etcd.get(keys.state) is None:
                # As for a file: an empty trail where a prefix was mistyped read as
                # "nothing happened".
                raise StateError(
                    f"no state at {keys.state} and no audit records under {keys.audit}"
                )
        else:
            state_path = state_path_for(loaded, state)
            path = audit_path_for(loaded, state_path)
            # Printed as read: a log is never rotated, and held whole it took 7 times its size.
            scanned = scan(path, last, show)
            malformed, where = scanned.malformed, str(path)
            if scanned.missing:
                # An empty trail, silently, read as "nothing happened" where a path was
                # mistyped.
                if not state_path.is_file():
                    raise StateError(f"no state at {state_path} and no audit log at {path}")
                with output_may_fail(sys.stderr):
                    print(f"llmhealth: no audit log at {printable(where)} yet", file=sys.stderr)
        malformed += unprintable
    if malformed:
        # The path is the operator's or the config's (a TOML "\u001b" in audit_log), yet
        # printed: escaped, as every other line naming it is.
        with output_may_fail(sys.stderr):
            print(
                f"llmhealth: {malformed} malformed audit lines skipped in {printable(where)}",
                file=sys.stderr,
            )


@app.command()
def readmit(
    name: NameArgument,
    weight_version: Annotated[
        int | None,
        typer.Option(
            min=-MAX_WEIGHT_VERSION,
            max=MAX_WEIGHT_VERSION,
            help="Weight version the backend now serves (e.g. after a weight sync).",
        ),
    ] = None,
    config_file: ConfigOption = None,
    state: StateOption = None,
) -> None:
    """Return a STALE backend to serving: an operator's or trainer's proof that it is good."""
    loaded, store, audit = _operator_context(config_file, state)
    from llmhealth import operate  # noqa: PLC0415

    _verb_exit(operate.readmit(store, audit, loaded, name, weight_version))


@app.command()
def retire(
    name: NameArgument,
    reason: Annotated[str, typer.Option("--reason", help="Why, for the audit log.")],
    config_file: ConfigOption = None,
    state: StateOption = None,
) -> None:
    """Take a backend out for good; only 'reset' brings it back (through STALE)."""
    reason = _reason(reason)
    loaded, store, audit = _operator_context(config_file, state)
    from llmhealth import operate  # noqa: PLC0415

    _verb_exit(operate.retire(store, audit, loaded, name, reason))


def _reason(text: str) -> str:
    """An operator's why, for the audit log: refused before anything is read if blank."""
    if not text.strip():
        raise typer.BadParameter("say why, for the audit log", param_hint="--reason")
    return text


@app.command()
def reset(name: NameArgument, config_file: ConfigOption = None, state: StateOption = None) -> None:
    """Bring a RETIRED backend back to STALE, from where it must prove itself again."""
    loaded, store, audit = _operator_context(config_file, state)
    from llmhealth import operate  # noqa: PLC0415

    _verb_exit(operate.reset(store, audit, loaded, name))


@app.command()
def hold(
    name: NameArgument,
    duration: Annotated[str, typer.Option("--for", help="How long, e.g. '30m', '2h'.")],
    reason: Annotated[str, typer.Option("--reason", help="Why, for the audit log.")],
    config_file: ConfigOption = None,
    state: StateOption = None,
) -> None:
    """Keep restarts away from a backend for a while (e.g. a weight sync); checks go on."""
    seconds = _duration(duration)
    assert seconds is not None
    reason = _reason(reason)
    from llmhealth import operate  # noqa: PLC0415

    loaded, store, audit = _operator_context(config_file, state)
    _verb_exit(operate.hold(store, audit, loaded, name, seconds, reason))


@app.command()
def release(
    name: NameArgument, config_file: ConfigOption = None, state: StateOption = None
) -> None:
    """End a hold early."""
    loaded, store, audit = _operator_context(config_file, state)
    from llmhealth import operate  # noqa: PLC0415

    _verb_exit(operate.release(store, audit, loaded, name))


config_app = typer.Typer(
    help="Work with configuration files.", no_args_is_help=True, rich_markup_mode="rich"
)
app.add_typer(config_app, name="config")


@config_app.command("check")
def config_check(
    path: Annotated[str, typer.Argument(help="The TOML file to validate.")],
    for_reload: Annotated[
        bool,
        typer.Option(
            "--for-reload",
            help="Check it as the new config of a `watch` or `route` started with --config "
            "alone (the units' ExecReload): one naming no backend or proxy, which its "
            "reload refuses, is refused. A changed \\[cluster], state or audit_log, which "
            "the reload refuses too, is not seen here.",
        ),
    ] = False,
) -> None:
    """Validate a config file: exit 0 when usable, 3 naming the first problem (file and
    key) otherwise; mend it and run again for the next."""
    from llmhealth.text import printable  # noqa: PLC0415

    loaded = config_module.load(path)
    shown = printable(path)  # typed by the operator, yet printed: no escape runs raw
    # ExecReload runs this in the unit's environment: a key variable missing there is a
    # reload the daemon would refuse, and must fail here too.
    if unset := config_module.unset_key_variables(loaded):
        raise config_module.ConfigError(f"{path}: {'; '.join(unset)}")
    if not loaded.backends and not loaded.proxies:
        if for_reload:
            # The daemon has no URLs on its command line: it would forget every backend,
            # with its retirement, proof and budget, so it refuses the reload; fail it here.
            raise config_module.ConfigError(
                f"{path}: no [[backend]] or [[proxy]]: nothing to watch, and a daemon "
                "started with --config alone refuses to reload it"
            )
        # Said, not refused: `watch -c FILE URL...` takes its targets from its command line,
        # which this cannot see. Without them the daemon refuses the reload, in its log.
        with output_may_fail(sys.stderr):  # a note: the verdict is the exit code
            print(
                f"{shown}: note: no [[backend]] or [[proxy]]: watch, route and check need "
                "URLs on their command line with it, or refuse it (a reload too)",
                file=sys.stderr,
            )
    commands = [(f"backend {b.name}: restart", b.restart) for b in loaded.backends]
    commands.append(("on_serving_change", loaded.on_serving_change))
    # Noted, not refused: the file may be checked on another host than the one it runs
    # on. Where it runs, a program not found makes every restart "not run", its budget
    # spent attempt by attempt until the backend is retired. The program itself is not
    # shown, as a command line may carry a token.
    for what, argv in commands:
        if argv and shutil.which(argv[0]) is None:
            with output_may_fail(sys.stderr):
                print(
                    f"{shown}: note: {what}: its program is not an executable found here"
                    " (an absolute path, or a name on this PATH)",
                    file=sys.stderr,
                )
    restartable = sum(1 for backend in loaded.backends if backend.restart)
    with output_may_fail(sys.stdout):
        print(
            f"{shown}: ok: {len(loaded.backends)} backends ({restartable} with a restart "
            f"command), {len(loaded.proxies)} proxies, wait {loaded.wait:g}s, timeout "
            f"{loaded.timeout:g}s"
        )


@app.command()
def simulate(
    modes: Annotated[
        list[str],
        typer.Argument(
            help="One simulated backend per mode, on consecutive ports: idle, busy, prefill, "
            "wedge:SECONDS, wedge-one:SECONDS, unanswered, hang, restart:SECONDS, no-metrics, "
            "multiproc, asleep, proxy:URL,URL; combine with '+', e.g. busy+multiproc."
        ),
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the first backend.")] = 8100,
    max_num_seqs: Annotated[
        int, typer.Option(help="Request slots per backend, as vLLM's --max-num-seqs.")
    ] = 4,
    model: Annotated[str, typer.Option(help="Model id served.")] = "tiny",
    engines: Annotated[int, typer.Option(help="Data-parallel engines per backend.")] = 1,
    request_seconds: Annotated[
        float, typer.Option(help="How long one synthetic request holds its slot.")
    ] = 4.0,
    age: Annotated[
        float,
        typer.Option(
            help="Seconds before its real start each simulated process says it started "
            "(process_start_time_seconds); 0 shows a young process, judged with "
            "startup_wedge_after."
        ),
    ] = 3600.0,
    keep_alive: Annotated[
        float,
        typer.Option(
            help="Seconds an idle client connection stays open: 5 as vLLM's default "
            "(VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so a reader every 5 s reconnects as there."
        ),
    ] = 5.0,
) -> None:
    """Serve simulated vLLM backends for demos, tests and benchmarks (until Ctrl-C)."""
    from llmhealth.simulate import SimulateError, run  # noqa: PLC0415 - only loaded to serve

    try:
        run(
            modes,
            host=host,
            port=port,
            max_num_seqs=max_num_seqs,
            model=model,
            engines=engines,
            request_seconds=request_seconds,
            age=age,
            keep_alive=keep_alive,
        )
    except SimulateError as exc:
        print(f"llmhealth simulate: {exc}", file=sys.stderr)
        raise typer.Exit(ExitCode.UNKNOWN) from None


@app.command()
def demo() -> None:
    """Start a simulated fleet and show check, watch, route and a takeover on it (about 45 s).

    One check; `watch` proving a wedge and restarting it; `route` serving a client while a
    backend wedges; with etcd installed, two daemons on one fleet and the leader killed.
    Everything it started stops by itself, and on Ctrl-C."""
    from llmhealth.demo import run_demo  # noqa: PLC0415 - only the demo needs it
    from llmhealth.render import console_for_output  # noqa: PLC0415

    raise typer.Exit(run_demo(console_for_output()))


def _fleet(
    urls: list[str], proxies: list[str], config_file: str | None
) -> tuple[config_module.Config, list[Target]]:
    """The config (or defaults) and every target: configured ones first, then bare URLs."""
    loaded = _config_or_default(config_file)
    try:
        return loaded, config_module.targets_for(loaded, urls, proxies)
    except config_module.BadTargetError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.hint) from exc


def _print(report: CycleReport, output: OutputFormat) -> None:
    from llmhealth.render import console_for_output, print_report  # noqa: PLC0415
    from llmhealth.report import as_json, nagios_line  # noqa: PLC0415

    if output is OutputFormat.JSON:
        # as_json maps non-finite numbers to null; allow_nan=False makes a miss an error
        # (exit 3) instead of an Infinity that strict JSON parsers reject.
        print(json.dumps(as_json(report), indent=2, allow_nan=False))
    elif output is OutputFormat.NAGIOS:
        print(nagios_line(report))
    else:
        print_report(report, console_for_output())


def main() -> None:
    """Entry point: every way a run can end maps to one exit code here."""
    _open_standard_streams()
    try:
        _main()
    finally:
        _settle_outputs()


def _open_standard_streams() -> None:
    """Descriptors 0 to 2 open, on /dev/null where a launcher closed them, and stdout and
    stderr streams on them. Python starts a process whose descriptor 1 or 2 is closed
    (``>&-``) with ``sys.stdout`` or ``sys.stderr`` None: every verb's output and error
    then raised, a CRITICAL check exited 1 with "internal error", a hold that was saved
    read "refused", and `watch` died at its first log line. And the first file or socket
    opened took the closed descriptor's number, where a write to it would have gone."""
    for descriptor in (0, 1, 2):
        try:
            os.fstat(descriptor)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free: this one
            if null != descriptor:
                os.dup2(null, descriptor)
                os.close(null)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the process's own, for its life
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the process's own, for its life


def _settle_outputs() -> None:
    """Flush what stdout and stderr still buffer, and send it to /dev/null if it cannot be
    written: a daemon's log lines lost to a full disk or a terminal that hung up (dropped
    as they came) stayed buffered, and the interpreter's own flush at exit failed, so a
    SIGTERM's orderly stop of `watch` exited 120 instead of 0."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            discard_output(stream)
        except ValueError:  # closed
            pass


def _main() -> None:
    for stream in (sys.stdout, sys.stderr):
        # A latin-1 or ASCII terminal (a cron mail, an old locale) cannot print "→": a verb
        # that had saved its change then exited 3, and a check's CRITICAL read UNKNOWN.
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    try:
        # Outside standalone mode click hands back typer.Exit's code instead of exiting.
        code = app(standalone_mode=False)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        _cannot_check("interrupted")
    except typer.TyperException as exc:  # usage errors: bad arguments or options
        _cannot_check(exc.format_message() or "no command given (the help above lists them)")
    except (config_module.ConfigError, StateError, AuditError) as exc:
        # These may quote what etcd or a file said: printable before the terminal.
        from llmhealth.text import printable  # noqa: PLC0415

        _cannot_check(printable(str(exc)))
    except Exception:  # a bug of ours must not read as a CRITICAL server
        traceback.print_exc()
        _cannot_check("internal error (the traceback above is a bug report)")
    sys.exit(code if isinstance(code, int) else 0)


def _cannot_check(message: str) -> NoReturn:
    """UNKNOWN, saying why on stderr, and on stdout too when a Nagios line or JSON was
    asked for: a plugin runner (NRPE, Icinga) reads stdout only, and shows an empty one
    as "no output returned from plugin" instead of the reason; a script piping JSON to
    a parser got nothing to parse, and no exit_code in it."""
    with output_may_fail(sys.stderr):
        print(f"llmhealth: {message}", file=sys.stderr)
    asked = _format_asked(sys.argv[1:])
    with output_may_fail(sys.stdout):
        if asked is OutputFormat.NAGIOS:
            from llmhealth.text import nagios_text  # noqa: PLC0415

            print(f"LLMHEALTH UNKNOWN - {nagios_text(message)}")
        elif asked is OutputFormat.JSON:
            print(json.dumps({"exit_code": int(ExitCode.UNKNOWN), "error": message}, indent=2))
    sys.exit(ExitCode.UNKNOWN)


def _format_asked(args: list[str]) -> OutputFormat | None:
    """The ``--format`` the command line asks for, read from the words alone: the verb
    that would know never ran."""
    for word, following in zip(args, [*args[1:], ""], strict=False):
        given = following if word in ("--format", "-f") else None
        for prefix in ("--format=", "-f"):
            if given is None and word.startswith(prefix) and word != "-f":
                given = word.removeprefix(prefix)
        if given in (OutputFormat.NAGIOS, OutputFormat.JSON):
            return OutputFormat(given)
    return None
