"""The layering in ARCHITECTURE.md, enforced: who may import whom, and no import circles.

Every import statement counts, at module level or inside a function, under ``TYPE_CHECKING``
or not, so a circle cannot be hidden behind a function-level import either.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "conveyor"  # the one importable package; its parts below
PACKAGES = ("engine", "kernels", "testing", "worker")

# worker/'s layers, lowest first: each may import only the layers before it (and itself).
WORKER_LAYERS = ("core", "store", "batchio", "jobs", "execution", "metrics", "broker", "api", "entrypoints")
# The engine's runtime never imports testing/ (tiny models, the bench driver); its command line,
# ``python -m conveyor.engine --example``, builds a tiny model with it.
ENGINE_USES_TESTING = {"conveyor.engine.__main__"}

# Modules directly under worker/ that only give public names their historic paths
# (``celery -A conveyor.worker.app``, ``from conveyor.worker.client import Client``): they sit above every layer.
WORKER_PUBLIC_PATHS = {"conveyor.worker", "conveyor.worker.app", "conveyor.worker.client"}

# The HTTP stack: only the api layer (and the entrypoints that start it) may use it.
HTTP = {"fastapi", "starlette", "uvicorn", "python_multipart"}

# Third-party packages a layer must not use, so its job stays its own.
FORBIDDEN = {
    "conveyor.engine": {"celery", "kombu", "sqlalchemy", "alembic", "boto3", "botocore", "pydantic_settings", *HTTP},
    "conveyor.kernels": {"celery", "kombu", "sqlalchemy", "alembic", "boto3", "transformers", *HTTP},
    "conveyor.worker.core": {"torch", "celery", "kombu", "sqlalchemy", "boto3", *HTTP},
    "conveyor.worker.store": {"torch", "celery", "kombu", *HTTP},
    "conveyor.worker.batchio": {"torch", "celery", "kombu", "sqlalchemy", "boto3", *HTTP},
    "conveyor.worker.jobs": {"torch", "celery", "kombu", *HTTP},
    "conveyor.worker.execution": {"celery", "kombu", *HTTP},
    "conveyor.worker.metrics": {"torch", "celery", "kombu", *HTTP},
    "conveyor.worker.broker": HTTP,
    # The API serves requests: it never loads a model.
    "conveyor.worker.api": {"torch", "transformers"},
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a first-party module, or a third-party top-level package)
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / NAMESPACE / pkg).rglob("*.py"))}


def part_of(module: str) -> str:
    """The part (engine, kernels, worker) a ``conveyor.<part>...`` module belongs to; else its top name."""
    parts = module.split(".")
    return parts[1] if parts[0] == NAMESPACE and len(parts) > 1 else parts[0]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest first-party module that ``name`` names or lies in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str]
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module pkg.mod where there is one.
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is None:
                target = name.partition(".")[0]
            if target != module:
                found.append(Import(module, target, node.lineno))
    return _dedupe(found)


def _dedupe(found: list[Import]) -> list[Import]:
    seen: dict[str, Import] = {}
    for imp in found:
        seen.setdefault(imp.target, imp)
    # ``from pkg import mod`` also listed ``pkg`` itself; keep it only if nothing below it was found.
    return [imp for t, imp in seen.items() if not any(o != t and o.startswith(t + ".") for o in seen)]


def import_graph() -> dict[str, list[Import]]:
    modules = first_party_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def worker_layer(module: str) -> int | None:
    """The layer index of a ``worker.<layer>...`` module; None for the public paths."""
    if module in WORKER_PUBLIC_PATHS:
        return None
    parts = module.split(".")[1:]
    assert module.startswith(f"{NAMESPACE}.worker.") and len(parts) >= 2, module
    assert parts[1] in WORKER_LAYERS, (
        f"{module} is not in a layer: worker/ holds only the layer packages {WORKER_LAYERS} "
        f"and the public paths {sorted(WORKER_PUBLIC_PATHS)}"
    )
    return WORKER_LAYERS.index(parts[1])


def layering_violations(graph: dict[str, list[Import]]) -> list[str]:
    first_party = set(graph)
    problems = []
    for module, imports in graph.items():
        top = part_of(module)
        for imp in imports:
            target_top = part_of(imp.target)
            where = f"{module}:{imp.line} imports {imp.target}"
            if imp.target in first_party:
                if top == "kernels" and target_top != "kernels":
                    problems.append(f"{where}: kernels/ imports nothing of engine/ or worker/")
                elif top == "engine" and target_top == "worker":
                    problems.append(f"{where}: engine/ never imports worker/")
                elif top == "engine" and target_top == "testing" and module not in ENGINE_USES_TESTING:
                    problems.append(f"{where}: engine/'s runtime never imports testing/")
                elif top == "testing" and target_top == "worker":
                    problems.append(f"{where}: testing/ never imports worker/")
                elif top == "worker" and target_top == "worker":
                    mine, theirs = worker_layer(module), worker_layer(imp.target)
                    if theirs is None and mine is not None:
                        problems.append(f"{where}: a layer imports the public paths, not the reverse")
                    elif mine is not None and theirs is not None and theirs > mine:
                        problems.append(
                            f"{where}: layer {WORKER_LAYERS[mine]!r} may not import the higher layer "
                            f"{WORKER_LAYERS[theirs]!r}"
                        )
            else:
                for prefix, banned in FORBIDDEN.items():
                    if (module == prefix or module.startswith(prefix + ".")) and target_top in banned:
                        problems.append(f"{where}: {prefix} must not use {target_top}")
    return problems


def import_cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each a circle."""
    edges = {m: [i.target for i in imps if i.target in graph] for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_every_layer_imports_only_the_layers_below_it() -> None:
    problems = layering_violations(import_graph())
    assert not problems, "\n".join(problems)


def test_there_are_no_import_circles() -> None:
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_worker_holds_only_layer_packages_and_the_public_paths() -> None:
    for module in first_party_modules():
        if module.startswith(f"{NAMESPACE}.worker."):
            worker_layer(module)  # asserts


# ---- the checks themselves catch what they are for ------------------------------------


def _graph_of(sources: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Import]]:
    for name, text in sources.items():
        path = tmp_path.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(tmp_path).parents:
            if parent != Path("."):
                (tmp_path / parent / "__init__.py").touch()
        path.write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    return import_graph()


