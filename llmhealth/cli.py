"""The command line: thin verbs over the core, and the one place errors become exit codes.

Monitoring convention: 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN. Anything that stops a
check from running at all (bad arguments, bad config, our own bug) is 3, never 2, so an
alert on CRITICAL always means a server, not a typo.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Console

from llmhealth import config as config_module
from llmhealth.classify import Outcome, Target
from llmhealth.probe import ProbeSettings, check_fleet
from llmhealth.render import print_table
from llmhealth.report import ExitCode, as_json, exit_code, nagios_line

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Health checks for LLM inference fleets that read the server's own metrics first.",
)


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"
    NAGIOS = "nagios"


def _duration(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return config_module.parse_duration(_number_or_text(value))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _number_or_text(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


WaitOption = Annotated[
    str | None,
    typer.Option("--wait", help="Time between two reads of a backend (e.g. 5, '5s'). Default 5s."),
]
TimeoutOption = Annotated[
    str | None,
    typer.Option("--timeout", help="Bound on one HTTP read, connect to last byte. Default 5s."),
]
AnswerTimeoutOption = Annotated[
    str | None,
    typer.Option("--answer-timeout", help="Bound on the tiny request. Default 10s."),
]
ConfigOption = Annotated[
    str | None,
    typer.Option("--config", "-c", help="TOML file listing backends, proxies and policy."),
]
FormatOption = Annotated[
    OutputFormat,
    typer.Option("--format", "-f", help="table for people, json for machines, nagios for plugins."),
]


@app.command()
def check(
    urls: Annotated[
        list[str] | None,
        typer.Argument(help="Backend base URLs, e.g. http://10.0.0.5:8000 (read directly)."),
    ] = None,
    proxy: Annotated[
        list[str] | None,
        typer.Option("--proxy", help="A proxy's base URL: checked through /v1/models only."),
    ] = None,
    config_file: ConfigOption = None,
    wait: WaitOption = None,
    timeout: TimeoutOption = None,
    answer_timeout: AnswerTimeoutOption = None,
    output: FormatOption = OutputFormat.TABLE,
) -> None:
    """Check every backend once, print the verdicts, exit 0/1/2/3.

    A backend that shows work is never sent a request: it is judged by whether its engine
    steps between reads. Only a backend with nothing to do gets one tiny request.
    """
    settings, targets = _targets(urls or [], proxy or [], config_file)
    settings = ProbeSettings(
        wait=_duration(wait) or settings.wait,
        timeout=_duration(timeout) or settings.timeout,
        answer_timeout=_duration(answer_timeout) or settings.answer_timeout,
        max_body=settings.max_body,
    )
    if not targets:
        raise typer.BadParameter("nothing to check: give backend URLs, --proxy or --config")
    checked_at = time.time()
    outcomes = asyncio.run(check_fleet(targets, settings))
    _print(outcomes, checked_at, output)
    raise typer.Exit(int(exit_code(outcomes)))


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
) -> None:
    """Serve simulated vLLM backends for demos, tests and benchmarks (until Ctrl-C)."""
    from llmhealth.simulate import run  # noqa: PLC0415 - the server is only loaded to serve

    run(
        modes,
        host=host,
        port=port,
        max_num_seqs=max_num_seqs,
        model=model,
        engines=engines,
        request_seconds=request_seconds,
    )


@app.command()
def demo() -> None:
    """Start a small simulated fleet, check it once, show the verdicts, stop the fleet."""
    from llmhealth.demo import run_demo  # noqa: PLC0415 - only the demo needs it

    raise typer.Exit(run_demo(Console()))


def _targets(
    urls: list[str], proxies: list[str], config_file: str | None
) -> tuple[ProbeSettings, list[Target]]:
    loaded = config_module.load(config_file) if config_file else config_module.Config()
    targets = [
        Target(
            backend.name,
            backend.url,
            "backend",
            api_key=os.environ.get(backend.api_key_env) if backend.api_key_env else None,
            model=backend.expected_model,
        )
        for backend in loaded.backends
    ]
    targets += [Target(proxy.name, proxy.url, "proxy") for proxy in loaded.proxies]
    for url in urls:
        try:
            checked = config_module.check_url(url)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="URL") from exc
        targets.append(Target(config_module.name_for_url(checked), checked, "backend"))
    for url in proxies:
        try:
            checked = config_module.check_url(url)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--proxy") from exc
        targets.append(Target(config_module.name_for_url(checked), checked, "proxy"))
    settings = ProbeSettings(
        wait=loaded.wait,
        timeout=loaded.timeout,
        answer_timeout=loaded.answer_timeout,
        max_body=loaded.max_body,
    )
    return settings, targets


def _print(outcomes: list[Outcome], checked_at: float, output: OutputFormat) -> None:
    if output is OutputFormat.JSON:
        print(json.dumps(as_json(outcomes, checked_at), indent=2))
    elif output is OutputFormat.NAGIOS:
        print(nagios_line(outcomes))
    else:
        print_table(outcomes, Console())


def main() -> None:
    """Entry point: every way a run can end maps to one exit code here."""
    try:
        app(standalone_mode=False)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        print("llmhealth: interrupted", file=sys.stderr)
        sys.exit(ExitCode.UNKNOWN)
    except typer.TyperException as exc:  # usage errors: bad arguments or options
        print(f"llmhealth: {exc.format_message()}", file=sys.stderr)
        sys.exit(ExitCode.UNKNOWN)
    except config_module.ConfigError as exc:
        print(f"llmhealth: {exc}", file=sys.stderr)
        sys.exit(ExitCode.UNKNOWN)
    except Exception:  # a bug of ours must not read as a CRITICAL server
        traceback.print_exc()
        print("llmhealth: internal error (the traceback above is a bug report)", file=sys.stderr)
        sys.exit(ExitCode.UNKNOWN)
    sys.exit(0)
