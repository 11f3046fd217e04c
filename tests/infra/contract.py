"""What the infra files may say about the ``conveyor`` CLI, the settings and the package, and the
helpers the infra tests share to check it.

The CLI is checked against the real parser (``worker.entrypoints.cli.build_parser``). What the
infra already uses but the CLI does not have yet is listed once, in ``PLANNED``: each entry
lands with other work (the HTTP API's ``serve``, the metrics server's ``--metrics-port``, the
worker half of issue 12), and as soon as the parser has it, the real parser checks it instead.
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

# Commands and flags the infra uses before the CLI has them: command -> flag -> the type of its
# value (None: a flag without a value). A whole planned command is listed with all its flags.
PLANNED: dict[str, dict[str, Callable[[str], Any] | None]] = {
    "worker": {
        # The worker half of issue 12.
        "--exit-when-idle": float,
        "--drain-timeout": float,
    },
}

# What each long-running command serves over HTTP: the flag that sets its port, and its paths.
# The worker's /healthz and /readyz (on its metrics port) land with the worker half of issue 12.
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
    planned: list[str] = field(default_factory=list)

    def value(self, flag: str) -> str:
        value = self.options.get(flag)
        assert value is not None, f"`conveyor {' '.join(self.argv)}` has no {flag} value"
        return value

    def port(self) -> int:
        """The port this command serves HTTP on."""
        return int(self.value(SERVED[self.command][0]))


def build_parser() -> argparse.ArgumentParser:
    from worker.entrypoints.cli import build_parser as real_parser

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
    """``argv`` (what follows ``conveyor``) must be a command line the CLI accepts, or accepts
    once the ``PLANNED`` flags land: the real parser parses what it knows, and each planned
    flag's value must convert to its planned type."""
    argv = [str(a) for a in argv]
    assert argv, "an empty conveyor command line"
    parser = build_parser()
    commands = _subcommands(parser)
    command = argv[0]
    planned = PLANNED.get(command, {})
    if command not in commands:
        assert command in PLANNED, f"`conveyor {command}` is not a command (nor a planned one)"
        options, positionals = _split(argv[1:], lambda name: (planned[name] is not None) if name in planned else None)
        assert not positionals, f"`conveyor {' '.join(argv)}`: unexpected {positionals}"
        for flag, value in options.items():
            convert = planned.get(flag)
            assert flag in planned, f"`conveyor {command}` has no flag {flag} (planned: {sorted(planned)})"
            if convert is not None:
                convert(value or "")
        return Invocation(command, argv, options, planned=sorted(options))

    sub = commands[command]
    known = sub._option_string_actions

    def takes_value(name: str) -> bool | None:
        if name in known:
            return known[name].nargs != 0
        if name in planned:
            return planned[name] is not None
        return None

    options, _ = _split(argv[1:], takes_value)
    kept: list[str] = [command]
    skipped: list[str] = []
    i = 1
    while i < len(argv):
        token = argv[i]
        name = token.partition("=")[0]
        if token.startswith("--") and name not in known:
            assert name in planned, f"`conveyor {command}` has no flag {name} (nor a planned one)"
            convert = planned[name]
            value = options[name]
            if convert is not None:
                convert(value or "")
            skipped.append(name)
            i += 2 if (convert is not None and "=" not in token) else 1
            continue
        kept.append(token)
        i += 1
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(kept)
    except SystemExit as exc:
        raise AssertionError(f"`conveyor {' '.join(argv)}` does not parse: {err.getvalue().strip()}") from exc
    return Invocation(command, argv, options, planned=skipped)


def settings_variables() -> set[str]:
    """Every ``CONVEYOR_*`` variable the settings read."""
    from worker.core.settings import Settings

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
