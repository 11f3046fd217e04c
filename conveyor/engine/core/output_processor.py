"""A request's state as the ``RequestOutput`` deltas the engine hands back: new token ids and
text since the last output (streamed through the request's incremental detokenizer, or the whole
text decoded once when it finishes), and copies of what the request keeps growing."""

from __future__ import annotations

from typing import Any, TypeVar

from conveyor.engine.core.request import Request
from conveyor.engine.outputs import RequestOutput

T = TypeVar("T")


def _snapshot(entries: list[T] | None) -> list[T] | None:
    """A copy of a list the request keeps growing (None, for what it did not ask for)."""
    return None if entries is None else list(entries)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def emit(self, req: Request) -> RequestOutput:
        """``req``'s output with what it generated since the last one (none after an error)."""
        if req.error is not None:
            return self.output(req, [], "")
        new_ids = req.output_token_ids[req.num_emitted_tokens :]
        req.num_emitted_tokens = len(req.output_token_ids)
        return self.output(req, new_ids, self._take_text_delta(req))

    def _take_text_delta(self, req: Request) -> str:
        if req.detokenizer is not None:
            return req.detokenizer.take_delta(req.finished)
        return self._text(req) if req.finished else ""

    def _text(self, req: Request) -> str:
        if req.detokenizer is not None:
            return req.detokenizer.text
        if req.final_text is None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
            assert isinstance(text, str)  # one sequence in, one text out
            req.final_text = text
        return req.final_text

    def output(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        finished = req.finished
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=self._text(req),
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics,
            index=req.index,
            stop_reason=req.stop_reason,
            logprobs=_snapshot(req.logprobs),
            prompt_logprobs=_snapshot(req.prompt_logprobs),
            error=req.error,
            prompt=req.prompt_text,
            embedding=req.embedding,
            score=req.pooling.score if req.pooling is not None else None,
        )
