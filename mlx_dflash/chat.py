"""A multi-turn conversation over one persistent `DecodingSession` (no printing: the CLI renders).

Each turn renders the whole conversation with the chat template and feeds only
the tokens after the longest prefix already committed, so earlier turns are never
recomputed. When the template re-renders past turns differently from what was
generated (end-of-turn markers, stripped thinking, a changed system message), the
session is rolled back to the common prefix first: the state always equals a fresh
session fed the same rendered history.

`save` writes the conversation with its caches to one file (`decoding.session_file`) and
`load` continues it in a later process, on the same models, without recomputing a token:
its next turn feeds only the new message. `on_prefill` is told a prompt's progress chunk by
chunk (the CLI draws a bar for a long one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm.sample_utils import make_sampler

from .auto.policy import AUTO, DEFAULT_BLOCK_SIZE, DEFAULT_TREE_BUDGET, DEFAULT_TREE_SHAPE, make_policy
from .decoding.loop import GenerationEvent, stream_session
from .decoding.prefix_marks import mark_positions, turn_openers
from .decoding.session import DecodingSession, PrefillCancelled, common_prefix
from .decoding.session_file import SessionFileError, load_session, model_fingerprint, read_header, save_session
from .decoding.stats import CycleSummary, GenerationStats
from .decoding.stream_guard import guarded
from .drafters.dflash import DFlashDraftModel
from .errors import DFlashError
from .generate import tree_settings
from .platform.runtime import wired_limit
from .proposers.factory import check_block_size, make_lookup, make_proposer
from .targets.model import TargetModel, as_target

CHAT_FORMAT = 1  # the version of what `ChatEngine.save` puts in a session file's metadata


class ContextOverflowError(DFlashError):
    """The conversation no longer fits the model's context."""


@dataclass
class ChatSettings:
    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 512
    block_size: int | str | None = DEFAULT_BLOCK_SIZE  # "auto" (or None): chosen each cycle; 1: plain
    tree_budget: int | str | None = DEFAULT_TREE_BUDGET  # 0: linear blocks; N: draft trees of N nodes; "auto"
    tree_shape: str | None = DEFAULT_TREE_SHAPE  # "spine" or "paper" (`decoding.tree`)
    think: bool | None = None  # None: the template's default
    system: str | None = None


@dataclass
class ChatEvent:
    """One verify cycle of a reply, with its text split by who produced it."""

    draft_text: str  # text of the accepted proposed tokens (the drafter's or prompt lookup's)
    target_text: str  # text of the target's own token(s)
    event: GenerationEvent

    @property
    def source(self) -> str | None:
        """Who proposed `draft_text`: "dflash", "lookup" (None: nothing proposed was kept)."""
        return self.event.source

    @property
    def text(self) -> str:
        return self.draft_text + self.target_text


@dataclass
class TurnResult:
    reply: str
    tokens: list[int]  # generated tokens (a stop token excluded)
    stats: GenerationStats
    finish_reason: str  # "stop" | "length" | "interrupted"
    new_tokens: int  # prompt tokens the target computed for this turn
    reused_tokens: int  # committed tokens the turn reused from the cache


@dataclass
class SessionTotals(CycleSummary):
    turns: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)  # each cycle's block size
    predicted_tokens: float = 0.0  # `--block-size auto`'s expectation, summed over the cycles
    predicted_seconds: float = 0.0
    decoded_tokens: int = 0  # tokens after each turn's first (which comes from its prefill)
    decode_time: float = 0.0
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # proposed tokens kept: dflash, lookup
    tree_sizes: list[int] = field(default_factory=list)  # each cycle's draft-tree nodes (0: a linear block)

    def add(self, stats: GenerationStats) -> None:
        self.generated_tokens += stats.num_tokens
        self.acceptance_lengths += stats.acceptance_lengths
        self.block_sizes += stats.block_sizes
        self.tree_sizes += stats.tree_sizes
        self.predicted_tokens += stats.predicted_tokens
        self.predicted_seconds += stats.predicted_seconds
        self.decoded_tokens += max(stats.num_tokens - 1, 0)
        self.decode_time += stats.decode_time
        for source, n in stats.accepted_by_source.items():
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + n

    @property
    def measured_tps(self) -> float:
        return self.decoded_tokens / self.decode_time if self.decode_time > 0 else 0.0