def test_a_circle_hidden_in_a_function_is_found(tmp_path, monkeypatch) -> None:
    graph = _graph_of(
        {
            "conveyor.engine.attention.selector": (
                "def create():\n    from conveyor.engine.attention import triton_backend\n"
            ),
            "conveyor.engine.attention.triton_backend": "from conveyor.engine.attention.selector import create\n",
        },
        tmp_path,
        monkeypatch,
    )
    assert import_cycles(graph) == [["conveyor.engine.attention.selector", "conveyor.engine.attention.triton_backend"]]


def test_an_upward_or_forbidden_import_is_found(tmp_path, monkeypatch) -> None:
    graph = _graph_of(
        {
            "conveyor.worker.jobs.lifecycle": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from conveyor.worker.broker.queues import RUN_SHARD\n",
            "conveyor.worker.broker.queues": "RUN_SHARD = 'x'\n",
            "conveyor.worker.batchio.readers": "import sqlalchemy\n",
            "conveyor.engine.llm": "from conveyor.worker.jobs import lifecycle\n",
            "conveyor.kernels.reference": "import conveyor.engine.llm\n",
            "conveyor.engine.core.scheduler": "from conveyor.testing import tiny_models\n",
            "conveyor.testing.tiny_models": "import conveyor.worker.jobs.lifecycle\n",
        },
        tmp_path,
        monkeypatch,
    )
    problems = layering_violations(graph)
    assert any("layer 'jobs' may not import the higher layer 'broker'" in p for p in problems), problems
    assert any("conveyor.worker.batchio must not use sqlalchemy" in p for p in problems), problems
    assert any("engine/ never imports worker/" in p for p in problems), problems
    assert any("kernels/ imports nothing" in p for p in problems), problems
    assert any("engine/'s runtime never imports testing/" in p for p in problems), problems
    assert any("testing/ never imports worker/" in p for p in problems), problems


# ---- the map names every module ---------------------------------------------------------


