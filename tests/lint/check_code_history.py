"""Keeps run reports out of code comments and docstrings: no host or VM names as descriptions,
no story of past runs, no measured timings or speed ratios. Those belong in docs/, where they
can be dated and redone; a comment says why the code is the way it is.

    python tests/lint/check_code_history.py dietserve tuner tests

Only comments and docstrings (and other bare string statements) are read, through ``tokenize``
and ``ast``: code may name CPUs or print ratios. Exits 1 listing ``file:line: rule: text``.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# "VM" alone is TVM's Relax virtual machine here; only a qualified one is a host.
RULES: dict[str, re.Pattern[str]] = {
    "host name": re.compile(
        r"\b(?:Emerald|Sapphire) Rapids\b|\bZen ?[2-5]\b|\bEPYC\b|\b\d+-(?:core|vCPU)\b"
        r"|\b(?:shared|cloud|guest|bench|CI)\s+(?:[\w-]+\s+)?VMs?\b"),
    "run history": re.compile(
        r"(?i)\bad hoc\b|HISTORY\.md|\bversion[- ]\d+(?:'s)? tune|\ba tune that\b|\bminutes later\b"
        r"|\b(?:first|second|third|\w+th|last|previous|earlier|later|next|this|that) sessions?\b"
        r"|\bsessions? (?:ago|before|\d+)\b"),
    "measured ratio": re.compile(r"\b\d+\.\d+x\b"),
    "measured time": re.compile(r"(?<![\w.])\d+(?:\.\d+)? ?(?:ms|us|µs)\b"),
}
SKIPPED_PARTS = {"_proto", ".venv", "__pycache__", ".git"}
# (path relative to the repository root, rule): findings a reviewer accepted. Keep it short.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.text.strip()[:120]}"


def _bare_string_lines(tree: ast.AST) -> set[int]:
    """First lines of docstrings and other string statements (documentation, never values)."""
    return {node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every comment line and docstring line of ``source``."""
    doc_starts = _bare_string_lines(ast.parse(source))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
        elif token.type == tokenize.STRING and token.start[0] in doc_starts:
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def check_source(source: str, path: Path) -> list[Finding]:
    return [Finding(path, number, rule, text) for number, text in prose(source)
            for rule, pattern in RULES.items() if pattern.search(text)]


def python_files(roots: Iterable[Path]) -> Iterator[Path]:
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        yield from (f for f in files if not SKIPPED_PARTS.intersection(f.parts))


def check(roots: Iterable[Path], allowed: frozenset[tuple[str, str]] = ALLOWED) -> list[Finding]:
    findings = []
    for path in python_files(roots):
        findings += [f for f in check_source(path.read_text(encoding="utf-8"), path)
                     if (path.as_posix(), f.rule) not in allowed]
    return findings


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    findings = check(Path(arg) for arg in argv)
    for finding in findings:
        print(finding)
    if findings:
        print(f"{len(findings)} comment or docstring lines describe runs, hosts or timings: say why the code "
              "is so, and put measurements in docs/", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
