"""Constrained decoding: one request's grammar as masks over the target's next-token distributions.

A `TokenConstraint` holds an llguidance matcher advanced by every committed output token.
For a verify block [pending token, d1..dk] it gives the (k+1, V) allowed-token mask: row i
is what the grammar allows after d1..di as well. The drafted tokens are consumed
speculatively only up to the first one the grammar refuses (acceptance stops there, so the
rows after it are never used and allow everything), then rolled back; `commit` advances the
matcher by what the session kept. The target's log-probabilities are masked and renormalised
before any sampling, greedy choice or rejection test, so output is exactly the constrained
target's whatever the drafter proposes: a drafted token outside the grammar has probability
zero and is rejected. Once the grammar is satisfied the stop tokens are allowed too; once it
is complete, only they are.

llguidance is an optional dependency (the `serve` extra): it is imported when a constraint
is built, never by the decode loop itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import DFlashError

INSTALL_HINT = "pip install 'mlx-dflash[serve]'"
# Whitespace between JSON tokens: a few spaces, or line breaks and indentation (pretty-printing), and
# no more: unbounded whitespace lets a model spend its whole budget on it inside an unfinished object.
JSON_WHITESPACE = r"(?:[\x20\x09]{1,4}|(?:\x0D?\x0A){1,2}[\x20\x09]{0,40})"
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
SPECIAL_PREFIX = b"\xff"  # how llguidance marks special tokens in a byte table

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StructuredOutputUnavailable(DFlashError):
    """Constrained decoding cannot run here (llguidance missing, a tokenizer it cannot read)."""


class GrammarError(DFlashError):
    """A schema or grammar that cannot be compiled into a constraint."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputUnavailable(
            f"structured output needs the llguidance package, which is not installed ({INSTALL_HINT})") from None
    return llguidance


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind an mlx-lm TokenizerWrapper or a transformers fast tokenizer."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", inner)
    if not hasattr(backend, "to_str"):
        raise StructuredOutputUnavailable(
            f"structured output needs a fast (`tokenizers`) tokenizer; this model's is {type(inner).__name__}")
    return backend


def _stop_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None) or [getattr(tokenizer, "eos_token_id", None)]
    return sorted(int(t) for t in ids if t is not None)


class _LiteralVocabulary:
    """A vocabulary whose token strings are their own text (word- or character-level, no byte
    alphabet), in the shape llguidance's `TokenizerWrapper` reads."""

    def __init__(self, backend: Any, stop: list[int]):
        vocab = backend.get_vocab(with_added_tokens=True)
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.tokens = [b""] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            self.tokens[i] = (SPECIAL_PREFIX if i in special else b"") + text.encode("utf-8")
        self.special_token_ids = sorted(special)
        self.eos_token_id = stop[0] if stop else None
        self.bos_token_id = None
        self._backend = backend

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._backend.encode(text, add_special_tokens=False).ids


def grammar_tokenizer(tokenizer: Any) -> Any:
    """The llguidance tokenizer for a model's tokenizer (built once per tokenizer: ~1 s for a large vocabulary).

    Byte-level BPE and SentencePiece tokenizers are read from their `tokenizer.json`; a vocabulary
    whose decoder llguidance does not know (word- or character-level) is read token by token.
    """
    try:
        return _tokenizers[tokenizer]
    except (KeyError, TypeError):
        pass
    llg = _llguidance()
    backend, stop = _backend(tokenizer), _stop_ids(tokenizer)
    try:
        built = llg.LLTokenizer(backend.to_str(), eos_token=stop or None)
    except ValueError as first:
        if type(backend.decoder).__name__ not in ("Fuse", "NoneType"):
            raise StructuredOutputUnavailable(f"llguidance cannot read this model's tokenizer: {first}") from None
        built = llg.LLTokenizer(llg.TokenizerWrapper(_LiteralVocabulary(backend, stop)), eos_token=stop or None)
    try:
        _tokenizers[tokenizer] = built
    except TypeError:  # not weakly referenceable: built again next time
        pass
    return built


def json_schema_grammar(schema: dict | None, tokenizer: Any = None) -> str:
    """The llguidance grammar for JSON matching `schema` (None: any JSON object); a schema it
    cannot compile raises `GrammarError` naming the problem."""
    llg = _llguidance()
    try:
        schema = ANY_JSON_OBJECT if schema is None else schema
        # A schema's own "x-guidance" options (llguidance's) decide its whitespace.
        defaults = None if "x-guidance" in schema else {"whitespace_pattern": JSON_WHITESPACE}
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None
    return _validated(grammar, tokenizer, "the JSON schema")


