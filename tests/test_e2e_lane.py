"""The e2e lane (e2e/, real vLLM) says what it found: a scenario fails, it never skips itself.

A scenario that skipped when a function of llmhealth was renamed (it once asked
``hasattr(remediate, "remediate")``) would turn a broken restart path into a green lane.
Only a missing external tool may skip (nginx, in e2e/conftest.py), and it says so.
"""

from __future__ import annotations

import ast
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent / "e2e"


def skips_in(path: Path) -> list[str]:
    """Every skip a file can make: skip/skipif marks, pytest.skip() and importorskip()."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in ("skip", "skipif", "importorskip"):
            found.append(f"{path.name}:{node.lineno}: {node.attr}")
    return found


def test_no_e2e_scenario_can_skip_itself() -> None:
    assert skips_in(E2E / "test_e2e.py") == []


def test_the_only_skip_in_the_e2e_lane_is_for_a_missing_nginx() -> None:
    skips = [skip for path in sorted(E2E.glob("*.py")) for skip in skips_in(path)]
    assert len(skips) == 1 and skips[0].startswith("conftest.py:"), skips
    assert "nginx not installed" in (E2E / "conftest.py").read_text(encoding="utf-8")


def test_the_skip_finder_sees_marks_and_calls(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pytest\n@pytest.mark.skipif(True, reason='x')\ndef test_a():\n"
        "    pytest.skip('y')\n"
    )
    assert skips_in(sample) == ["sample.py:2: skipif", "sample.py:4: skip"]
