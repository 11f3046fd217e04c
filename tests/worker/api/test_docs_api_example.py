"""The docs' HTTP API quick start (docs/user-guide/http-api.md) works as written: its shell lines and its Python are run
here, with only the interpreter, CONVEYOR_HOME, the tiny model's path and the port swapped."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time

import httpx2 as httpx

from tests.worker.helpers import REPO, _die_with_parent
from tests.worker.services import free_port

MARKER = "<!-- api-example -->"
PAGE = "docs/user-guide/http-api.md"


def api_example() -> tuple[list[list[str]], str]:
    text = (REPO / PAGE).read_text()
    assert MARKER in text, f"{PAGE} lost its API example"
    rest = text[text.index(MARKER) :]
    shell = re.search(r"```bash\n(.*?)```", rest, re.S)
    python = re.search(r"```python\n(.*?)```", rest, re.S)
    assert shell is not None and python is not None
    lines = [
        words
        for line in shell.group(1).replace("\\\n", " ").splitlines()
        if (words := shlex.split(line, comments=True))
    ]
    return lines, python.group(1)


def test_the_docs_api_quick_start_runs_as_written(tiny_model, tmp_path) -> None:
    (setup, keys, worker, serve), code = api_example()
    assert setup == ["source", ".venv/bin/activate", "&&", "export", "CONVEYOR_HOME=.cache/conveyor"]
    assert keys[-2:] == [">", "alice.key"] and serve == ["conveyor", "serve"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env |= {"CONVEYOR_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    port = free_port()

    def argv(words: list[str]) -> list[str]:
        assert words[0] == "conveyor", words
        swapped = [tiny_model if w == ".cache/smollm2" else w for w in words[1:]]
        return [sys.executable, "-m", "conveyor.worker.entrypoints.cli", *swapped]

    made = subprocess.run(argv(keys[:-2]), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    (tmp_path / "alice.key").write_text(made.stdout)
    procs = [
        subprocess.Popen(argv(worker), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         preexec_fn=_die_with_parent),
        subprocess.Popen([*argv(serve), "--port", str(port)], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent),
    ]  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:  # the server is up and the worker serves the model
            try:
                models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {made.stdout.strip()}"})
                if "smollm2" in models.text:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server or the worker did not come up"
            time.sleep(0.2)
        script = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        # It printed each result's text (the tiny model's, which may hold anything): no output
        # file, or a result that was not a chat completion, would have raised.
        assert ran.returncode == 0, ran.stderr
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
