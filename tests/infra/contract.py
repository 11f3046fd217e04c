"""What the infra files may say about the ``conveyor`` CLI, the settings and the package, and the
helpers the infra tests share to check it.

Every command line the infra holds is checked against the real parser
(``conveyor.worker.entrypoints.cli.build_parser``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli on Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found]

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"

# What each long-running command serves over HTTP: the flag that sets its port, and its paths.
SERVED: dict[str, tuple[str, frozenset[str]]] = {
    "serve": ("--port", frozenset({"/healthz", "/readyz", "/metrics"})),
    "worker": ("--metrics-port", frozenset({"/metrics", "/healthz", "/readyz"})),
}
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"


@dataclass
class Invocation:
    """One ``conveyor ...`` command line, checked: its command and every ``--flag``'s value."""

    command: str
    argv: list[str]
    options: dict[str, str | None] = field(default_factory=dict)

    def value(self, flag: str) -> str:
        value = self.options.get(flag)
        assert value is not None, f"`conveyor {' '.join(self.argv)}` has no {flag} value"
        return value

    def port(self) -> int:
        """The port this command serves HTTP on."""
        return int(self.value(SERVED[self.command][0]))


def build_parser() -> argparse.ArgumentParser:
    from conveyor.worker.entrypoints.cli import build_parser as real_parser

    return real_parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _split(argv: Sequence[str], takes_value: Callable[[str], bool | None]) -> tuple[dict[str, str | None], list[str]]:
    """``--flag value`` / ``--flag=value`` / ``--switch`` pairs and the positionals."""
    options: dict[str, str | None] = {}
    positionals: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--"):
            name, eq, inline = token.partition("=")
            wants = takes_value(name)
            assert wants is not None, f"unknown flag {name}"
            if eq:
                options[name] = inline
            elif wants:
                assert i + 1 < len(argv), f"{name} needs a value"
                options[name] = argv[i + 1]
                i += 1
            else:
                options[name] = None
        else:
            positionals.append(token)
        i += 1
    return options, positionals


def check_invocation(argv: Sequence[str]) -> Invocation:
    """``argv`` (what follows ``conveyor``) must be a command line the real CLI parser accepts."""
    argv = [str(a) for a in argv]
    assert argv, "an empty conveyor command line"
    parser = build_parser()
    commands = _subcommands(parser)
    command = argv[0]
    assert command in commands, f"`conveyor {command}` is not a command"
    known = commands[command]._option_string_actions
    options, _ = _split(argv[1:], lambda name: known[name].nargs != 0 if name in known else None)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`conveyor {' '.join(argv)}` does not parse: {err.getvalue().strip()}") from exc
    return Invocation(command, argv, options)


def settings_variables() -> set[str]:
    """Every ``CONVEYOR_*`` variable the settings read."""
    from conveyor.worker.core.settings import Settings

    return {f"CONVEYOR_{name.upper()}" for name in Settings.model_fields}


def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def makefile_torch_version() -> str:
    match = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile pins no torch version (TORCH_SPEC ?= torch==X)"
    return match.group(1)


def parse_duration(text: str | int | float) -> float:
    """Compose durations ("90s", "1m30s") and plain numbers, in seconds."""
    if isinstance(text, int | float):
        return float(text)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def parse_quantity(text: str | int) -> float:
    """A Kubernetes quantity ("8Gi", "500m", "2") as a number (bytes, cores)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-zA-Z]*)", str(text))
    assert match, f"not a quantity: {text!r}"
    factors = {
        "": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
        "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    }  # fmt: skip
    return float(match.group(1)) * factors[match.group(2)]


# ---- the Dockerfiles ----------------------------------------------------------------------

DOCKERFILES = {"cpu": INFRA / "docker" / "cpu.Dockerfile", "cuda": INFRA / "docker" / "cuda.Dockerfile"}
# The image each Dockerfile builds, as the compose file and the Kustomize overlays name it.
IMAGES = {"cpu": "conveyor", "cuda": "conveyor-cuda"}


@dataclass
class Stage:
    name: str | None
    base: str  # the FROM image, ARGs substituted
    commands: list[Any]  # dockerfile.Command


@dataclass
class Dockerfile:
    path: Path
    args: dict[str, str]  # every ARG's default, global or in a stage
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def env(self, stage: Stage | None = None) -> dict[str, str]:
        out: dict[str, str] = {}
        for cmd in (stage or self.final).commands:
            if cmd.cmd == "ENV":
                out.update(zip(cmd.value[::2], cmd.value[1::2], strict=True))
        return out

    def last(self, instruction: str, stage: Stage | None = None) -> Any:
        found = [c for c in (stage or self.final).commands if c.cmd == instruction]
        assert found, f"{self.path.name}: no {instruction} in its final stage"
        return found[-1]

    def all(self, instruction: str) -> list[Any]:
        return [c for s in self.stages for c in s.commands if c.cmd == instruction]


def read_dockerfile(path: Path) -> Dockerfile:
    """Parsed with BuildKit's own parser (the `dockerfile` package)."""
    import dockerfile

    args: dict[str, str] = {}
    stages: list[Stage] = []
    for cmd in dockerfile.parse_file(str(path)):
        if cmd.cmd == "ARG":
            name, _, default = cmd.value[0].partition("=")
            args[name] = default
        if cmd.cmd == "FROM":
            base = re.sub(
                r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), cmd.value[0]
            )
            name = cmd.value[2] if len(cmd.value) == 3 and cmd.value[1].upper() == "AS" else None
            stages.append(Stage(name, base, []))
        elif stages:
            stages[-1].commands.append(cmd)
    return Dockerfile(path, args, stages)
