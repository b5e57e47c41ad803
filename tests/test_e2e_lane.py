"""The e2e lane (e2e/, real vLLM) says what it found: a scenario fails, it never skips itself.

A scenario that skipped when a function of llmhealth was renamed (it once asked
``hasattr(remediate, "remediate")``) would turn a broken restart path into a green lane.
Only a missing external tool may skip (nginx, in e2e/conftest.py), and it says so.
"""

from __future__ import annotations

import ast
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent / "e2e"


# What turns a scenario into anything but a pass or a failure: skip/skipif marks and
# pytest.skip(), importorskip(), xfail marks and pytest.xfail() (an xfail is no failure,
# the lane stays green), pytest.exit(), and unittest's SkipTest raised by hand.
_SKIPPING = frozenset({"skip", "skipif", "importorskip", "xfail", "exit", "SkipTest"})


def skips_in(path: Path) -> list[str]:
    """Every skip a file can make, reached as an attribute (``pytest.skip``) or by a name
    imported from pytest or unittest (``from pytest import skip``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in _SKIPPING:
            if node.attr == "exit" and not (
                isinstance(node.value, ast.Name) and node.value.id == "pytest"
            ):
                continue  # sys.exit() in the lane's scripts
            found.append(f"{path.name}:{node.lineno}: {node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "pytest",
            "_pytest",
            "unittest",
        ):
            found.extend(
                f"{path.name}:{node.lineno}: {alias.name}"
                for alias in node.names
                if alias.name in _SKIPPING or alias.name == "*"
            )
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


def test_the_skip_finder_sees_xfail_exit_and_skips_imported_by_name(tmp_path: Path) -> None:
    # An xfail leaves the lane green as a skip does; a skip imported by name is no
    # attribute of pytest at its call.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pytest\nfrom pytest import skip as later\nfrom unittest import SkipTest\n"
        "@pytest.mark.xfail(reason='x')\ndef test_a():\n    pytest.xfail('y')\n"
        "    pytest.exit('z')\n    later('w')\n    raise SkipTest('v')\n"
    )
    assert skips_in(sample) == [
        "sample.py:2: skip",
        "sample.py:3: SkipTest",
        "sample.py:4: xfail",
        "sample.py:6: xfail",
        "sample.py:7: exit",
    ]
