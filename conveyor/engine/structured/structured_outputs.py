"""Structured outputs: decoding constrained by a JSON Schema, a regex, a choice or a grammar.

The grammar engine is llguidance (a Rust library: an Earley parser over a lazy lexer, no
ahead-of-time automaton): this module only turns a ``StructuredOutputs`` into an llguidance
grammar, keeps the compiled grammars in a bounded LRU cache keyed by their text (a million
requests with one schema compile it once), gives each request its own matcher (a cheap copy of
the cached one), and each step fills the token bitmask of every constrained row of the batch
at once and applies it to the logits before sampling.

A matcher lives as long as its request and only ever sees the tokens the request keeps: a
preempted request keeps its generated tokens (they are recomputed, not re-sampled), so its
matcher stays in step with no rollback. Generation ends as soon as the grammar can take no
more text (the request finishes ``stop``); while the grammar is incomplete EOS is masked out.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from conveyor.engine.inputs.errors import InputRejected
from conveyor.engine.inputs.grammar_probe import GrammarProbe
from conveyor.engine.inputs.text_checks import check_text

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

# Bounds on what a request may ask for: a grammar's text is compiled by the engine's thread.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_REGEX_CHARS = 8 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# Compiled grammars kept (each holds one prototype matcher, a few KiB to a few MiB).
GRAMMAR_CACHE_SIZE = 256
# Batches at least this big fill their masks on llguidance's thread pool.
PARALLEL_MASK_MIN_ROWS = 4

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The kinds whose compile time a request controls (a choice's and json_object's are bounded):
# compiled first under the budget, in the probe's child process.
_PROBED_KINDS = frozenset({"json", "regex", "grammar"})
# JSON output is compact: with free whitespace a weak model can pad a value forever.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint on a request's output.

    ``json``: a JSON Schema (a dict or its JSON text); ``json_object``: any JSON object;
    ``regex``: the whole output matches it (Rust ``regex`` syntax); ``choice``: the output is
    one of these strings; ``grammar``: a Lark grammar as llguidance reads it (a GBNF grammar,
    with ``::=`` rules, is converted). Bad values raise ``ValueError`` naming the field.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    # The canonical text of the constraint: what is compiled and what the cache is keyed by.
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        given = [k for k in _KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(_KINDS)}; got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        object.__setattr__(self, "key", (kind, _canonical(kind, getattr(self, kind))))

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputs | None:
        """``value`` as a ``StructuredOutputs``: one already, a dict of its fields (the form a
        JSON request body carries), or ``None``."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_KINDS))
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) {', '.join(map(str, unknown))}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be StructuredOutputs or a dict, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        kind, _ = self.key
        return {kind: getattr(self, kind) if kind != "choice" else list(self.choice or ())}


def _canonical(kind: str, value: Any) -> str:
    where = f"structured_outputs.{kind}"
    if kind == "json":
        return canonical_schema(value, where)
    if kind == "json_object":
        return ""
    if kind == "choice":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"{where} must be a non-empty list of strings")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"{where} has {len(value)} entries; at most {MAX_CHOICES}")
        for c in value:
            if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                raise ValueError(f"{where} entries must be non-empty strings of at most {MAX_CHOICE_CHARS} characters")
            check_text(c, where)
        return json.dumps(list(value), ensure_ascii=False)
    limit = MAX_REGEX_CHARS if kind == "regex" else MAX_GRAMMAR_CHARS
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string")
    if len(value) > limit:
        raise ValueError(f"{where} is {len(value)} characters; at most {limit}")
    check_text(value, where)
    return value