class IncrementalText:
    """The text of a growing token list, told piece by piece, decoding only a short window.

    Decoding the whole reply at every cycle costs time quadratic in its length; here each
    `add` decodes the tokens since the last complete piece plus one token before them
    (whose text is context only: a leading space depends on what precedes it).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.window: list[int] = []  # tokens still decoded at each add; the first is context
        self.told = 0  # characters of the window's text already returned

    def add(self, ids: list[int]) -> str:
        """The text the tokens so far add to what earlier calls returned."""
        if not ids:
            return ""
        self.window += ids
        text = self.decode(self.window)
        # An incomplete multi-byte character decodes to U+FFFD: hold it back until completed.
        # (Only past what was told: the context token alone may decode to U+FFFD, a character's tail.)
        piece = text[self.told:].rstrip("\ufffd")
        self.told += len(piece)
        if self.told == len(text) and len(self.window) > 1:
            # All told: keep the last token as the next window's context.
            self.window = self.window[-1:]
            self.told = len(self.decode(self.window))
        return piece


class ChatEngine:
    """Messages, settings and the caches of one conversation."""

    def __init__(
        self,
        model: nn.Module | TargetModel,
        tokenizer: Any,
        draft_model: DFlashDraftModel | Any | None = None,
        settings: ChatSettings | None = None,
        max_context: int | None = None,
        calibration: Any = None,
        prompt_lookup: bool = True,
    ):
        self.target = as_target(model)
        self.tokenizer = tokenizer
        self.draft_model = draft_model
        self.prompt_lookup = prompt_lookup  # proposals read off the conversation (`mlx_dflash.proposers.lookup`)
        self.settings = settings or ChatSettings()
        self.max_block_size = check_block_size(None, draft_model, lookup=prompt_lookup)
        self.calibration = calibration  # seeds `--block-size auto` (`mlx_dflash.auto.calibration`)
        self._check_trees(self.settings)
        self.set_block_size(self.settings.block_size)
        self.max_context = max_context or getattr(self.target.args, "max_position_embeddings", None)
        if not getattr(tokenizer, "chat_template", None):
            raise DFlashError("this model's tokenizer has no chat template; chat needs one")
        self.stop = set(tokenizer.eos_token_ids)
        self.openers = turn_openers(tokenizer)  # where messages open: marks go there (recurrent targets)
        self.messages: list[dict[str, str]] = []
        self.totals = SessionTotals()
        self._stop_requested = False
        # Told (positions computed, positions to compute) as a prompt is prefilled: (0, n) first, then
        # after each chunk. The CLI draws a progress bar for a long prompt.
        self.on_prefill: Callable[[int, int], None] | None = None
        self._fingerprints: dict[str, str] = {}
        self.session = self._new_session()

    # -- state ---------------------------------------------------------------------------
    def _new_session(self) -> DecodingSession:
        proposer = make_proposer(self.target, self.draft_model, self.max_block_size)
        session = DecodingSession(self.target, proposer, lookup=make_lookup(self.prompt_lookup))
        session.progress = self._prefill_progress  # also a rolled-back hybrid target's recomputed prefix
        if self.target.world is None:  # (distributed, every rank would have to agree at every chunk)
            session.cancel_check = lambda: self._stop_requested  # a long prefill stops at its next chunk
        return session

    def _prefill_progress(self, fed: int, total: int) -> None:
        if self.on_prefill is not None:
            self.on_prefill(fed, total)

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and every cache."""
        self.messages = []
        self.totals = SessionTotals()
        self.session = self._new_session()

    def conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        return system + self.messages

    def render(self, messages: list[dict[str, str]] | None = None) -> list[int]:
        """Token ids of the conversation followed by the assistant's generation prompt."""
        kwargs = {} if self.settings.think is None else {"enable_thinking": self.settings.think}
        ids = self.tokenizer.apply_chat_template(
            self.conversation() if messages is None else messages, add_generation_prompt=True, **kwargs
        )
        return list(ids)

    def sync(self, full: list[int]) -> list[int]:
        """Roll the session back to its common prefix with `full`; return the tokens to feed."""
        tokens = self.session.tokens
        keep = common_prefix(tokens, full)
        if keep == len(full):  # nothing new to feed: re-feed the last token
            keep -= 1
        if keep < 1:
            self.session = self._new_session()
        elif keep < len(tokens):
            # Recurrent and rotating caches go back to the latest mark before it (else recomputed).
            self.session.truncate(self.session.reachable(keep) or keep)
        new = full[len(self.session.tokens):]
        if not self.session.rewindable:  # marks: the state before this turn, message openers, the prompt's end
            start = len(self.session.tokens)
            self.session.mark_at = {start - 1, len(full) - 2, *mark_positions(full, start, self.openers)}
        return new

    def _check_trees(self, settings: ChatSettings) -> None:
        """Parse `settings`' tree budget and shape in place; an explicit budget this target and drafter
        cannot verify is refused with the reason (`generate.tree_settings`)."""
        proposer = make_proposer(self.target, self.draft_model, self.max_block_size)
        settings.tree_budget, settings.tree_shape = tree_settings(settings.tree_budget, settings.tree_shape,
                                                                  self.target, proposer)

    def set_trees(self, budget: int | str | None, shape: str | None = None) -> None:
        """A new tree budget (0: linear blocks, N: draft trees of N nodes, "auto") and shape (None: kept);
        refused, the settings unchanged, where this pair cannot verify trees. Rebuilds the policy."""
        given = ChatSettings(tree_budget=budget, tree_shape=self.settings.tree_shape if shape is None else shape)
        self._check_trees(given)
        self.settings.tree_budget, self.settings.tree_shape = given.tree_budget, given.tree_shape
        self.set_block_size(self.settings.block_size)

    def set_block_size(self, n: int | str | None) -> None:
        """"auto" (None too) or a fixed size; the policy's record then spans the conversation.
        The policy verifies draft trees as the settings' `tree_budget` and `tree_shape` say."""
        proposing = self.draft_model is not None or self.prompt_lookup
        if n in (None, AUTO):
            self.settings.block_size = AUTO if proposing else 1
        else:
            if not proposing and n != 1:
                raise DFlashError("block size must be 1 (no drafter and no prompt lookup: plain decoding)")
            if self.draft_model is None and int(n) > self.max_block_size:
                raise DFlashError(f"prompt lookup's block size is at most {self.max_block_size}, not {n}")
            self.settings.block_size = check_block_size(n, self.draft_model, lookup=self.prompt_lookup)
        # One cost and acceptance record per setting: what pays on this machine holds across turns.
        self.policy = make_policy(self.settings.block_size, self.max_block_size, self.calibration,
                                  drafter=self.draft_model is not None, lookup=self.prompt_lookup,
                                  tree_budget=self.settings.tree_budget, tree_shape=self.settings.tree_shape)

    def request_stop(self) -> None:
        """Ask the running reply to stop at the end of its current cycle (signal-safe)."""
        self._stop_requested = True

    # -- a turn --------------------------------------------------------------------------
    def send(self, text: str, keep_partial: bool = True) -> Iterator[ChatEvent]:
        """Add a user message and stream the reply; the generator's return value is a TurnResult.

        Stopped early (`request_stop`, or the caller closing the generator), the partial
        reply is kept as the assistant turn (or dropped with the user message when
        `keep_partial` is false); either way the caches hold exactly what is kept.
        """
        self._stop_requested = False
        messages = self.conversation() + [{"role": "user", "content": text}]
        full = self.target.agree_tokens(self.render(messages))  # distributed: rank 0's rendering on every rank
        room = (self.max_context - len(full)) if self.max_context else None
        if room is not None and room < 1:
            raise ContextOverflowError(
                f"the conversation would be {len(full)} tokens, over the model's context of "
                f"{self.max_context}: /reset to start a new one"
            )
        max_tokens = self.settings.max_tokens if room is None else min(self.settings.max_tokens, room)
        new = self.sync(full)
        reused = len(self.session.tokens)
        self._prefill_progress(0, len(new) + min(reused, 1))  # `extend` computes the pending token too
        self.messages.append({"role": "user", "content": text})
        s = self.settings
        sampler = make_sampler(s.temp, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)
        stream = stream_session(
            self.session, new, sampler, max_tokens=max_tokens, stop=self.stop,
            detokenizer=self.tokenizer.detokenizer, policy=self.policy,
        )
        generated: list[int] = []
        pieces = IncrementalText(self.tokenizer.decode)
        finish, event, reply, cut = "interrupted", None, "", False

        def store(consistent: bool) -> None:
            nonlocal reply
            reply = self._finish_turn(generated, finish, keep_partial, reused, consistent, cut)

        with wired_limit([self.target.model, self.draft_model]), guarded(stream, store) as events:
            try:
                for event in events:
                    split = event.num_draft_accepted
                    draft_text = pieces.add(event.tokens[:split])
                    target_text = pieces.add(event.tokens[split:])
                    generated += event.tokens
                    yield ChatEvent(draft_text, target_text, event)
                    if event.finish_reason:
                        finish = event.finish_reason
                        break
                    # Distributed, rank 0's Ctrl-C stops every rank at the same cycle.
                    if self.target.agree_int(int(self._stop_requested)):
                        break
            except PrefillCancelled:
                cut = True  # stopped between prefill chunks: the chunks fed are committed, consistently
        stats = event.stats if event is not None else GenerationStats(prompt_tokens=len(new))
        self.totals.turns += 1
        self.totals.prompt_tokens += len(new)
        self.totals.add(stats)
        return TurnResult(reply, generated, stats, finish, len(new), reused)

    def _finish_turn(self, generated: list[int], finish: str, keep_partial: bool, reused: int,
                     consistent: bool, cut: bool = False) -> str:
        """Keep the turn in the messages and the session (or drop it); returns the reply's text.
        `cut`: the prefill stopped between chunks; the session keeps what it fed (the next
        turn's `sync` reuses it or rolls it back), which a hybrid target could not get back cheaply."""
        reply = self.tokenizer.decode(generated)
        if not consistent:
            # Stopped mid-cycle: the caches may hold uncommitted work. Start them afresh; the
            # next turn re-feeds the kept history (correct, only slower).
            self.session = self._new_session()
        if finish == "interrupted" and (not keep_partial or not generated):
            self.messages.pop()  # the user message goes with its dropped reply
            if consistent and not cut and reused >= 1:
                self.session.truncate(reused)  # back to the state before this turn
            elif consistent and not cut:
                self.session = self._new_session()
            return reply
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def context_used(self) -> int:
        return len(self.session.tokens)

    # -- saved conversations ---------------------------------------------------------------
    def fingerprint(self, drafter: bool = True) -> str:
        """What saved caches depend on: the target's weights (and the drafter's), as
        `session_file.model_fingerprint` reads them; computed once."""
        key = "pair" if drafter else "target"
        if key not in self._fingerprints:
            self._fingerprints[key] = model_fingerprint(self.target, self.draft_model if drafter else None)
        return self._fingerprints[key]

    def save(self, path: str | Path) -> int:
        """Write the conversation (messages, settings) and its caches to `path`, atomically;
        returns the file's size in bytes. `load` continues it later without recomputing it."""
        if self.target.world is not None:
            raise DFlashError("a conversation's caches cannot be saved across ranks (each holds its own shard)")
        if len(self.session.tokens) < 2:
            raise DFlashError("nothing to save: no caches yet (send a message first)")
        metadata = {"chat": CHAT_FORMAT, "messages": self.messages, "settings": asdict(self.settings),
                    "target": self.fingerprint(drafter=False), "drafter": self.draft_model is not None}
        try:
            return save_session(self.session, path, fingerprint=self.fingerprint(), metadata=metadata)
        except OSError as e:
            raise DFlashError(f"cannot write {path}: {e.strerror or e}") from None

    def load(self, path: str | Path) -> None:
        """Continue a conversation `save` wrote: its messages, settings and caches replace these,
        and the next turn computes only its new message. Prompt lookup may be on or off either way.

        Raises `DFlashError` naming why a file does not fit (missing, not a saved chat, saved
        with other models, damaged); this conversation is then left as it was."""
        if self.target.world is not None:
            raise DFlashError("a conversation's caches cannot be loaded across ranks (each holds its own shard)")
        if not Path(path).is_file():
            raise DFlashError(f"{path}: no such file")
        header = read_header(path)
        meta = header.metadata
        if "chat" not in meta:
            raise SessionFileError(f"{path}: a session file, but not a saved chat")
        if meta["chat"] != CHAT_FORMAT:
            raise SessionFileError(f"{path}: a chat saved in format {meta['chat']!r}; this version reads {CHAT_FORMAT}")
        if meta.get("target") != self.fingerprint(drafter=False):
            raise SessionFileError(f"{path}: saved with another target model (or another dtype or quantization)")
        if meta.get("drafter") != (self.draft_model is not None):
            raise SessionFileError(f"{path}: saved {'with' if meta.get('drafter') else 'without'} a drafter; "
                                   f"this chat has {'one' if self.draft_model is not None else 'none'}")
        if header.fingerprint != self.fingerprint():
            raise SessionFileError(f"{path}: saved with another drafter")
        messages, settings = _saved_chat(path, meta)
        try:
            self._check_trees(settings)
        except DFlashError:  # trees these models no longer verify, or a damaged value: linear blocks
            settings.tree_budget, settings.tree_shape = DEFAULT_TREE_BUDGET, DEFAULT_TREE_SHAPE
        session, _ = load_session(path, self._new_session, fingerprint=self.fingerprint())
        self.settings = settings
        try:
            self.set_block_size(settings.block_size)
        except DFlashError:  # a size this chat's proposers cannot take (prompt lookup is off now)
            self.set_block_size(AUTO)
        self.messages, self.session, self.totals = messages, session, SessionTotals()


def _saved_chat(path: str | Path, meta: dict[str, Any]) -> tuple[list[dict[str, str]], ChatSettings]:
    """The messages and settings of a saved chat's metadata, checked (a damaged file raises)."""
    messages, saved = meta.get("messages"), meta.get("settings")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ) or not isinstance(saved, dict):
        raise SessionFileError(f"{path}: its messages or settings are damaged")
    names = {f.name for f in fields(ChatSettings)}
    return messages, ChatSettings(**{k: v for k, v in saved.items() if k in names})