def lark_grammar(lark: str, tokenizer: Any = None) -> str:
    """The llguidance grammar for a grammar in its Lark syntax (which embeds JSON schemas as `%json {...}`);
    one it cannot compile raises `GrammarError` naming the problem."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the grammar cannot be compiled: {e}") from None
    return _validated(grammar, tokenizer, "the grammar")


def _validated(grammar: str, tokenizer: Any, what: str) -> str:
    failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        raise GrammarError(f"{what} is not supported for structured output: {messages[0]}")
    return grammar


class TokenConstraint:
    """One generation's grammar state, as allowed-token masks over a `vocab_size` vocabulary."""

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int, stop_tokens: Iterable[int]):
        self.matcher = _llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self.stop_tokens = frozenset(t for t in stop_tokens if 0 <= t < vocab_size)
        if not self.stop_tokens:
            raise ValueError("a constraint needs a stop token to end the output with")
        self._stop = np.array(sorted(self.stop_tokens))
        self._words = min(tokenizer.vocab_size, vocab_size)  # the grammar's vocabulary, as far as the target's goes
        self._grammar_eos = np.array([t for t in tokenizer.eos_tokens if t < self._words], dtype=np.int64)
        self.rejected_drafts = 0  # drafted tokens the grammar refused (each cycle's first)

    CHECKED = 16  # a mask allowing this few tokens has each one checked against the parser

    @classmethod
    def for_json(cls, tokenizer: Any, schema: dict | None, vocab_size: int) -> TokenConstraint:
        """JSON matching `schema` (None: any object), ended by the tokenizer's stop tokens."""
        grammar_tok = grammar_tokenizer(tokenizer)
        return cls(grammar_tok, json_schema_grammar(schema, grammar_tok), vocab_size, _stop_ids(tokenizer))

    @property
    def complete(self) -> bool:
        """The grammar takes no more tokens: only a stop token may follow."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens the grammar allows next (stop tokens where it is satisfied)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self.matcher.get_error()}")
        row = np.zeros(self.vocab_size, dtype=bool)
        row[: self._words] = bits[: self._words]
        row[self._grammar_eos] = False  # the grammar's end is our stop tokens, decided below
        few = np.flatnonzero(row)
        if len(few) <= self.CHECKED:  # where text the vocabulary cannot spell is forced, the mask can
            for token in few:  # let through a token the parser then refuses (an unknown-token id)
                row[token] = self.matcher.validate_tokens([int(token)]) == 1
        # Satisfied, or a dead end the vocabulary cannot continue: the output may (must) end here.
        if self.matcher.is_accepting() or not row.any():
            row[self._stop] = True
        return row

    def rows(self, draft: Sequence[int]) -> np.ndarray:
        """(len(draft) + 1, V) bool: row i allows what may follow the committed tokens and draft[:i].

        Rows after the first drafted token the grammar refuses (or a stop token) are all True:
        verification never keeps a token past that point.
        """
        out = np.ones((len(draft) + 1, self.vocab_size), dtype=bool)
        consumed = 0
        for i, token in enumerate(draft):
            out[i] = self.allowed()
            if not out[i, token]:
                self.rejected_drafts += 1
                break
            if token in self.stop_tokens:
                break  # the output ends there
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"drafted token {token} is outside the grammar: {self.matcher.get_error()}")
            consumed += 1
        else:
            out[len(draft)] = self.allowed()
        if consumed and not self.matcher.rollback(consumed):
            raise RuntimeError(f"constrained decoding could not roll back the draft: {self.matcher.get_error()}")
        return out

    def mask(self, logprobs: mx.array, draft: Sequence[int]) -> mx.array:
        """`logprobs` (len(draft) + 1, V) restricted to `rows(draft)` and renormalised."""
        allowed = mx.array(self.rows(draft))
        masked = mx.where(allowed, logprobs, mx.array(-mx.inf, dtype=logprobs.dtype))
        return masked - mx.logsumexp(masked, axis=-1, keepdims=True)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the grammar by tokens the session kept (a stop token ends them)."""
        for token in tokens:
            if token in self.stop_tokens:
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"committed token {token} is outside the grammar: {self.matcher.get_error()}")
