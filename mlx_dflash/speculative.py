"""One DFlash cycle: draft a block, verify it with the target, accept a prefix.

`Proposer` is the drafter seen by the decode loop; `DFlashProposer` is the real
one (block diffusion over the target's features). Tests plug in oracle and
always-wrong proposers through the same interface.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .draft_cache import DraftContextCache
from .drafter import DFlashDraftModel
from .injection import ContextInjector
from .sampling import draft_block, rejection_verify
from .target import TargetModel


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

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        block = mx.concatenate([last_token.astype(mx.uint32), self._masks[: block_size - 1]])
        hidden = self.drafter(self.target.embed(block[None]), self.cache, position)
        logits = self.target.logits(hidden[:, 1:])
        return mx.argmax(logits[0], axis=-1).astype(mx.uint32)

    def commit(self, features: mx.array, position: int) -> None:
        self.injector(features, position, self.cache)

    def trim(self, num_positions: int) -> None:
        self.cache.trim(num_positions)

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

    def finish(self, timings: dict[str, float] | None = None) -> Verified:
        """Wait for the cycle and read its outcome: the one host sync per cycle, a decision."""
        mx.eval(self.target_tokens, self.num_accepted)
        if timings is not None:
            timings["verify"] = timings.get("verify", 0.0) + time.perf_counter() - self.started
        a = self.num_accepted.item()
        return Verified(self.target_tokens[: a + 1].tolist(), a, self.features, self.inputs, self.checkpoint,
                        self.logprobs)


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
) -> Launched:
    """Draft, verify and accept one block, lazily: the graph of the cycle, read back by `finish`.

    The target cache is left holding all B inputs. With no proposer (or block_size 1) this
    is one plain decoding step of the target. `draft` (prompt lookup's tokens) is verified
    instead of drafting. `timings`, when given, accumulates draft/verify seconds (forcing a
    sync after drafting).
    """
    start = time.perf_counter()
    capture = proposer.target_layer_ids if proposer is not None else ()
    proposal, inputs = None, last_token.astype(mx.uint32)
    if draft is not None:
        draft = mx.array(draft, dtype=mx.uint32)
        inputs = mx.concatenate([inputs, draft])
    elif proposer is not None and block_size > 1:
        draft, proposal = draft_block(proposer, sampler, last_token, position, block_size)
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
    return Launched(target_tokens, num_accepted, features, inputs, checkpoint, start, logprobs)
