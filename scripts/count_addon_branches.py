"""Count the branches inside the engine's core (scheduler, engine loop, runner) that exist only
for an add-on: speculative decoding, tensor parallelism, CUDA graphs, prompt logprobs,
structured outputs, the prefill chunk budget, the CPU thread tuner and sliding-window release.

How it counts. Each core file is parsed (``ast``), at a git revision or in the working tree.
A *branch* is an ``if`` statement, a conditional expression (``a if c else b``), a ``while``
loop, a comprehension's ``if`` clause, or a ``for`` loop. A branch belongs to an add-on when
the names in its condition (for a ``for`` loop: its iterable) name the add-on's state, or when
it sits in a function or method named for the add-on (``_use_cuda_graphs``,
``_execute_parallel``, ``_schedule_lookahead``: everything in such a function is add-on code).
A name "names" an add-on when an identifier or attribute in it matches the add-on's pattern
below; ``spec`` as an attribute (``self.spec``, the model's ``ModelSpec`` on older revisions)
and ``model_spec`` do not count as speculative decoding. A branch is counted once, for the
first add-on it matches, in the order below.

A branch nested in an add-on's branch (an ``if`` in the body of ``if lookahead:``) is that
add-on's too, as everything in a function named for it is.

The core files: the scheduler and the engine loop (``conveyor/engine/core/``), the model runner
and its batch builder (``conveyor/engine/runner/``), each read at its path of the revision (flat
in ``engine/`` before the subsystem folders). The modules where add-ons plug in (the
executors, the row hooks, ``conveyor/engine/spec_decode``, the waiting queues) are the seams,
not the core; ``--seams`` counts ``conveyor/engine/runner/executors.py`` too, for reference.

    python scripts/count_addon_branches.py                 # the working tree
    python scripts/count_addon_branches.py --rev 515c7f8   # a revision
    python scripts/count_addon_branches.py --rev 515c7f8 --rev WORKTREE --json out.json
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each file by its name in the report, then where it has lived: its subsystem folder, flat in engine/.
CORE: dict[str, tuple[str, ...]] = {
    "scheduler.py": ("engine/core/scheduler.py", "engine/scheduler.py"),
    "llm_engine.py": ("engine/core/llm_engine.py", "engine/llm_engine.py"),
    "model_runner.py": ("engine/runner/model_runner.py", "engine/model_runner.py"),
    "batch.py": ("engine/runner/batch.py", "engine/batch.py"),
}
SEAMS: dict[str, tuple[str, ...]] = {"executors.py": ("engine/runner/executors.py", "engine/executors.py")}
WORKTREE = "WORKTREE"

# Add-on -> a pattern an identifier (a name or an attribute) of its state matches in full.
ADDONS: dict[str, str] = {
    "speculative decoding": (
        r"spec|speculat\w*|spec_\w+|\w+_spec_\w*|\w*lookahead\w*|\w*draft\w*|verif\w*|\w*verify\w*|propos\w*"
        r"|new_tokens|\w*rejected\w*"  # a step's multi-token outputs: accepted proposals, rejected ones rolled back
    ),
    "tensor parallelism": r"ranks|rank|tp|tensor_parallel\w*|world_size|\w*_parallel",
    "CUDA graphs": r"\w*graphs?\w*|enforce_eager|bucket",
    "prompt logprobs": r"\w*prompt_logprob\w*|prompt_plans|prompt_rows",
    "structured outputs": r"\w*grammar\w*|\w*structured\w*",
    "chunk budget": r"chunk_controller|chunks|prefills|target_itl\w*|prefill_left|_prefill_budget|prefill",
    "thread tuner": r"\w*tuner\w*|tunable",
    "window release": r"\w*window\w*",
}
# Identifiers that look like an add-on's but are not (the model's ModelSpec).
NOT_ADDON = {"model_spec"}
_PATTERNS = {name: re.compile(rf"(?:{pattern})") for name, pattern in ADDONS.items()}


@dataclass
class Count:
    by_addon: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ADDONS, 0))
    by_file: dict[str, int] = field(default_factory=dict)
    where: list[str] = field(default_factory=list)  # file:line add-on, for a reader to check

    @property
    def total(self) -> int:
        return sum(self.by_addon.values())


def _identifiers(node: ast.AST) -> list[tuple[str, bool]]:
    """(identifier, is an attribute) for every name in ``node``."""
    out: list[tuple[str, bool]] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.append((sub.id, False))
        elif isinstance(sub, ast.Attribute):
            out.append((sub.attr, True))
    return out


def addon_of_names(node: ast.AST) -> str | None:
    for name, pattern in _PATTERNS.items():
        for ident, is_attr in _identifiers(node):
            if ident in NOT_ADDON or (is_attr and ident == "spec"):
                continue
            if pattern.fullmatch(ident):
                return name
    return None


def addon_of_function(name: str) -> str | None:
    """The add-on a function is named for: any ``_``-separated part of its name that matches."""
    parts = name.strip("_").split("_")
    for addon, pattern in _PATTERNS.items():
        if addon == "speculative decoding" and "spec" in parts and "model" in parts:
            continue
        for i in range(len(parts)):
            for j in range(i + 1, len(parts) + 1):
                if pattern.fullmatch("_".join(parts[i:j])):
                    return addon
    return None


class _Visitor(ast.NodeVisitor):
    def __init__(self, path: str, count: Count) -> None:
        self.path = path
        self.count = count
        self.function_addon: list[str | None] = [None]

    def _record(self, node: ast.AST, addon: str | None) -> str | None:
        addon = addon or self.function_addon[-1]
        if addon is not None:
            self.count.by_addon[addon] += 1
            self.count.by_file[self.path] = self.count.by_file.get(self.path, 0) + 1
            self.count.where.append(f"{self.path}:{getattr(node, 'lineno', 0)} {addon}")
        return addon

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.function_addon.append(addon_of_function(node.name) or self.function_addon[-1])
        self.generic_visit(node)
        self.function_addon.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_If(self, node: ast.If) -> None:
        addon = self._record(node, addon_of_names(node.test))
        self.visit(node.test)
        self.function_addon.append(addon)  # the add-on's body: its branches are the add-on's
        for child in node.body:
            self.visit(child)
        self.function_addon.pop()
        for child in node.orelse:
            self.visit(child)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._record(node, addon_of_names(node.test))
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self._record(node, addon_of_names(node.test))
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self._record(node, addon_of_names(node.iter))
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        for cond in node.ifs:
            self._record(cond, addon_of_names(cond))
        self.generic_visit(node)


# Where the package lives: under conveyor/ now, at the top level in revisions before the move.
PACKAGE_ROOTS = ("conveyor/", "")


def read(rev: str, places: tuple[str, ...]) -> str | None:
    """The file's text at ``rev``: the first of its places (under conveyor/, or at the top before the move)."""
    for path in places:
        for where in PACKAGE_ROOTS:
            if rev == WORKTREE:
                file = ROOT / where / path
                if file.exists():
                    return file.read_text()
                continue
            done = subprocess.run(["git", "show", f"{rev}:{where}{path}"], cwd=ROOT, capture_output=True, text=True)
            if done.returncode == 0:
                return done.stdout
    return None


def count(rev: str, files: dict[str, tuple[str, ...]] = CORE) -> Count:
    result = Count()
    for name, places in files.items():
        source = read(rev, places)
        if source is None:
            continue
        result.by_file[name] = 0
        _Visitor(name, result).visit(ast.parse(source))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", action="append", help=f"a git revision, or {WORKTREE} (default: {WORKTREE})")
    parser.add_argument("--seams", action="store_true", help="also count engine/runner/executors.py")
    parser.add_argument("--where", action="store_true", help="list every counted branch")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args(argv)
    files = {**CORE, **SEAMS} if args.seams else CORE
    report = {}
    for rev in args.rev or [WORKTREE]:
        c = count(rev, files)
        report[rev] = {"total": c.total, "by_addon": c.by_addon, "by_file": c.by_file}
        print(f"{rev}: {c.total} add-on branches")
        for addon, n in c.by_addon.items():
            print(f"  {addon:22s} {n}")
        for path, n in c.by_file.items():
            print(f"  {path:28s} {n}")
        if args.where:
            print("\n".join(f"    {w}" for w in c.where))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
