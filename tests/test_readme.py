"""The README's "As a library" examples, executed: documentation that cannot rot."""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import pytest
from simproc import running_simulator

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## As a library"
# Blocks that talk to a server use this address; the test swaps in a real simulator's.
PLACEHOLDER = "http://127.0.0.1:8100"


def library_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_library_section_has_examples() -> None:
    assert len(library_blocks()) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(library_blocks())))
def test_a_readme_library_example_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    code = library_blocks()[index]
    with ExitStack() as stack:
        if PLACEHOLDER in code:
            sim = stack.enter_context(running_simulator(["idle"]))
            code = code.replace(PLACEHOLDER, sim.urls[0])
        exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip(), "each example prints what it found"
