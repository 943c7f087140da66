"""One DFlash cycle: draft a block, verify it with the target, accept a prefix.

`Proposer` is the drafter seen by the decode loop; `DFlashProposer` is the real
one (block diffusion over the target's features). Tests plug in oracle and
always-wrong proposers through the same interface.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .draft_cache import DraftContextCache
from .drafter import DFlashDraftModel
from .injection import ContextInjector
from .sampling import draft_block, rejection_verify
from .target import TargetModel

logger = logging.getLogger("mlx_dflash")
# Features kept, at most, until a draft shows they injected finite K/V (float16 drafters only).
MAX_UNCONFIRMED = 8192


class Proposer(Protocol):
    """Proposes the tokens that follow the last committed token."""

    target_layer_ids: list[int]

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        """`last_token` (1,) sits at absolute `position`; return block_size - 1 tokens."""
        ...

    def commit(self, features: mx.array, position: int) -> None:
        """Take the committed positions' target features (1, n, k*D) from `position` on."""
        ...

    def trim(self, num_positions: int) -> None:
        """Forget the last committed positions (used when a chat drops a reply)."""
        ...

    def state_arrays(self) -> list[mx.array]:
        """Arrays to evaluate so that committed context is materialised."""
        ...


class DFlashProposer:
    """Block drafting with a DFlash drafter sharing the target's embedding and lm_head."""

    def __init__(
        self,
        drafter: DFlashDraftModel,
        target: TargetModel,
        *,
        max_block_size: int,
        window: int | None = None,
        injector: ContextInjector | None = None,
    ):
        args = drafter.args
        self.drafter = drafter
        self.target = target
        self.target_layer_ids = list(drafter.target_layer_ids)
        self.injector = injector or ContextInjector.for_drafter(drafter)
        self.cache = DraftContextCache(
            args.num_hidden_layers,
            args.num_key_value_heads,
            args.head_dim,
            max_block_size=max_block_size,
            dtype=drafter.norm.weight.dtype,
            window=window,
            layer_windows=args.layer_windows,
        )
        self._masks = mx.array([drafter.mask_token_id] * (max_block_size - 1), dtype=mx.uint32)
        # float16 ends at 65504, and targets' features reach that (massive activations): an overflow in
        # the feature projection poisons the draft cache. Each draft's finiteness is read with its verify
        # (`checked`); the features injected since the last finite draft are kept to inject them again.
        self.guarded = self.cache.dtype == mx.float16
        self.last_draft_finite: mx.array | None = None  # () bool, lazily: the last draft's logits were finite
        self._unconfirmed: list[tuple[mx.array, int]] = []  # (features, position) since the last finite draft
        self._drafted_over = 0  # how many of them the last draft read
        self._reinjected = False  # they were injected again in float32 once already

    def _note_draft(self, x: mx.array) -> None:
        if self.guarded:
            self.last_draft_finite = mx.isfinite(x).all()
            self._drafted_over = len(self._unconfirmed)

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        block = mx.concatenate([last_token.astype(mx.uint32), self._masks[: block_size - 1]])
        hidden = self.drafter(self.target.embed(block[None]), self.cache, position)
        logits = self.target.logits(hidden[:, 1:])
        self._note_draft(logits)
        return mx.argmax(logits[0], axis=-1).astype(mx.uint32)

    def commit(self, features: mx.array, position: int) -> None:
        self.injector(features, position, self.cache)
        if self.guarded:
            kept = self._unconfirmed + [(features, position)]
            while sum(f.shape[1] for f, _ in kept) > MAX_UNCONFIRMED and len(kept) > 1:
                kept, self._drafted_over = kept[1:], max(self._drafted_over - 1, 0)
            self._unconfirmed = kept  # a new list: clones of this proposer share the old one

    def checked(self, finite: bool) -> None:
        """After the verify of a draft: forget the features it confirmed, or, if its logits were not
        finite, project features in float32 from now on and inject the unconfirmed ones again.

        The cycle itself stays exact (the target rejects a bad draft); the fallback is for the next.
        """
        if finite:
            self._unconfirmed, self._drafted_over = self._unconfirmed[self._drafted_over:], 0
            return
        if self._reinjected:
            logger.warning("mlx-dflash: the float16 drafter's logits are not finite even with float32 features; "
                           "its drafts will be rejected (convert it to bfloat16)")
            self.guarded, self._unconfirmed = False, []
            return
        if not self.injector.wide:  # the injector is the drafter's: one warning, every session widened
            logger.warning("mlx-dflash: the float16 drafter's logits were not finite (the target's features "
                           "overflow float16); projecting them in float32 from here on")
            self.injector.wide = True
        self._reinjected = True
        if not self._unconfirmed:
            return
        try:
            self.cache.trim(self.cache.offset - self._unconfirmed[0][1])
        except ValueError:  # a sliding draft window no longer holds them: only later positions are helped
            return
        for features, position in self._unconfirmed:
            self.injector(features, position, self.cache)
        self._drafted_over = 0

    def trim(self, num_positions: int) -> None:
        self.cache.trim(num_positions)
        end = self.cache.offset
        self._unconfirmed = [(f[:, : end - p], p) for f, p in self._unconfirmed if p < end]
        self._drafted_over = min(self._drafted_over, len(self._unconfirmed))

    def state_arrays(self) -> list[mx.array]:
        return self.cache.state_arrays()