def map_sections(text: str) -> dict[str, str]:
    """ARCHITECTURE.md's package sections: each ``### `conveyor/...` `` heading's paths -> its text."""
    sections: dict[str, str] = {}
    for block in text.split("\n### ")[1:]:
        heading, _, body = block.partition("\n")
        for path in re.findall(r"`(conveyor/[\w/.]+)`", heading):
            sections[path] = body.split("\n## ")[0]
    return sections


def unmapped_modules(root: Path, text: str) -> list[str]:
    """Modules of the package that the section of the folder they live in does not name."""
    sections = map_sections(text)
    missing = []
    for path in sorted((root / NAMESPACE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if path.name in ("__init__.py", "__main__.py") or "/versions/" in rel or rel.count("/") < 2:
            continue
        if rel in sections:  # a module with a heading of its own
            continue
        owner = max((s for s in sections if rel.startswith(s)), key=len, default=None)
        if owner is None or not re.search(rf"`(?:[\w/]*/)?{re.escape(path.stem)}(?:\.py)?`", sections[owner]):
            missing.append(rel)
    return missing


def test_architecture_md_names_every_module() -> None:
    missing = unmapped_modules(ROOT, (ROOT / "ARCHITECTURE.md").read_text())
    assert not missing, "ARCHITECTURE.md does not name these modules in their folder's section:\n" + "\n".join(missing)


def test_an_unmapped_module_is_found(tmp_path) -> None:
    (tmp_path / "conveyor/engine/models").mkdir(parents=True)
    for name in ("llama", "bert"):
        (tmp_path / f"conveyor/engine/models/{name}.py").touch()
    text = "# Map\n\n### `conveyor/engine/`\n\n- `models/`:\n    - `llama`: the Llama family\n"
    assert unmapped_modules(tmp_path, text) == ["conveyor/engine/models/bert.py"]


# ---- and every module the map names exists -----------------------------------------------


def _exists(root: Path, rel: str) -> bool:
    """A ``conveyor/...`` path the map names: a folder, a module (with or without ``.py``), or a file."""
    path = root / rel.rstrip("/")
    return path.exists() or path.with_suffix(".py").exists()


def _module_under(folder: Path, name: str) -> bool:
    """``name`` (``stem``, ``stem.py``, ``sub/``, ``sub/stem.py``): a module or folder somewhere under ``folder``."""
    name = name.rstrip("/").removesuffix(".py")
    return any(folder.rglob(f"{name}.py")) or any(p.is_dir() for p in folder.rglob(name))


def unknown_modules(root: Path, text: str) -> list[str]:
    """What the map names that the tree lacks: every ``conveyor/...`` path; in each package section,
    the module or folder each bullet begins with; every module named in bold (the step's path)."""
    missing = [f"`{p}`" for p in re.findall(r"`(conveyor/[\w/.]+)`", text) if not _exists(root, p)]
    for folder, body in map_sections(text).items():
        for name in re.findall(r"^\s*- `([a-z_0-9]+/?)`", body, flags=re.M):
            if not _module_under(root / folder, name):
                missing.append(f"{folder}: `{name}`")
    for name in re.findall(r"\*\*`([\w/]+\.py)`\*\*", text):
        if not (_exists(root, name) if name.startswith(f"{NAMESPACE}/") else _module_under(root / NAMESPACE, name)):
            missing.append(f"**`{name}`**")
    return missing


def test_every_module_architecture_md_names_exists() -> None:
    missing = unknown_modules(ROOT, (ROOT / "ARCHITECTURE.md").read_text())
    assert not missing, "ARCHITECTURE.md names modules that do not exist:\n" + "\n".join(missing)


def test_a_module_the_map_names_but_the_tree_lacks_is_found(tmp_path) -> None:
    (tmp_path / "conveyor/engine/core").mkdir(parents=True)
    (tmp_path / "conveyor/engine/core/scheduler.py").touch()
    text = (
        "# Map\n\n### `conveyor/engine/`\n\n- `core/`:\n    - `scheduler`\n    - `waiting_queues`\n"
        "- `sampler`\n\nThe loop: **`core/scheduler.py`**, **`batch.py`**; `conveyor/engine/runner/executors.py`.\n"
    )
    assert unknown_modules(tmp_path, text) == [
        "`conveyor/engine/runner/executors.py`",
        "conveyor/engine/: `waiting_queues`",
        "conveyor/engine/: `sampler`",
        "**`batch.py`**",
    ]
