"""The Python API: `stream_generate` (one event per verify cycle) and `generate`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .auto.policy import (
    AUTO,
    DEFAULT_TREE_BUDGET,
    DEFAULT_TREE_SHAPE,
    make_policy,
    parse_tree_budget,
    parse_tree_shape,
    reproducible,
)
from .decoding.block_size import BlockSizePolicy
from .decoding.constraint import TokenConstraint
from .decoding.loop import GenerationEvent, stream_session
from .decoding.sampling import make_sampler
from .decoding.session import DecodingSession
from .decoding.tree_step import refusal
from .drafters.dflash import DFlashDraftModel
from .errors import DFlashError
from .platform.runtime import wired_limit
from .proposers.base import Proposer
from .proposers.factory import check_block_size, make_lookup, make_proposer
from .proposers.lookup import LOOKUP_BLOCK
from .targets.model import TargetModel, as_target


def stream_generate(
    model: nn.Module | TargetModel,
    tokenizer: TokenizerWrapper,
    prompt: str | Sequence[int],
    *,
    draft_model: DFlashDraftModel | Proposer | None = None,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    block_size: int | str | None = None,
    draft_window: int | None = None,
    stop_tokens: Sequence[int] = (),
    profile: bool = False,
    calibration: Any = None,
    policy: BlockSizePolicy | None = None,
    prompt_lookup: bool = True,
    json_schema: dict | bool | None = None,
    tree_budget: int | str | None = DEFAULT_TREE_BUDGET,
    tree_shape: str | None = DEFAULT_TREE_SHAPE,
) -> Iterator[GenerationEvent]:
    """Generate with DFlash and prompt lookup (the target alone with neither).

    Greedy output is token-identical to the target decoding alone; with temp > 0
    every token is an exact sample of the target's (top-p/top-k/min-p filtered)
    distribution. `profile` syncs after drafting to split draft/verify time.
    `block_size`: "auto" (the default, None) chooses each cycle's size for the most
    tokens per second (`mlx_dflash.auto.policy`), seeded by a `calibration` when given
    (with a `seed` and temp > 0 it is the drafter's block, for reproducible samples);
    an int fixes it. `policy` overrides both (research, tests). Output never depends on it.
    `prompt_lookup`: also verify proposals read off the prompt and the reply so far
    (`mlx_dflash.proposers.lookup`) when `auto` expects them to pay; without a drafter they are the
    only proposals (a fixed `block_size` then caps them).
    `json_schema`: constrain the reply to JSON following this schema (True: any JSON object) by
    masking the target's distribution at every verified position (needs llguidance: the `serve`
    extra); the reply is exactly the constrained target's, and drafted tokens outside it are rejected.
    `tree_budget`: 0 (the default) verifies linear blocks; N > 0 verifies each drafted block as a
    draft tree of N nodes (`mlx_dflash.decoding.tree`, shaped by `tree_shape`: "spine" or "paper"),
    refused with the reason where this target or drafter cannot (`tree_settings`); "auto" (also
    None) lets `block_size="auto"` weigh trees where they can be verified. Output never depends on it.
    """
    target = as_target(model)
    constraint = None
    if json_schema is not None and json_schema is not False:
        if target.world is not None:
            raise DFlashError("json_schema is not supported across ranks yet")
        schema = None if json_schema is True else json_schema
        constraint = TokenConstraint.for_json(tokenizer, schema, target.vocab_size)
    # Distributed, every rank prefills rank 0's ids (tokenizers of other versions may split text otherwise).
    ids = target.agree_tokens(tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
    if not ids:
        raise DFlashError("the prompt is empty: give at least one token")
    if max_tokens < 0:
        raise DFlashError(f"max_tokens must be >= 0, got {max_tokens}")
    auto = block_size in (None, AUTO)
    if draft_model is None and prompt_lookup:
        block_size = LOOKUP_BLOCK if auto else check_block_size(block_size, None, lookup=True)
    else:
        block_size = check_block_size(None if auto else block_size, draft_model)
    if draft_window is not None and draft_window < 1:
        raise DFlashError(f"draft window must be >= 1 token, got {draft_window}")
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp, top_p=top_p, min_p=min_p, top_k=top_k)
    stop = set(tokenizer.eos_token_ids) | set(stop_tokens)
    proposer = make_proposer(target, draft_model, block_size, draft_window)
    tree_budget, tree_shape = tree_settings(tree_budget, tree_shape, target, proposer, constraint)
    session = DecodingSession(target, proposer, lookup=make_lookup(prompt_lookup))
    policy = policy or reproducible(make_policy(AUTO if auto else block_size, block_size, calibration,
                                                drafter=proposer is not None, lookup=prompt_lookup,
                                                tree_budget=tree_budget, tree_shape=tree_shape),
                                    block_size, seed, temp)
    with wired_limit([target.model, draft_model]):
        yield from stream_session(session, ids, sampler, max_tokens=max_tokens, stop=stop,
                                  detokenizer=tokenizer.detokenizer, profile=profile, policy=policy,
                                  constraint=constraint)


def tree_settings(tree_budget: int | str | None, tree_shape: str | None, target: TargetModel,
                  proposer: Proposer | None, constraint: Any = None) -> tuple[int | str, str]:
    """`tree_budget` and `tree_shape` parsed (`auto.policy.parse_tree_budget`, `parse_tree_shape`), an
    explicit positive budget checked against what `target` and `proposer` can verify.

    Asked for trees by number where they cannot be verified (a hybrid or sliding-window target, a
    DFlash2 drafter, no drafter, a constraint), this raises `DFlashError` with the reason
    (`decoding.tree_step.refusal`) rather than silently decoding linear blocks; "auto" and 0 never
    fail (the session offers trees only where they can be verified, so "auto" falls back to linear)."""
    budget, shape = parse_tree_budget(tree_budget), parse_tree_shape(tree_shape)
    if budget != AUTO and budget > 0:
        reason = refusal(target, proposer, constraint=constraint)
        if reason is not None:
            raise DFlashError(f"tree budget {budget}: {reason}; a tree budget of 0 verifies linear blocks, "
                              "auto uses trees only where they can be verified")
    return budget, shape


def generate(
    model: nn.Module | TargetModel,
    tokenizer: TokenizerWrapper,
    prompt: str | Sequence[int],
    **kwargs,
) -> str:
    """Generate a completion and return its text (see `stream_generate` for options)."""
    return "".join(event.text for event in stream_generate(model, tokenizer, prompt, **kwargs))
