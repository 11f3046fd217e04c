"""Tiny random-weight Qwen3-architecture reasoning models with chat templates written locally
from the families' published formats (no download):

- ``QWEN3_TEMPLATE``: Qwen3's ChatML with tools in the system turn (``<tools>``), past calls as
  ``<tool_call>`` JSON, tool results as ``<tool_response>`` in a user turn, past thinking
  dropped from history, and ``enable_thinking=false`` closing an empty ``<think>`` block in
  the prompt;
- ``OPENS_THINK_TEMPLATE``: the same, with the generation prompt opening ``<think>`` itself
  (QwQ, DeepSeek-R1 and their distills).

``<think>``, ``</think>``, ``<tool_call>`` and ``</tool_call>`` are added tokens that decode as
text (not special), as in Qwen3's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from conveyor.testing.tiny_models import build_tiny_model

ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_QWEN3_BODY = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "<|im_start|>assistant\n{{ content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if content or not loop.first %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}"
    "{%- endfor %}"
)
QWEN3_TEMPLATE = (
    _QWEN3_BODY + "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)
OPENS_THINK_TEMPLATE = _QWEN3_BODY + "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"


def build_reasoning_model(path: str | Path, template: str = QWEN3_TEMPLATE, seed: int = 0) -> Path:
    """A tiny Qwen3 checkpoint whose tokenizer has the thinking and tool tokens and ``template``."""
    from transformers import AutoTokenizer

    path = Path(path)
    build_tiny_model(path, "qwen3", seed=seed, vocab_size=512 + 16)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens(ADDED_TOKENS)
    tok.chat_template = template
    tok.save_pretrained(str(path))
    return path
