"""The settings of reasoning models."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ReasoningSettings(BaseModel):
    """Reasoning.

    Reasoning models: how a model's thinking is split from its answer.
    """

    # Reasoning models. The parser that splits a model's thinking from its answer: auto (from its
    # family and chat template), none, think (<think>: Qwen3, QwQ, DeepSeek-R1), harmony (gpt-oss), gemma4.
    reasoning_parser: Literal["auto", "none", "think", "harmony", "gemma4"] = "auto"
    # The chat message field the thinking goes to: reasoning (vLLM, OpenRouter) or reasoning_content (DeepSeek).
    reasoning_field: Literal["reasoning", "reasoning_content"] = "reasoning"
    # The thinking budget of a line that names no thinking_token_budget (unset: unbounded thinking).
    thinking_token_budget: int | None = Field(None, ge=0)
