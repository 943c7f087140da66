"""Greedy DFlash output is the target's own greedy output, token for token.

The ground truth is mlx-lm's `generate_step` on the target alone
(`tiny.greedy_reference`); our `--no-draft` path (`draft_model=None`,
`prompt_lookup=False`) and prompt lookup alone must equal it too. Randomized
over every supported family, tiny random DFlash drafters and scripted
proposers with random error rates (so that every acceptance length occurs),
prompt lengths 1-200, block sizes 2-16, budgets that end mid-block and stop
tokens inside a block. Each case has a fixed seed: a failure names it.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.families import FAMILIES
from helpers.tiny import VOCAB, ScriptedProposer, greedy_reference

from mlx_dflash import stream_generate
from mlx_dflash.decoding import session as session_module
from mlx_dflash.targets.model import TargetModel

CASES_PER_FAMILY = 12  # 5 families x 12 = 60 randomized cases


def expected_output(reference: list[int], stop: set[int], max_tokens: int) -> tuple[list[int], str]:
    """What a lossless generation emits: the reference up to its first stop token (excluded)."""
    for i, token in enumerate(reference[:max_tokens]):
        if token in stop:
            return reference[:i], "stop"
    return reference[:max_tokens], "length"


def run(model, tokenizer, prompt, draft_model, **kwargs):
    tokens, events = [], []
    for event in stream_generate(model, tokenizer, prompt, draft_model=draft_model, **kwargs):
        tokens.extend(event.tokens)
        events.append(event)
    return tokens, events


def check_events(events, tokens, max_tokens):
    """Per-event bookkeeping that must hold whatever the proposer did."""
    assert events, "no event"
    assert all(e.finish_reason is None for e in events[:-1])
    stats = events[-1].stats
    assert stats.num_tokens == len(tokens) <= max_tokens
    assert len(stats.acceptance_lengths) == len(events) - 1  # the first event is the prefill's
    for event, length in zip(events[1:], stats.acceptance_lengths, strict=True):
        assert 1 <= length
        assert len(event.tokens) <= length
        assert 0 <= event.num_draft_accepted <= len(event.tokens)


def make_case(family: str, index: int) -> dict:
    seed = 1000 * (list(FAMILIES).index(family) + 1) + index
    rng = np.random.default_rng(seed)
    prompt_len = [1, 200][index] if index < 2 else int(rng.integers(1, 201))
    block_size = int(rng.integers(2, 17))
    # Budgets that are not multiples of the block size end mid-block.
    max_tokens = int(rng.integers(1, 4 * block_size + 2))
    return dict(
        seed=seed,
        prompt=[int(t) for t in rng.integers(4, VOCAB, prompt_len)],
        block_size=block_size,
        max_tokens=max_tokens,
        proposer=("dflash", "scripted", "scripted")[index % 3],
        error_rate=float(rng.choice([0.0, 0.05, 0.2, 0.5, 0.9, 1.0])),
        stop_mode=("length", "stop_tokens", "eos", "length")[index % 4],
        stop_index=int(rng.integers(0, max_tokens)),
        layer_ids=sorted({int(i) for i in rng.integers(0, 4, int(rng.integers(1, 4)))}),
    )


@pytest.mark.parametrize("index", range(CASES_PER_FAMILY))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_is_lossless(family, index, targets, drafters, make_tokenizer):
    case = make_case(family, index)
    model = targets(family)
    prompt, block_size, max_tokens = case["prompt"], case["block_size"], case["max_tokens"]
    reference = greedy_reference(model, prompt, max_tokens)
    assert len(reference) == max_tokens

    # Stop tokens: none beyond the tokenizer's EOS, or one the reference really emits,
    # given either as `stop_tokens=` or as the tokenizer's own eos id.
    stop_token = reference[case["stop_index"]]
    stop_tokens, eos_ids = (), (2,)
    if case["stop_mode"] == "stop_tokens":
        stop_tokens = (stop_token,)
    elif case["stop_mode"] == "eos":
        eos_ids = (stop_token,)
    expected, finish = expected_output(reference, set(stop_tokens) | set(eos_ids), max_tokens)

    if case["proposer"] == "dflash":
        draft = drafters(family, block_size=16)  # trained for every block size the cases draw
    else:
        sequence = prompt + greedy_reference(model, prompt, max_tokens + block_size)
        draft = ScriptedProposer(sequence, VOCAB, error_rate=case["error_rate"], seed=case["seed"],
                                 target_layer_ids=case["layer_ids"])
    tokens, events = run(model, make_tokenizer(eos_ids), prompt, draft, max_tokens=max_tokens,
                         block_size=block_size, stop_tokens=stop_tokens)
    assert tokens == expected, case
    assert events[-1].finish_reason == finish
    check_events(events, tokens, max_tokens)
    assert all(n <= block_size for n in events[-1].stats.acceptance_lengths)

    baseline, base_events = run(model, make_tokenizer(eos_ids), prompt, None, max_tokens=max_tokens,
                                stop_tokens=stop_tokens, prompt_lookup=False)
    assert baseline == expected, case
    assert set(base_events[-1].stats.acceptance_lengths) <= {1}

    # Prompt lookup alone, at this block size and with `auto`.
    for size in (block_size, "auto"):
        looked_up, lookup_events = run(model, make_tokenizer(eos_ids), prompt, None, max_tokens=max_tokens,
                                       stop_tokens=stop_tokens, block_size=size)
        assert looked_up == expected, (case, size)
        check_events(lookup_events, looked_up, max_tokens)


@pytest.mark.parametrize("index", [1, 3, 6])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_is_lossless_across_prefill_chunks(family, index, targets, drafters, make_tokenizer, monkeypatch):
    """Prompts longer than PREFILL_CHUNK (2048 in use) are fed in chunks: the same cases, 7-token chunks."""
    case = make_case(family, index)
    model, prompt = targets(family), case["prompt"]
    assert len(prompt) > 7
    reference = greedy_reference(model, prompt, case["max_tokens"])
    if case["proposer"] == "dflash":
        draft, fresh_draft = drafters(family, block_size=16), drafters(family, block_size=16)
    else:
        sequence = prompt + greedy_reference(model, prompt, case["max_tokens"] + case["block_size"])
        draft, fresh_draft = (ScriptedProposer(sequence, VOCAB, error_rate=case["error_rate"], seed=case["seed"],
                                               target_layer_ids=case["layer_ids"]) for _ in range(2))
    options = dict(max_tokens=case["max_tokens"], block_size=case["block_size"])
    whole, whole_events = run(model, make_tokenizer(()), prompt, fresh_draft, **options)
    monkeypatch.setattr(session_module, "PREFILL_CHUNK", 7)
    chunked, events = run(model, make_tokenizer(()), prompt, draft, **options)
    assert chunked == whole == reference, case
    # The drafter saw the same context at the same positions: it drafted the same blocks.
    assert events[-1].stats.acceptance_lengths == whole_events[-1].stats.acceptance_lengths


@pytest.mark.parametrize("block_size", [2, 5, 8, 16])
def test_every_acceptance_length_occurs(block_size, targets, make_tokenizer):
    """A scripted proposer with a moderate error rate visits every length 1..block_size."""
    model = targets("qwen3")
    prompt = [5, 17, 33, 90, 41]
    max_tokens = {2: 60, 5: 200, 8: 300, 16: 700}[block_size]
    reference = greedy_reference(model, prompt, max_tokens + block_size)
    proposer = ScriptedProposer(prompt + reference, VOCAB, error_rate=1.5 / (block_size + 1), seed=block_size)
    tokens, events = run(model, make_tokenizer(()), prompt, proposer, max_tokens=max_tokens,
                         block_size=block_size)
    assert tokens == reference[:max_tokens]
    lengths = events[-1].stats.acceptance_lengths
    assert set(lengths) == set(range(1, block_size + 1)), sorted(set(lengths))
    assert sum(lengths) + 1 == max_tokens


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("error_rate", [0.0, 1.0])
def test_acceptance_extremes(family, error_rate, targets, make_tokenizer):
    """Perfect drafts fill every block; always-wrong drafts give length 1 every cycle."""
    model = targets(family)
    prompt, block_size, max_tokens = [7, 21, 64, 9, 100, 55], 6, 40  # 39 = 6 * 6 + 3: ends mid-block
    reference = greedy_reference(model, prompt, max_tokens + block_size)
    proposer = ScriptedProposer(prompt + reference, VOCAB, error_rate=error_rate, seed=3,
                                target_layer_ids=[0, 2])
    # No EOS: the generation must run to its budget whatever the random target emits.
    tokens, events = run(model, make_tokenizer(()), prompt, proposer, max_tokens=max_tokens,
                         block_size=block_size)
    assert tokens == reference[:max_tokens]
    assert events[-1].finish_reason == "length"
    lengths = events[-1].stats.acceptance_lengths
    assert sum(lengths) + 1 == max_tokens
    if error_rate == 0.0:
        assert lengths[:-1] == [block_size] * (len(lengths) - 1)
        assert 1 <= lengths[-1] <= block_size
        assert all(e.num_draft_accepted == len(e.tokens) - 1 for e in events[1:])
    else:
        assert lengths == [1] * (max_tokens - 1)
        assert all(e.num_draft_accepted == 0 for e in events[1:])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_mask_token_in_the_continuation(family, targets, make_tokenizer):
    """A drafter whose mask_token_id is a token the target emits (and the prompt holds) stays lossless."""
    from helpers.tiny import tiny_drafter

    model = targets(family)
    prompt = [40, 41, 42, 43, 44, 45, 46]
    max_tokens = 30
    reference = greedy_reference(model, prompt, max_tokens)
    mask = reference[4]
    assert 0 <= mask < TargetModel(model).vocab_size
    drafter = tiny_drafter(model, seed=7, block_size=8, mask_token_id=mask)
    assert drafter.mask_token_id == mask
    for p in (prompt, prompt + [mask, mask]):
        ref = greedy_reference(model, p, max_tokens)
        tokens, _ = run(model, make_tokenizer(()), p, drafter, max_tokens=max_tokens)
        assert tokens == ref
