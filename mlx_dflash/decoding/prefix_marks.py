"""Marks: a session's unrewindable cache states kept at stable places in its prompt.

Recurrent (GatedDeltaNet) and rotating sliding-window caches cannot be trimmed, so a
session holding a long prompt is no use to a request that shares only its beginning.
A mark keeps, at one position, the state of just those caches (references to immutable
MLX arrays: a recurrent layer's fixed-size state, a window's buffer); the trimmable
attention K/V need nothing, they are cut back. Rolled back to a mark, the session is
exactly what feeding its first `length - 1` tokens left.

Marks are placed where prompts are shared: before each message opens (the end of a
system prompt and its tools is where agents' sessions and sub-agents part) and every
`MARK_EVERY` positions of a long stretch without one after the first. They are few and bounded
(`MAX_MARKS`): the first two are kept (a system prompt's end, its first turn's) and
the latest ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

MARK_EVERY = 4096  # positions between marks in a long stretch without a message boundary
MAX_MARKS = 8  # marks one session keeps
FIRST_KEPT = 2  # the earliest marks (where sessions with the same system prompt part) are never thinned
# Special tokens that open a chat message in the families' templates (ChatML, Llama 3, Gemma,
# harmony, DeepSeek, Mistral, Phi).
TURN_OPENERS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "<|start|>", "<｜User｜>",
                "<｜Assistant｜>", "[INST]", "<|user|>", "<|assistant|>", "<|system|>")


@dataclass
class PrefixMark:
    """The unrewindable caches' states when the session's tokens were its first `length`
    (its caches then held `length - 1` positions; the last token was the pending one)."""

    length: int
    states: dict[int, Any]  # cache index -> that cache's `state`, as `TargetModel.checkpoint` keeps it

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in tree_flatten(list(self.states.values())) if isinstance(a, mx.array))


def turn_openers(tokenizer: Any) -> set[int]:
    """Ids of the special tokens that open a message in `tokenizer`'s chat format (may be empty)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return {vocab[name] for name in TURN_OPENERS if name in vocab}


def mark_positions(prompt: Sequence[int], start: int, openers: Iterable[int] = (),
                   every: int = MARK_EVERY) -> list[int]:
    """Cache positions to mark while feeding `prompt[start:]`: before each message opener,
    and every `every` positions where no opener came for that long, from the first opener on
    (so the first marks, which thinning keeps, are where messages part: a system prompt's end).
    A position p means the caches hold `prompt[:p]` (so p >= 2: a shorter mark saves nothing)."""
    openers = set(openers)
    first = next((p for p in range(max(start, 2), len(prompt)) if prompt[p] in openers), start)
    marks: list[int] = []
    last = first
    for p in range(max(start, 2), len(prompt)):
        if prompt[p] in openers:
            marks.append(p)
            last = p
        elif every and p > first and p - last >= every:
            marks.append(p)
            last = p
    return marks


def thin(marks: list[PrefixMark], limit: int = MAX_MARKS) -> list[PrefixMark]:
    """At most `limit` marks: the first `FIRST_KEPT` and the latest."""
    if len(marks) <= limit:
        return marks
    keep_first = min(FIRST_KEPT, limit)
    return marks[:keep_first] + marks[len(marks) - (limit - keep_first):]


def marks_bytes(marks: Iterable[PrefixMark]) -> int:
    return sum(mark.nbytes for mark in marks)