@dataclass
class Verified:
    """What one cycle produced, before the caller decides how much of it to keep."""

    tokens: list[int]  # accepted draft tokens, then the target's own token
    num_accepted: int  # draft tokens accepted (tokens[-1] is the target's)
    features: Any  # (1, B, k*D) target features of the verified inputs, or None
    inputs: mx.array  # the verified inputs: the pending token, then the draft
    checkpoint: Any = None  # untrimmable target cache state before the verify (hybrid targets)
    logprobs: Any = None  # (B, V) the target's log-probabilities after each input, lazily
    source: str | None = None  # who proposed the verified tokens ("dflash", "lookup"; None: a plain step)
    draft_finite: bool | None = None  # a guarded drafter's logits were finite (None: not checked)


@dataclass
class Launched:
    """A cycle whose graph is built (and maybe evaluating) but not read back yet."""

    target_tokens: mx.array  # (B,) the target's token after each input, lazily
    num_accepted: mx.array  # () draft tokens accepted, lazily
    features: Any
    inputs: mx.array
    checkpoint: Any
    started: float  # when its timed part began (profile)
    logprobs: mx.array  # (B, V) the target's log-probabilities after each input, lazily
    draft_finite: mx.array | None = None  # () bool, lazily, when the proposer guards its drafts

    def finish(self, timings: dict[str, float] | None = None) -> Verified:
        """Wait for the cycle and read its outcome: the one host sync per cycle, a decision."""
        mx.eval(self.target_tokens, self.num_accepted, *([self.draft_finite] if self.draft_finite is not None else []))
        if timings is not None:
            timings["verify"] = timings.get("verify", 0.0) + time.perf_counter() - self.started
        a = self.num_accepted.item()
        finite = None if self.draft_finite is None else bool(self.draft_finite.item())
        return Verified(self.target_tokens[: a + 1].tolist(), a, self.features, self.inputs, self.checkpoint,
                        self.logprobs, draft_finite=finite)


def launch_step(
    target: TargetModel,
    cache: list[Any],
    proposer: Proposer | None,
    sampler: Any,
    last_token: mx.array,
    position: int,
    block_size: int,
    timings: dict[str, float] | None = None,
    draft: list[int] | None = None,
    constraint: Any = None,
) -> Launched:
    """Draft, verify and accept one block, lazily: the graph of the cycle, read back by `finish`.

    The target cache is left holding all B inputs. With no proposer (or block_size 1) this
    is one plain decoding step of the target. `draft` (prompt lookup's tokens) is verified
    instead of drafting. `timings`, when given, accumulates draft/verify seconds (forcing a
    sync after drafting). `constraint` (a `constraint.TokenConstraint`) masks the target's
    distributions before anything is sampled or accepted; it reads the draft on the host first.
    """
    start = time.perf_counter()
    capture = proposer.target_layer_ids if proposer is not None else ()
    proposal, inputs, draft_finite = None, last_token.astype(mx.uint32), None
    if draft is not None:
        draft = mx.array(draft, dtype=mx.uint32)
        inputs = mx.concatenate([inputs, draft])
    elif proposer is not None and block_size > 1:
        draft, proposal = draft_block(proposer, sampler, last_token, position, block_size)
        draft_finite = getattr(proposer, "last_draft_finite", None)
        inputs = mx.concatenate([inputs, draft])
        if timings is not None:
            mx.eval(draft)
            drafted = time.perf_counter()
            timings["draft"] = timings.get("draft", 0.0) + drafted - start
            start = drafted
    inputs = target.agree(inputs)  # distributed: every rank verifies rank 0's block
    checkpoint = target.checkpoint(cache) if draft is not None else None
    hidden, features = target.forward(inputs[None], cache, capture, checkpoint)
    logits = target.logits(hidden)[0]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if constraint is not None:  # drafted tokens outside the grammar get probability zero: rejected
        logprobs = constraint.mask(logprobs, inputs[1:].tolist())
    if proposal is not None:
        # The draft was sampled from a stated q: speculative rejection sampling (`sampling.py`).
        tokens, accepted = rejection_verify(draft, proposal, sampler.probs(logprobs))
        agreed = target.agree(mx.concatenate([tokens, accepted[None].astype(tokens.dtype)]))
        target_tokens, num_accepted = agreed[:-1], agreed[-1]
    elif draft is None:
        target_tokens = target.agree(sampler(logprobs))
        num_accepted = mx.array(0)
    else:
        # Accept drafted tokens while they equal the token the target itself chose (or sampled)
        # at that position; the target's token at the first mismatch is emitted instead (lossless).
        target_tokens = target.agree(sampler(logprobs))
        num_accepted = mx.cumprod(inputs[1:] == target_tokens[:-1]).sum()
    return Launched(target_tokens, num_accepted, features, inputs, checkpoint, start, logprobs, draft_finite)
