"""Structured outputs: a request's grammar (JSON schema, any JSON object, regex, choice, Lark/GBNF
grammar), compiled by llguidance, and the per-row token masks the serving engine samples under.

Requests name a grammar in OpenAI's `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}) or in vLLM's fields
(`structured_outputs` {json | regex | choice | grammar | json_object}, or `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`); at most one (`serve.protocol.request_grammar`).
The server compiles it once per request (`GrammarCompiler.compile`, in a worker thread: llguidance builds its
lexer there): a schema llguidance cannot enforce (an unknown type, `not`, `if`, `uniqueItems`, a
regex with look-arounds, an unknown `format`, ...) or that is not valid is a 400 naming the
problem; the grammar's size is bounded by `Limits.max_grammar_bytes`, and llguidance's own
`LLParserLimits` bound the work of each mask. JSON is generated compact (llguidance's
`whitespace_flexible: false`: no whitespace between tokens, so no runaway whitespace; a schema's
`x-guidance` options override it).

Why llguidance (not xgrammar, whose package requires torch and transformers): a pip wheel with no
torch dependency (torch is test-only here; the masks are plain NumPy int32 bitmasks, filled in
place from several threads without the GIL), grammar compilation in under a millisecond for
typical schemas (no per-schema precompile step), JSON-schema errors and unsupported keywords
reported as messages (our 400s), regex, choice and Lark/GBNF through the same matcher, and it is
what vLLM's `guidance` and SGLang's `llguidance` grammar backends use.

The engine (`GrammarRows`, one per engine): a step with a row under a grammar runs the sampler's
"_masked" program (`serve.step`), whose bitmask [R, ceil(V / 32)] int32 has every bit set for rows
without a grammar, so constrained and free rows share one step. Each constrained sequence gets its
own matcher (a copy of the request's compiled one), advanced lazily to the sequence's output read
so far (the tokens the engine delivered: a preempted, recomputed or migrated sequence catches up
from its output). EOS is allowed exactly when the grammar accepts; once the grammar is complete
only EOS is. With async scheduling the masks of step N+1 need step N's tokens: the engine
dispatches step N+1's forward, then reads step N and computes the masks while the device runs the
forward (`Engine._grammar_masks`), so the host work overlaps the device and free rows wait for
nothing but the sampler.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np

from jaxlora.scheduler.serving import PENDING

log = logging.getLogger("jaxlora.serve")

JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
    """A request's compiled grammar: kind ("json_schema", "json_object", "regex", "choice",
    "grammar"), the llguidance grammar text, and a matcher in its start state that each sequence
    copies (never advanced itself)."""

    kind: str
    grammar: str
    matcher: object


class GrammarError(ValueError):
    """A grammar llguidance refuses (invalid, or with features it cannot enforce)."""


class GrammarCompiler:
    """Compiles grammars for one tokenizer; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer, eos_ids, vocab_size: int):
        """tokenizer: a `jaxlora.tokenizer.Tokenizer` (its HF `tokenizers` backend); eos_ids: the
        tokens that end a sequence (allowed once the grammar accepts); vocab_size: the model's
        (>= the tokenizer's: the ids past the tokenizer's are never allowed)."""
        self._tokenizer, self.eos_ids, self.vocab_size = tokenizer, sorted(eos_ids), vocab_size
        self._lltokenizer = None
        self._lock = threading.Lock()

    def lltokenizer(self):
        import llguidance

        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                           eos_token=self.eos_ids)
            return self._lltokenizer

    def compile(self, kind: str, source) -> Constraint:
        """The Constraint of `source` (a schema dict, a regex, a list of choices, a Lark/GBNF text;
        None for json_object); GrammarError with llguidance's message if it cannot be enforced."""
        import llguidance

        grammar = grammar_text(kind, source)
        tokenizer = self.lltokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed or messages:  # a warning is something llguidance would not enforce
            raise GrammarError("; ".join(messages))
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(kind, grammar, matcher)


def grammar_text(kind: str, source) -> str:
    """llguidance's grammar text of a request grammar (see `GrammarCompiler.compile`)."""
    import llguidance

    try:
        if kind in ("json_schema", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else source
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        return llguidance.grammar_from(kind, source)  # "choice": a list of strings; "grammar": Lark or GBNF
    except ValueError as err:
        raise GrammarError(str(err)) from err


# ---- the engine's masks -------------------------------------------------------------------------
class GrammarRows:
    """The matchers of an engine's sequences under a grammar and their rows' token masks (see the
    module doc). Engine thread only."""

    def __init__(self, vocab_size: int, eos_ids=()):
        self.words = (vocab_size + 31) // 32  # int32 words of a row's bitmask
        self._eos_only = np.zeros(self.words, np.int32)
        for token in eos_ids:
            self._eos_only[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
        self._matchers: dict = {}  # seq_id -> [Sequence, matcher, output tokens it consumed]
        self._executor = None

    @staticmethod
    def constrains(plan_rows) -> bool:
        """Whether a row of a step samples a token of a sequence under a grammar."""
        return any(row.sample and _constraint(row.seq) is not None for row in plan_rows)

    def masks(self, plan_rows, rows: int) -> np.ndarray:
        """[rows, words] int32 bitmask of a step over `plan_rows` (scheduler StepRows, in the step's
        order): each sampling row under a grammar gets its matcher's allowed tokens (the matcher
        first advanced over the sequence's output read so far); every other row every token."""
        import llguidance.numpy

        bitmask = np.full((rows, self.words), -1, np.int32)
        self._forget_finished()
        todo = []
        for r, row in enumerate(plan_rows):
            constraint = _constraint(row.seq)
            if constraint is None or not row.sample or row.seq.finish_reason is not None:
                continue
            matcher = self._synced(row.seq, constraint)
            if matcher.is_error():  # not expected (the mask holds every draw to the grammar): end it
                log.warning("grammar of request %s failed: %s", row.seq.seq_id, matcher.get_error()[:500])
                bitmask[r] = self._eos_only
            else:
                todo.append((matcher, r))
        if todo:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, todo, bitmask)
        return bitmask

    def _synced(self, seq, constraint: Constraint):
        """The matcher of `seq` (a copy of its constraint's on first use) advanced over its output
        up to the first unread (PENDING) token; reset first if the output shrank (preempted)."""
        entry = self._matchers.get(seq.seq_id)
        if entry is None or entry[0] is not seq:
            entry = self._matchers[seq.seq_id] = [seq, constraint.matcher.deep_copy(), 0]
        _, matcher, consumed = entry
        done = len(seq.output)
        while done and seq.output[done - 1] == PENDING:
            done -= 1
        if consumed > done:
            matcher.reset()
            consumed = 0
        if done > consumed:
            matcher.consume_tokens(seq.output[consumed:done])
        entry[2] = done
        return matcher

    def _forget_finished(self) -> None:
        for seq_id, (seq, _, _) in list(self._matchers.items()):
            if seq.finish_reason is not None:
                del self._matchers[seq_id]

    def __len__(self) -> int:
        return len(self._matchers)


def _constraint(seq) -> Constraint | None:
    return getattr(seq.sampling, "structured", None)
