"""10,000 fuzzed lines through the real ``conveyor run`` (a subprocess, embedded defaults, a
tiny model): every non-blank line ends as exactly one result or error, and no traceback."""

from __future__ import annotations

import json
import subprocess

from tests.worker.fuzz_lines import fuzz_file
from tests.worker.helpers import PYTHON, REPO

LINES, VALID = 10_000, 300


def test_every_fuzzed_line_ends_as_one_result_or_error(embedded_stack, tmp_path) -> None:
    fuzz = fuzz_file(LINES, VALID, seed=14)
    path, out, err = tmp_path / "fuzz.jsonl", tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    path.write_bytes(fuzz.data)
    # Garbage that turns out runnable gets 2 tokens, not 256: the run stays short.
    env = embedded_stack.env(max_line_bytes=16 * 1024, default_max_tokens=2, shard_size=200)
    argv = [PYTHON, "-m", "conveyor.worker.entrypoints.cli", "run", str(path), "--model", embedded_stack.model]
    proc = subprocess.run(
        [*argv, "-o", str(out), "--errors", str(err), "-q"], cwd=REPO, env=env, capture_output=True, timeout=300
    )
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr[-3000:]

    results = [json.loads(line) for line in out.read_bytes().splitlines()]
    errors = [json.loads(line) for line in err.read_bytes().splitlines()]
    assert len(results) + len(errors) == LINES
    # A line rejected before it ran names its line; a request that ran and failed (a
    # ``response`` with an HTTP error, ``error`` null) is known by its custom_id, as results are.
    seen = [fuzz.line_of(r["custom_id"]) for r in results]
    seen += [e["error"]["line"] if e["error"] is not None else fuzz.line_of(e["custom_id"]) for e in errors]
    assert sorted(seen) == fuzz.line_numbers  # each line exactly once
    assert len(results) >= VALID  # the valid requests ran (garbage never blocks them)
    assert f"{len(results)} completed, {len(errors)} failed of {LINES}" in stderr
