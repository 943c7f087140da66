"""Chat data for drafter training: read conversations, render them, mark assistant tokens.

Accepted files: ShareGPT-style JSON or JSONL (`{"conversations": [{"from", "value"}]}`)
and JSONL of `{"messages": [{"role", "content"}]}`, optionally gzip-compressed.
Conversations are rendered with the target's chat template; the loss mask is
True on the tokens each assistant turn adds (its text and end-of-turn marker).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DFlashError

Message = dict[str, str]
Conversation = list[Message]

ROLE_NAMES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass
class Example:
    """One rendered conversation: token ids and the assistant-token loss mask."""

    ids: list[int]
    mask: list[bool]

    @property
    def num_targets(self) -> int:
        return sum(self.mask)


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _records(path: Path) -> Iterator[Any]:
    try:
        with _open_text(path) as f:
            head = f.read(1)
            while head and head.isspace():
                head = f.read(1)
            if head == "[":  # one JSON array
                yield from json.loads(head + f.read())
                return
            for n, line in enumerate((head + f.readline(), *f), start=1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DFlashError(f"{path}: line {n} is not valid JSON ({e.msg})") from None
    except FileNotFoundError:
        raise DFlashError(f"{path}: no such data file") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DFlashError(f"{path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path}: not valid JSON ({e.msg})") from None


def normalize(record: Any) -> Conversation | None:
    """A record as [{"role", "content"}], or None when it holds no usable conversation."""
    if not isinstance(record, dict):
        return None
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list):
        return None
    out: Conversation = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLE_NAMES.get(str(turn.get("role", turn.get("from", ""))).lower())
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        return None
    return out


def load_conversations(paths: Sequence[str | Path]) -> list[Conversation]:
    """Every usable conversation in the files, in file order."""
    if not paths:
        raise DFlashError("no data files given")
    conversations: list[Conversation] = []
    for p in paths:
        path = Path(p)
        found = [c for c in map(normalize, _records(path)) if c is not None]
        if not found:
            raise DFlashError(f"{path}: no conversations with an assistant turn (ShareGPT or messages format)")
        conversations.extend(found)
    return conversations


def _template(tokenizer: Any, messages: Conversation, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _encode(tokenizer: Any, text: str) -> list[int]:
    # The template writes its own special tokens; the tokenizer must not add more.
    return list(tokenizer.encode(text, add_special_tokens=False))


def render(tokenizer: Any, conversation: Conversation, max_tokens: int) -> Example:
    """Render with the chat template; mask the tokens each assistant turn adds.

    Each assistant span is located by rendering the history up to it (with the
    generation prompt) and through it; a template whose renderings are not
    prefixes of each other leaves that turn unmasked rather than mislabelled.
    """
    ids: list[int] = []
    mask: list[bool] = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = _encode(tokenizer, _template(tokenizer, conversation[:i], True)) if i else []
        full = _encode(tokenizer, _template(tokenizer, conversation[: i + 1], False))
        if full[: len(ids)] != ids or full[: len(prompt)] != prompt or len(prompt) < len(ids):
            break
        mask.extend([False] * (len(prompt) - len(ids)) + [True] * (len(full) - len(prompt)))
        ids = full
        if len(ids) >= max_tokens:
            break
    return Example(ids[:max_tokens], mask[:max_tokens])


def prompt_ids(tokenizer: Any, conversation: Conversation) -> list[int]:
    """The conversation up to its first assistant turn, ready for generation."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    return _encode(tokenizer, _template(tokenizer, conversation[:first], True))


def turn_prompts(tokenizer: Any, conversation: Conversation) -> list[list[int]]:
    """The conversation up to each of its assistant turns, ready for generation (later turns keep the
    data's earlier replies as history)."""
    return [_encode(tokenizer, _template(tokenizer, conversation[:i], True))
            for i, m in enumerate(conversation) if m["role"] == "assistant" and i > 0]


def split_heldout(conversations: list[Conversation], num_heldout: int, seed: int
                  ) -> tuple[list[Conversation], list[Conversation]]:
    """A deterministic (train, held-out) split."""
    order = np.random.default_rng(seed).permutation(len(conversations))
    num_heldout = min(num_heldout, max(len(conversations) - 1, 0))
    heldout = [conversations[i] for i in order[:num_heldout]]
    train = [conversations[i] for i in order[num_heldout:]]
    return train, heldout


class ExampleStream:
    """Rendered training examples in a seeded order, epoch after epoch.

    The position (epoch, index) is all the state there is, so a checkpoint can
    resume the stream exactly.
    """

    def __init__(self, tokenizer: Any, conversations: list[Conversation] | list[Example], *, max_tokens: int,
                 seed: int, min_targets: int = 2):
        """`tokenizer` None: `conversations` are already rendered Examples (cut to `max_tokens`)."""
        if not conversations:
            raise DFlashError("no training conversations left after the held-out split")
        self.tokenizer = tokenizer
        self.conversations = conversations
        self.max_tokens = max_tokens
        self.seed = seed
        self.min_targets = min_targets
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.conversations))

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)

    def next(self) -> Example:
        skipped = 0
        while True:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            conversation = self.conversations[self._order[self.index]]
            self.index += 1
            if self.tokenizer is None:
                example = Example(conversation.ids[: self.max_tokens], conversation.mask[: self.max_tokens])
            else:
                example = render(self.tokenizer, conversation, self.max_tokens)
            # The first assistant token comes from the target's prefill, so a usable
            # example needs at least `min_targets` assistant tokens.
            if example.num_targets >= self.min_targets:
                return example
            skipped += 1
            if skipped > 2 * len(self.conversations):
                raise DFlashError("no conversation renders to enough assistant tokens; raise --seq-len")
