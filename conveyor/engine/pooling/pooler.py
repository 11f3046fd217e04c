"""Embedding requests in the engine: the batch builder's ``RowHook`` that pools the prompt's
final hidden states into one vector as its chunks run.

A pooling request is an ordinary request sampled once (``max_tokens=1``): it is scheduled,
chunked, prefix-cached and preempted like any other, and the one sampled token finishes it
in the step that computes its last prompt token, so its KV blocks are freed as the vector
comes out. This hook reads the rows its pooling needs from each chunk (the last prompt row;
the first; or all of them, summed across chunks) and, at the last chunk, writes the vector
into the request's ``PoolingState`` (this add-on's own output state, never read for
scheduling). A preempted request recomputes from position 0, which restarts the sum.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.core.request import Request
from conveyor.engine.core.step_result import StepResult
from conveyor.engine.models.model_config import ModelSpec
from conveyor.engine.pooling.pooling_config import PoolingConfig, ResolvedPooling, read_pooling_config
from conveyor.engine.pooling.pooling_params import PoolingParams
from conveyor.engine.pooling.pooling_state import PoolingState
from conveyor.engine.pooling.scoring import ScoreHead
from conveyor.engine.runner.batch import LogitsOf, RowPlan, StepRows
from conveyor.engine.sampling_params import SamplingParams


def pool_vector(hidden: torch.Tensor, params: ResolvedPooling) -> torch.Tensor:
    """The final vector from a pooled (float32) hidden state: truncated, then normalised."""
    vec = hidden if params.dimensions is None else hidden[: params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, p=2, dim=0)
    return vec


def _rows(pooling: str, start: int, n: int, num_prompt: int) -> list[int]:
    """Offsets into a chunk over positions ``[start, start + n)`` that the pooling reads."""
    end = min(start + n, num_prompt)
    if pooling == "last":
        return [num_prompt - 1 - start] if start <= num_prompt - 1 < end else []
    if pooling == "cls":
        return [0] if start == 0 else []
    return list(range(end - start))


class PoolingHook:
    def plan(self, reqs: list[Request], num_new: list[int], first_rows: list[int]) -> list[RowPlan]:
        plans = []
        for req, n, first in zip(reqs, num_new, first_rows, strict=True):
            state = req.pooling
            if state is None:
                continue
            start = req.num_computed_tokens
            offsets = _rows(state.params.pooling, start, n, req.num_prompt_tokens)
            if offsets:
                plans.append(RowPlan(req, [first + o for o in offsets], (start, start + n >= req.num_prompt_tokens)))
        return plans

    def collect(self, plans: list[RowPlan], logits_of: LogitsOf, result: StepResult) -> None:
        if not isinstance(logits_of, StepRows):
            raise RuntimeError("pooling needs the step's hidden states, which this executor does not keep")
        for plan in plans:
            state = plan.req.pooling
            assert state is not None  # planned for it
            start, last_chunk = plan.data
            if state.scorer is not None:  # a score request: its head reads its row (one, whole prompt)
                if last_chunk:
                    state.score = state.scorer(logits_of, plan.rows)
                continue
            rows = logits_of.hidden(plan.rows).float()
            if state.params.pooling == "mean":
                part = rows.sum(dim=0)
                state.total = part if start == 0 or state.total is None else state.total + part
                pooled = state.total / plan.req.num_prompt_tokens
            else:
                pooled = rows[0]
            if last_chunk:
                state.embedding = pool_vector(pooled, state.params).cpu().tolist()
                state.total = None


class EngineEmbedding:
    """What the engine knows of embedding and scoring: the model's pooling, or why it cannot
    embed; its scoring head, or why it cannot score (``conveyor.engine.pooling.scoring``)."""

    def __init__(
        self,
        config: PoolingConfig | None,
        hidden_size: int,
        refusal: str | None,
        generates: bool = True,
        score: ScoreHead | str = "this engine was built without a scoring head",
    ) -> None:
        self.config = config
        self.hidden_size = hidden_size
        self.refusal = refusal  # why this engine embeds nothing (None: it can)
        self.generates = generates  # False for an encoder, which has no vocabulary head
        self.score = score  # the scoring head, or why score requests are refused

    def request(self, params: SamplingParams) -> tuple[SamplingParams, PoolingState | None]:
        """A request's sampling (one greedy token, for an embedding request) and its pooling
        state (None for generation); ``ValueError`` when this engine cannot embed it."""
        if params.pooling is None and not self.generates:
            raise ValueError("this model is an encoder: it embeds (send embedding requests) and cannot generate text")
        if params.pooling is None:
            return params, None
        assert isinstance(params.pooling, PoolingParams)  # SamplingParams turned a dict into one
        if params.n != 1:
            raise ValueError(f"an {'embedding' if params.pooling.task == 'embed' else 'score'} request has n=1")
        if params.pooling.task == "score":
            if isinstance(self.score, str):
                raise ValueError(f"this model cannot score: {self.score}")
            resolved = ResolvedPooling(pooling=self.score.pooling, normalize=False, dimensions=None)
            state = PoolingState(resolved, scorer=self.score.scorer)
        elif self.refusal is not None or self.config is None:
            raise ValueError(f"this model cannot embed: {self.refusal}")
        else:
            state = PoolingState(self.config.resolve(params.pooling, self.hidden_size))
        sampling = replace(
            params,
            max_tokens=1,
            min_tokens=0,
            temperature=0.0,
            logprobs=None,
            prompt_logprobs=None,
            structured_outputs=None,
            stop=None,
            stop_token_ids=None,
            logit_bias=None,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            stream=False,
        )
        return sampling, state


def embedding_support(
    model_dir: Path, spec: ModelSpec, config: EngineConfig, score: ScoreHead | str
) -> EngineEmbedding:
    """The engine's embedding: the checkpoint's pooling (``conveyor.engine.pooling.pooling_config``), or why
    its requests for vectors are refused (a generation model with no usable pooling config
    still generates). An encoder only embeds (one whose pooling files are refused is refused at
    load); without sentence-transformers' files it pools the mean, as sentence-transformers
    does for a plain encoder checkpoint. ``score``: the model's scoring head, or why it has none."""
    hidden_size, generates = spec.hidden_size, not spec.encoder
    if config.parallel.tensor_parallel_size > 1:
        why = "embedding under tensor parallelism is not supported"
        return EngineEmbedding(None, hidden_size, why, generates, "scoring under tensor parallelism is not supported")
    default = PoolingConfig(pooling="mean", normalize=False) if spec.encoder else PoolingConfig()
    try:
        pooling = read_pooling_config(model_dir, default) if model_dir.is_dir() else default
    except ValueError as exc:
        if spec.encoder and isinstance(score, str):  # (it can do nothing else: refused at load)
            raise ValueError(f"this encoder cannot embed: {exc}; nor score: {score}") from None
        return EngineEmbedding(None, hidden_size, str(exc), generates, score)
    return EngineEmbedding(pooling, hidden_size, None, generates, score)
