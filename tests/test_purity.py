"""The README's promise that pure modules do no I/O, checked for every module it calls pure.

The list comes from the README's own layout (each ``name.py  pure: ...`` line), so a
module described as pure is checked the day it is added, and the claim cannot drift from
the test. Pure means: no import of anything that touches the network, files, processes,
threads or a clock, no call of ``open``, ``print``, ``input`` or a dynamic import, and
no ``.now()``-like clock read (``datetime`` may format a time it was given).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IO_MODULES = frozenset(
    {
        "aiohttp",
        "asyncio",
        "fcntl",
        "httpx",
        "importlib",
        "os",
        "pathlib",
        "rich",
        "selectors",
        "shutil",
        "signal",
        "socket",
        "ssl",
        "subprocess",
        "sys",
        "tempfile",
        "threading",
        "time",
        "urllib",
    }
)
IO_CALLS = frozenset({"open", "print", "input", "__import__", "exec", "eval", "breakpoint"})
# datetime may format an injected ``now``; it may not read the clock itself.
CLOCK_METHODS = frozenset({"now", "today", "utcnow", "monotonic", "perf_counter"})


def pure_modules() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"(\w+)\.py\s+pure:", readme)


def imports_and_calls(source: str) -> tuple[set[str], set[str]]:
    """Top-level names of every absolute import, anywhere in the file, and every bare call."""
    imported: set[str] = set()
    called: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called.add(node.func.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            called.add(f".{node.func.attr}")
    return imported, called


def test_the_readme_names_the_whole_pure_core() -> None:
    assert {"metrics", "classify", "ledger", "fleet", "policy", "report", "text"} <= set(
        pure_modules()
    )


@pytest.mark.parametrize("module", pure_modules())
def test_a_module_the_readme_calls_pure_does_no_io(module: str) -> None:
    imported, called = imports_and_calls(
        (ROOT / "llmhealth" / f"{module}.py").read_text(encoding="utf-8")
    )
    assert imported, "the walk found no imports at all"
    assert not imported & IO_MODULES
    assert not called & IO_CALLS
    assert not called & {f".{method}" for method in CLOCK_METHODS}


def test_the_check_sees_every_form_of_import_and_call() -> None:
    """Guards the test above against passing because the walk misses a form."""
    source = "import os as x\nfrom pathlib import Path\nimport httpx.client\n"
    source += "def f():\n    import subprocess\n    print(open(__import__('time')))\n"
    source += "    return datetime.now()\n"
    imported, called = imports_and_calls(source)
    assert imported == {"os", "pathlib", "httpx", "subprocess"}
    assert {"open", "print", "__import__", ".now"} <= called
