"""Conveyor installed as a user installs it: the wheel, into a fresh virtual environment beside
Hugging Face's `kernels` and the newest transformers, used from a directory outside the
repository. Conveyor must work there and leave every other distribution working: a top-level
`kernels` of ours once replaced theirs, and transformers 5.25 imports it to build any model.

The same checks run in the CPU image where a Docker engine answers; without one that test is
skipped, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from tests.infra.contract import DOCKERFILES, ROOT, makefile_torch_version

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

LINE = {
    "custom_id": "one",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "temperature": 0},
}

# Run by the environment's python from a directory outside the repository: transformers still
# builds a model, and `import kernels` is Hugging Face's package.
TRANSFORMERS_STILL_WORKS = textwrap.dedent(
    """
    import kernels, transformers
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)
    assert callable(kernels.get_kernel), kernels.__file__
    print(transformers.__version__, type(model).__name__, kernels.__file__)
    """
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _run(argv: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv, cwd=cwd, env=_clean_env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{' '.join(argv)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _build_wheel(out: Path) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], cwd=out.parent)
    [wheel] = out.glob("conveyor-*.whl")
    return wheel


def _top_level_names(python: Path, cwd: Path) -> set[str]:
    """What the installed conveyor distribution put at the top of site-packages."""
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted({f.parts[0] for f in m.distribution('conveyor').files})))"
    )
    return set(json.loads(_run([str(python), "-c", code], cwd=cwd).stdout))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh venv with torch (the Makefile's), Hugging Face's kernels, the newest transformers
    and the conveyor wheel with its worker extra; and a working directory outside the repo."""
    root = tmp_path_factory.mktemp("install")
    wheel = _build_wheel(root / "dist")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    torch = f"torch=={makefile_torch_version()}"
    _run([str(python), "-m", "pip", "install", "-q", torch], cwd=root, timeout=900)
    _run(
        [str(python), "-m", "pip", "install", "-q", "--upgrade", "kernels", "transformers", f"{wheel}[worker]"],
        cwd=root,
        timeout=900,
    )
    work = root / "work"
    work.mkdir()
    return python, work


def test_transformers_builds_a_model_beside_conveyor(installed):
    python, work = installed
    out = _run([str(python), "-c", TRANSFORMERS_STILL_WORKS], cwd=work).stdout
    assert Path(out.split()[-1]).is_relative_to(python.parents[1]), out  # theirs, in the venv


def test_nothing_but_conveyor_lands_at_the_top_of_site_packages(installed):
    python, work = installed
    tops = _top_level_names(python, work)
    assert {t for t in tops if not t.endswith(".dist-info") and t != ".."} == {"conveyor"}, sorted(tops)


def test_the_cli_answers_one_line_and_migrates_sqlite(installed):
    python, work = installed
    conveyor = python.parent / "conveyor"
    assert "run a whole job in this process" in _run([str(conveyor), "--help"], cwd=work).stdout
    model = work / "model"
    _run([str(python), "-m", "conveyor.testing.tiny_models", "--out", str(model), "--hidden-size", "32"], cwd=work)
    (work / "in.jsonl").write_text(json.dumps(LINE) + "\n")
    home = work / "home"
    _run(
        [str(conveyor), "run", "in.jsonl", "--model", str(model), "-o", "out.jsonl", "--errors", "errors.jsonl"],
        cwd=work,
        timeout=300,
        CONVEYOR_HOME=str(home),
    )
    [line] = [json.loads(x) for x in (work / "out.jsonl").read_text().splitlines()]
    assert line["custom_id"] == "one" and line["response"]["status_code"] == 200, line
    assert line["response"]["body"]["usage"]["completion_tokens"] >= 1, line
    db_home = work / "db-home"
    done = _run([str(conveyor), "db", "upgrade"], cwd=work, CONVEYOR_HOME=str(db_home))
    assert "schema revision" in done.stdout + done.stderr and (db_home / "conveyor.db").exists()


def test_uninstalling_conveyor_leaves_hugging_faces_kernels_intact(installed):
    python, work = installed
    _run([str(python), "-m", "pip", "uninstall", "-y", "-q", "conveyor"], cwd=work)
    try:
        out = _run([str(python), "-c", TRANSFORMERS_STILL_WORKS], cwd=work).stdout
        assert Path(out.split()[-1]).stat().st_size > 0
    finally:  # this module's other tests may run after this one
        [wheel] = (python.parents[1].parent / "dist").glob("conveyor-*.whl")
        _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], cwd=work)


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0


def test_the_cpu_image_passes_the_same_checks(tmp_path):
    if not _docker_answers():
        pytest.skip("no Docker engine answers here: the CPU image is not built, so its install is not checked")
    tag = "conveyor-install-test:latest"
    _run(["docker", "build", "-f", str(DOCKERFILES["cpu"]), "-t", tag, str(ROOT)], cwd=ROOT, timeout=3600)
    docker = ["docker", "run", "--rm", "--entrypoint", "python", tag]
    out = _run([*docker, "-c", TRANSFORMERS_STILL_WORKS], cwd=tmp_path).stdout
    assert "LlamaForCausalLM" in out
    _run(["docker", "run", "--rm", tag, "--help"], cwd=tmp_path)
    _run(["docker", "run", "--rm", "-e", "CONVEYOR_HOME=/tmp/h", tag, "db", "upgrade"], cwd=tmp_path)
