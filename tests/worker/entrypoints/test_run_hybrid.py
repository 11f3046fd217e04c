"""``conveyor run`` answers with a tiny Qwen3.5 (hybrid linear-attention) checkpoint: the
whole local path (intake, shard, engine with its state slots, result lines), with the
greedy completions transformers gives."""

from __future__ import annotations

import json

import torch

from conveyor.testing.tiny_models import build_tiny_model
from conveyor.worker.entrypoints.cli import main
from tests.worker.helpers import Stack, make_values, parse_lines

PROMPTS = ["The chef will bring", "Seven guests wait at the table", "Tea"]


def test_run_answers_with_a_tiny_qwen3_5(tmp_path, env, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = str(build_tiny_model(tmp_path / "qwen3_5", "qwen3_5", num_layers=4))
    stack = env(Stack(make_values(tmp_path / "home", model), model))
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": f"c{i}", "prompt": p, "max_tokens": 6, "temperature": 0} for i, p in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["run", str(path), "--model", stack.model, "-o", str(out), "-q", "--no-chat"]
    assert main(argv) == 0, capsys.readouterr().err
    results = {r["custom_id"]: r for r in parse_lines(out.read_text().splitlines())}
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for i, prompt in enumerate(PROMPTS):
        body = results[f"c{i}"]["response"]["body"]
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        expected = tok.decode(ref[0, ids.shape[1] :])
        assert body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["text"] == expected