def canonical_schema(schema: Any, where: str = "structured_outputs.json") -> str:
    """A JSON Schema (dict or JSON text) as compact JSON text, bounded in size and depth.
    Key order is kept: it is the order the properties are generated in."""
    if isinstance(schema, str):
        if len(schema.encode("utf-8", "surrogatepass")) > MAX_SCHEMA_BYTES * 2:
            raise ValueError(f"{where} is larger than {MAX_SCHEMA_BYTES} bytes")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} is not JSON-serialisable: {exc}") from None
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"{where} is {size} bytes; at most {MAX_SCHEMA_BYTES}")
    check_text(text, where)
    return text


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (a user's dict can be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Iterable[Any] = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if d > MAX_SCHEMA_DEPTH:  # deep enough to refuse: stop walking
            return d
        stack.extend((c, d + 1) for c in children)
    return deepest


MAX_TOOLS = 128


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """Tools for a chat template (OpenAI's tool objects): a bounded list of JSON objects."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be a list of objects")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    canonical_schema({"tools": tools}, "tools")  # bounded in size and depth, valid text
    return tools


def grammar_text(key: tuple[str, str]) -> str:
    """The llguidance grammar of a canonical constraint."""
    import llguidance

    kind, text = key
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # Lark string literals take JSON's escapes.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if "::=" in text:  # GBNF (llama.cpp's grammar format)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        text = gbnf_to_lark(text)
    return llguidance.LLMatcher.grammar_from_lark(text)


class CompiledGrammar:
    """A grammar checked against the tokenizer, with a prototype matcher to copy."""

    __slots__ = ("_prototype",)

    def __init__(self, prototype: llguidance.LLMatcher) -> None:
        self._prototype = prototype

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("matcher", "num_tokens")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.num_tokens = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; True once the grammar can take no more text.
        ``ValueError`` if the token breaks the grammar (the request then fails)."""
        m = self.matcher
        if not m.consume_token(token_id):
            raise ValueError(f"structured output: token {token_id} rejected by the grammar: {m.get_error()}")
        self.num_tokens += 1
        return m.is_stopped()

    def forced_token(self) -> int | None:
        """A grammar masks through its matcher; only a ``ThinkingGate`` forces single tokens."""
        return None


class Constraint(Protocol):
    """What sits in a request's grammar slot: a ``GrammarMatcher`` or an
    ``conveyor.engine.structured.thinking.ThinkingGate`` (whose matcher is the answer's, once it began)."""

    @property
    def matcher(self) -> llguidance.LLMatcher | None: ...

    def forced_token(self) -> int | None: ...

    def accept(self, token_id: int) -> bool: ...


class Constrained(Protocol):
    """What a batch row needs for masking (an ``conveyor.engine.core.request.Request``)."""

    grammar: Constraint | None


class StructuredOutputManager:
    """Per engine: the llguidance tokenizer, the compiled-grammar cache and the batch masks.

    ``vocab_size`` is the width of the model's logits, which may be larger than the
    tokenizer's vocabulary (padded embeddings): those extra ids are never allowed."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = 0,
        compile_budget_s: float | None = None,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size or GRAMMAR_CACHE_SIZE
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | InputRejected] = OrderedDict()
        self._lock = threading.Lock()
        # None: grammars compile in this process with no time limit (no child process).
        self.compile_budget_s = compile_budget_s
        self._probe: GrammarProbe | None = None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self.stats = GrammarStats()

    # ---- compiling ------------------------------------------------------------------------
    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about a second for a 150k vocabulary)."""
        with self._lock:  # input threads compile at once: build it once
            if self._ll_tokenizer is None:
                import llguidance.hf

                n_vocab, eos = self._vocab_and_eos()
                try:
                    tok = self._hf_tokenizer
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=n_vocab, eos_token=eos)
                except ValueError as exc:  # a slow (Python) tokenizer
                    raise ValueError(f"structured outputs need a fast tokenizer: {exc}") from None
            return self._ll_tokenizer

    def _vocab_and_eos(self) -> tuple[int, list[int] | None]:
        n_vocab = max(self.vocab_size, len(self._hf_tokenizer))
        return n_vocab, [t for t in self._eos if t < n_vocab] or None

    @property
    def probe(self) -> GrammarProbe:
        with self._lock:
            if self._probe is None:
                n_vocab, eos = self._vocab_and_eos()
                self._probe = GrammarProbe(self._hf_tokenizer, n_vocab, eos)
            return self._probe

    def close(self) -> None:
        """Stop the probe's child processes (the engine is shutting down)."""
        if self._probe is not None:
            self._probe.close()

    def compile(self, so: StructuredOutputs | dict[str, Any]) -> CompiledGrammar:
        """The compiled grammar of ``so`` (cached); ``InputRejected`` with the library's reason
        if it cannot be compiled, or ``grammar_too_complex`` past the compile budget (both
        cached too: a million bad lines fail fast)."""
        so = StructuredOutputs.coerce(so) or StructuredOutputs(json_object=True)
        key = so.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
        if hit is None:
            hit = self._compile(key)
            with self._lock:
                self.stats.misses += 1
                self._cache[key] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, InputRejected):
            raise InputRejected(str(hit), hit.code)
        return hit

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar | InputRejected:
        import llguidance

        kind = key[0]
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "choice": "choice"}.get(kind, kind)
        try:
            grammar = grammar_text(key)
        except (ValueError, TypeError, RuntimeError) as exc:
            return InputRejected(f"structured_outputs.{kind}: cannot compile this {what}: {_first_line(exc)}")
        budget = self.compile_budget_s
        if budget is not None and kind in _PROBED_KINDS:
            try:
                error = self.probe.check(grammar, budget, f"structured_outputs.{kind}")
            except InputRejected as exc:
                return exc
        else:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
            error = messages[0] if is_error else None
        if error is not None:
            return InputRejected(f"structured_outputs.{kind}: cannot compile this {what}: {_first_line(error)}")
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return InputRejected(
                f"structured_outputs.{kind}: cannot compile this {what}: {_first_line(matcher.get_error())}"
            )
        return CompiledGrammar(matcher)

    def cache_len(self) -> int:
        return len(self._cache)

    # ---- masking --------------------------------------------------------------------------
    def apply_masks(self, logits: torch.Tensor, reqs: Sequence[Constrained]) -> torch.Tensor:
        """``logits`` with every token its request's grammar forbids at -inf (rows without a
        grammar untouched). All constrained rows' masks are filled in one call. A thinking
        request's slot masks nothing while it thinks, one token while it closes its block under
        a spent budget, and through the answer's grammar after."""
        slots = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None]
        forced = [(i, t) for i, g in slots if (t := g.forced_token()) is not None]
        if forced:
            logits = single_token_mask(logits, [i for i, _ in forced], [t for _, t in forced])
        rows = [(i, m) for i, g in slots if (m := g.matcher) is not None]
        if not rows:
            return logits
        words = (self.ll_tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        row_bytes = words * 4
        if len(rows) >= PARALLEL_MASK_MIN_ROWS:
            pairs = [(m, j) for j, (_, m) in enumerate(rows)]
            self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, len(rows))
        else:
            for j, (_, m) in enumerate(rows):
                m.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), row_bytes)
        self.stats.masks += len(rows)
        forbidden = self._forbidden(bitmask, [i for i, _ in rows], logits.shape, logits.device)
        return logits.masked_fill(forbidden, -math.inf)

    def _forbidden(self, bitmask: torch.Tensor, index: list[int], shape: torch.Size, dev: torch.device) -> torch.Tensor:
        """The (batch, vocab) bool tensor of forbidden tokens: the bitmask's 0 bits on its rows
        (unpacked where the logits are: numpy on CPU, shifts on an accelerator), the columns
        past the grammar's vocabulary on them too, nothing on the other rows."""
        batch, width = shape
        if dev.type == "cpu":
            unpacked = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            rows = torch.from_numpy(unpacked[:, :width] == 0)
        else:
            shifts = self._shifts.get(dev)
            if shifts is None:
                shifts = self._shifts[dev] = torch.arange(32, dtype=torch.int32, device=dev)
            bits = (bitmask.to(dev, non_blocking=True).unsqueeze(-1) >> shifts) & 1
            rows = bits.view(len(index), -1)[:, :width] == 0
        if rows.shape[1] < width:  # logits wider than the grammar's vocabulary: never those
            rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=True)
        rows = rows.to(dev)
        if len(index) == batch:  # every row constrained (index is then 0..batch-1)
            return rows
        forbidden = torch.zeros(shape, dtype=torch.bool, device=dev)
        forbidden[torch.tensor(index, device=dev)] = rows
        return forbidden

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        return self._executor


def single_token_mask(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> torch.Tensor:
    """``logits`` with every token but ``tokens[j]`` at -inf on row ``rows[j]``."""
    dev = logits.device
    rows_t = torch.tensor(rows, device=dev)
    ids = torch.tensor(tokens, device=dev)
    kept = logits[rows_t, ids]
    out = logits.clone()
    out[rows_t] = -math.inf
    out[rows_t, ids] = kept
    return out


@dataclass
class GrammarStats:
    hits: int = 0
    misses: int = 0
    masks: int = 0


def _first_line(error: object) -> str:
    """A library's error on one line: its first line and the ``error:`` lines of a regex
    parser's report (not its source excerpts)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    kept = [lines[0]] + [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(kept)[:500]
