"""One speculative step: draft a block, verify it with the target, accept a prefix.

The acceptance rule lives here (`launch_step`): drafted tokens are kept while they equal
the token the target itself chose at that position, or, when the proposer stated the
distribution it sampled from, by speculative rejection sampling (`sampling.py`). The
drafter is reached only through the `Proposer` interface (`mlx_dflash.proposers.base`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..proposers.base import Proposer, ScoringProposer
from ..targets.model import TargetModel
from .sampling import draft_block, rejection_verify


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
    tree_size: int | None = None  # nodes of the verified draft tree (None: a linear block)
    spine_accepted: int | None = None  # a spine tree: what the linear draft alone would have had accepted
    draft_belief: Any = None  # a spine tree: what the drafter expected of it (`tree.DraftBelief`)


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


def confident_draft(proposer: ScoringProposer, last_token: mx.array, position: int, block_size: int,
                    cut: Callable[[list[float]], int]) -> mx.array:
    """The drafter's argmax block, cut to the size `cut` chooses from each position's confidence (the
    probability the drafter gives its argmax): one host read between draft and verify, a decision.
    The tokens are the ones `propose` drafts, so the verify's acceptance rule is unchanged."""
    logits = proposer.draft_logits(last_token, position, block_size).astype(mx.float32)
    draft = mx.argmax(logits, axis=-1).astype(mx.uint32)
    confidence = mx.exp(logits.max(axis=-1) - mx.logsumexp(logits, axis=-1))
    mx.eval(draft, confidence)
    keep = min(max(cut(confidence.tolist()), 2), block_size)
    return draft[: keep - 1]


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
    cut: Callable[[list[float]], int] | None = None,
) -> Launched:
    """Draft, verify and accept one block, lazily: the graph of the cycle, read back by `finish`.

    The target cache is left holding all B inputs. With no proposer (or block_size 1) this
    is one plain decoding step of the target. `draft` (prompt lookup's tokens) is verified
    instead of drafting. `timings`, when given, accumulates draft/verify seconds (forcing a
    sync after drafting). `constraint` (a `constraint.TokenConstraint`) masks the target's
    distributions before anything is sampled or accepted; it reads the draft on the host first.
    `cut` (a drafter that scores its block: `draft_logits`): told the drafter's confidence in each
    position after one host read, it returns the block size to verify (`confident_draft`).
    """
    start = time.perf_counter()
    capture = proposer.target_layer_ids if proposer is not None else ()
    proposal, inputs, draft_finite = None, last_token.astype(mx.uint32), None
    if draft is not None:
        draft = mx.array(draft, dtype=mx.uint32)
        inputs = mx.concatenate([inputs, draft])
    elif proposer is not None and block_size > 1:
        if cut is not None:
            draft = confident_draft(proposer, last_token, position, block_size, cut)
        else:
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
