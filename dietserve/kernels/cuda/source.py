"""CUDA source of compiled kernels: finding it in a module and checking its inner loops.

Lets CUDA schedules be checked where there is no GPU: code generation runs on any machine.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import tvm_ffi
from tvm import tirx


def find_cuda_source(module: tvm_ffi.Module) -> str | None:
    """The CUDA source of the first ``cuda`` module among ``module``'s imports (depth-first)."""
    if module.kind == "cuda":
        return module.inspect_source()
    for imported in module.imports:
        source = find_cuda_source(imported)
        if source is not None:
            return source
    return None


def cuda_source(func: tirx.PrimFunc, arch: str) -> str:
    """Compile ``func`` for ``arch`` (e.g. "sm_90") and return the device module's CUDA source."""
    import tvm
    from tvm.target import Target


    executable = tvm.compile(func, Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm"}))
    source = find_cuda_source(executable.mod)
    if source is None:
        raise RuntimeError("the compiled module holds no CUDA source")
    return source


_CONDITIONAL = re.compile(r"\bif\s*\(|\?|\bmin\(|\bmax\(")
_FMA = re.compile(r"^(\w+)\[(.+)\] = \(\1\[\2\] \+ \(.+ \* .+\)\);$")
# A tensor-core multiply-accumulate: WMMA's, or PTX mma.sync in inline assembly.
_MMA = re.compile(r"\bwmma::mma_sync\(|\bmma\.sync\.")
_THREAD_INDEX = re.compile(r"\b(threadIdx|blockIdx)\.")


@dataclass
class _Scope:
    """A braced region of the generated source: a loop, a branch, or the kernel body."""

    header: str
    items: list[str | _Scope] = field(default_factory=list)

    @property
    def is_loop(self) -> bool:
        return self.header.startswith("for ")

    @property
    def is_branch(self) -> bool:
        return self.header.startswith(("if ", "if(", "} else", "else"))

    def statements(self) -> Iterator[str]:
        for item in self.items:
            if isinstance(item, _Scope):
                yield item.header
                yield from item.statements()
            else:
                yield item


def _parse(source: str) -> _Scope:
    """Nest the codegen's one-statement-per-line output by its braces."""
    root = _Scope("")
    stack = [root]
    for raw in source.splitlines():
        line = raw.strip()
        if line.startswith("}") and len(stack) > 1:
            stack.pop()
            line = line[1:].strip()
            if not line:
                continue
            line = "} " + line
        if line.endswith("{"):
            scope = _Scope(line)
            stack[-1].items.append(scope)
            stack.append(scope)
        elif line:
            stack[-1].items.append(line)
    return root


def _fma_sites(scope: _Scope, enclosing: tuple[_Scope, ...] = ()) -> Iterator[tuple[str, tuple[_Scope, ...]]]:
    """Each accumulation ``acc[x] = (acc[x] + (a * b))`` or tensor-core mma with the scopes
    around it, outermost first."""
    for item in scope.items:
        if isinstance(item, _Scope):
            yield from _fma_sites(item, (*enclosing, item))
        elif _FMA.match(item) or _MMA.search(item):
            yield item, enclosing


def _may_check_elements(branch: _Scope, enclosing: tuple[_Scope, ...]) -> bool:
    """Whether ``branch`` can be a per-element check: its condition can vary only inside a loop
    or with the thread's index. Outside both it guards a whole step for every thread alike (a
    software pipeline's last step when the step count is symbolic)."""
    outer = enclosing[: enclosing.index(branch)]
    return any(scope.is_loop for scope in outer) or bool(_THREAD_INDEX.search(branch.header))


def inner_loop_has_bound_checks(source: str) -> bool:
    """Whether any multiply-accumulate (FMA or tensor-core mma) of the generated CUDA ``source``
    runs under a conditional.

    That is: an FMA or mma statement holding a ternary or min/max, an ``if`` around one that
    may check elements (``_may_check_elements``), or any
    conditional in the outermost FMA-holding loop below the shared-memory step (the innermost
    loop with a ``__syncthreads``, whose fills may check bounds). Raises ValueError when the
    source has no FMA statement at all, since then there is nothing to check.
    """
    sites = list(_fma_sites(_parse(source)))
    if not sites:
        raise ValueError("no multiply-accumulate statement found in the CUDA source")
    for statement, enclosing in sites:
        if _CONDITIONAL.search(statement) or any(
                scope.is_branch and _may_check_elements(scope, enclosing) for scope in enclosing):
            return True
        fma_loops = []
        for scope in reversed(enclosing):
            if any("__syncthreads" in line for line in scope.statements()):
                break
            if scope.is_loop:
                fma_loops.append(scope)
        if fma_loops and any(_CONDITIONAL.search(line) for line in fma_loops[-1].statements()):
            return True
    return False
