"""The lint check that keeps run reports (hosts, past runs, timings) out of comments and docstrings."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lint.check_code_history import check, main

CLEAN = '''"""Times each shape on both engines by turns, so a slow spell of the host falls on both."""

CPUS = ("sapphirerapids", "emeraldrapids")  # code may name CPUs


def ratio(a: float, b: float) -> str:
    # a comment that says why, not what was measured
    return f"{a / b:.2f}x in {a * 1e3:.1f} ms"
'''

VIOLATIONS = {
    "host name": '"""Chosen on a shared 2-core VM."""\n',
    "run history": "# found in an ad hoc run, minutes later\nx = 1\n",
    "measured ratio": 'def f():\n    """Made seq 384 1.8x slower."""\n',
    "measured time": "x = 1  # 14 us a call\n",
}


def test_a_clean_file_passes(tmp_path: Path) -> None:
    (tmp_path / "clean.py").write_text(CLEAN)
    assert check([tmp_path]) == []
    assert main([str(tmp_path)]) == 0


@pytest.mark.parametrize("rule", sorted(VIOLATIONS))
def test_a_violation_in_prose_fails_with_its_file_and_line(tmp_path: Path, rule: str) -> None:
    (tmp_path / "clean.py").write_text(CLEAN)
    (tmp_path / "bad.py").write_text(VIOLATIONS[rule])
    findings = check([tmp_path])
    assert [(f.path.name, f.rule) for f in findings] == [("bad.py", rule)]
    assert findings[0].line == (2 if rule == "measured ratio" else 1)
    assert main([str(tmp_path)]) == 1


def test_generated_protocol_code_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "_proto").mkdir()
    (tmp_path / "_proto" / "gen.py").write_text(VIOLATIONS["host name"])
    assert check([tmp_path]) == []


def test_an_allowed_finding_is_not_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(VIOLATIONS["measured time"])
    assert check([tmp_path], allowed=frozenset({(bad.as_posix(), "measured time")})) == []
