"""Constrained decoding (`mlx_dflash.decoding.constraint`): output is exactly the grammar-constrained target's.

The reference is mlx-lm's own `generate_step` with a logits processor that masks each step's
logits with an llguidance matcher (built here, with llguidance's own numpy mask helpers): one
token at a time, no speculation. Greedy DFlash and prompt-lookup output must equal it token for
token; plain sampled output must equal it draw for draw (same seed); sampled DFlash output
(sample-and-match and DFlash2's rejection sampling) must follow the masked distribution (a
chi-square test of the randomised PIT); drafted tokens outside the grammar must be rejected.
"""

from __future__ import annotations

import json
import subprocess
import sys

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import pytest
from helpers.tiny import EOS_ID, ScriptedProposer, greedy_reference, tiny_drafter, tiny_target, write_tokenizer
from helpers.tiny_dflash2 import tiny_dflash2
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import load as load_tokenizer
from scipy.stats import chisquare

from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.decoding.constraint import (
    GrammarError,
    StructuredOutputUnavailable,
    TokenConstraint,
    grammar_tokenizer,
    json_schema_grammar,
)
from mlx_dflash.decoding.loop import stream_session
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.generate import stream_generate
from mlx_dflash.proposers.factory import make_proposer
from mlx_dflash.proposers.lookup import PromptLookup
from mlx_dflash.targets.model import TargetModel

MASK_ID = 3
TARGET_VOCAB = 320  # past the tokenizer's ids: padding rows the grammar must never allow
# Multi-byte tokens that cross JSON lexeme boundaries ('":' ends a key and starts the value).
MERGED = ['{"', '":', '",', ', "', ': "', "true", "false", "small", "large", '"}', "ok", "size"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "size", "n"], "additionalProperties": False,
}
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # short replies: the tiny model completes them
P_HONEST = 1e-4  # fixed seeds: every p-value is deterministic
BINS = 20


def byte_level_tokenizer(path):
    """A byte-level BPE fast tokenizer (as Qwen's and Llama 3's are) with a few JSON merges."""
    from mlx_dflash.convert.gguf_tokenizer import _byte_alphabet
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    specials = ["<unk>", "<s>", "</s>", "<mask>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        vocab[alphabet[b]] = len(vocab)
    merges = []
    for word in MERGED:
        spelled = ["".join(alphabet[b] for b in ch.encode()) for ch in word]
        left = spelled[0]
        for right in spelled[1:]:
            if (left, right) not in merges:
                merges.append((left, right))
            left += right
            vocab.setdefault(left, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   mask_token="<mask>")
    fast.save_pretrained(str(path))
    assert len(vocab) < TARGET_VOCAB
    return load_tokenizer(path, eos_token_ids=[EOS_ID])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return byte_level_tokenizer(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def model():
    return tiny_target("qwen3", seed=3, vocab=TARGET_VOCAB)


@pytest.fixture(scope="module")
def drafter(model):
    return tiny_drafter(model, block_size=8, mask_token_id=MASK_ID)


def prompt_ids(tokenizer, text='Answer as {"ok": true, "size": "small", "n": 7}: ') -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# -- the reference: one token at a time, masked by a matcher of our own --------------------------
_LLTOKENIZERS: dict = {}  # the reference's own llguidance tokenizers (tokenizers live as long as the module)


class ReferenceMask:
    """A logits processor for mlx-lm's generate_step: -inf outside the grammar, the grammar's own
    end-of-sequence allowed where it is satisfied (llguidance's native semantics)."""

    def __init__(self, tokenizer, schema, prompt_len: int):
        if id(tokenizer) not in _LLTOKENIZERS:
            _LLTOKENIZERS[id(tokenizer)] = llguidance.hf.from_tokenizer(tokenizer._tokenizer, eos_token=EOS_ID)
        self.lltok = _LLTOKENIZERS[id(tokenizer)]
        self.matcher = llguidance.LLMatcher(self.lltok, json_schema_grammar(schema))
        self.prompt_len, self.fed = prompt_len, 0

    def advance(self, tokens: list[int]) -> None:
        new = tokens[self.prompt_len + self.fed:]
        if EOS_ID in new:  # the end (mlx-lm computes one step past it): the grammar does not take it
            new = new[: new.index(EOS_ID)]
        assert self.matcher.consume_tokens(new), self.matcher.get_error()
        self.fed += len(new)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        bitmask = allocate_token_bitmask(1, self.lltok.vocab_size)
        fill_next_token_bitmask(self.matcher, bitmask)
        out = np.array(logits, dtype=np.float32).reshape(1, -1)
        out[:, self.lltok.vocab_size:] = -np.inf
        head = out[:, : self.lltok.vocab_size]
        apply_token_bitmask_inplace(head, bitmask)
        out[:, : self.lltok.vocab_size] = head
        return out

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.advance(tokens.tolist())
        return mx.array(self.mask(np.array(logits.astype(mx.float32))))


def reference(model, tokenizer, prompt, schema, max_tokens, sampler=None) -> list[int]:
    processor = ReferenceMask(tokenizer, schema, len(prompt))
    out = []
    for token, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=max_tokens,
                                  sampler=sampler, logits_processors=[processor]):
        out.append(int(token))
        if out[-1] == EOS_ID:
            break
    return out


def constrained(model, tokenizer, prompt, schema, *, max_tokens=48, drafter=None, proposer=None,
                block_size=1, lookup=False, temp=0.0, seed=None):
    """Our decode loop under a constraint: (tokens, the stop token included; cycles; the constraint)."""
    target = TargetModel(model)
    constraint = TokenConstraint.for_json(tokenizer, schema, target.vocab_size)
    proposer = proposer or make_proposer(target, drafter, block_size)
    session = DecodingSession(target, proposer, lookup=PromptLookup() if lookup else None)
    if hasattr(proposer, "history"):
        proposer.history = lambda: session.tokens
    if seed is not None:
        mx.random.seed(seed)
    tokens, cycles = [], []
    for event in stream_session(session, prompt, make_sampler(temp), max_tokens=max_tokens, stop={EOS_ID},
                                detokenizer=tokenizer.detokenizer, policy=FixedBlockSize(block_size),
                                constraint=constraint):
        tokens += event.tokens
        cycles.append((len(event.tokens), event.num_draft_accepted))
        if event.finish_reason == "stop":
            tokens.append(EOS_ID)
    assert session.constraint is None  # one generation's only
    return tokens, cycles, constraint


class TemptingProposer:
    """Drafts the constrained target's greedy continuation of what the session committed, but for each
    block's last token: the unmasked target's own greedy choice, which it accepts unless the grammar masks it."""

    def __init__(self, model, tokenizer, schema, prompt_len: int):
        self.model, self.tokenizer, self.schema, self.prompt_len = model, tokenizer, schema, prompt_len
        self.target_layer_ids = [0]
        self.history = None  # set by `constrained`: the session's committed tokens

    def propose(self, last_token: mx.array, position: int, block_size: int) -> mx.array:
        context = self.history()[: position + 1]
        grammar = ReferenceMask(self.tokenizer, self.schema, self.prompt_len)
        draft = []
        for k in range(block_size - 1):
            logits = np.array(self.model(mx.array([context + draft], dtype=mx.uint32))[0, -1].astype(mx.float32))
            if k < block_size - 2:
                grammar.advance(context + draft)
                logits = grammar.mask(logits)[0]
            draft.append(int(np.argmax(logits)))
        return mx.array(draft, dtype=mx.uint32)

    def commit(self, features, position: int) -> None:
        pass

    def trim(self, num_positions: int) -> None:
        pass

    def state_arrays(self) -> list:
        return []


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"ok", "size", "n"}, value
    assert isinstance(value["ok"], bool) and value["size"] in ("small", "large")
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 99


# -- greedy: token for token ----------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_greedy_dflash_equals_the_constrained_target(model, drafter, tokenizer, block_size):
    prompt = prompt_ids(tokenizer)
    schema = dict(SCHEMA, **COMPACT)
    ref = reference(model, tokenizer, prompt, schema, 64)
    out, cycles, constraint = constrained(model, tokenizer, prompt, schema, max_tokens=64, drafter=drafter,
                                          block_size=block_size)
    assert out == ref
    assert out[-1] == EOS_ID  # the grammar completed and only a stop token could follow
    check_schema(tokenizer.decode(out[:-1]))
    if block_size > 1:  # a random drafter proposes tokens outside the grammar: each was rejected
        assert constraint.rejected_drafts > 0


def test_the_python_api_takes_a_json_schema(model, drafter, tokenizer):
    prompt = prompt_ids(tokenizer)
    schema = dict(SCHEMA, **COMPACT)
    ref = reference(model, tokenizer, prompt, schema, 64)
    for block_size in (None, 4):  # auto, then a fixed block that drafts every cycle
        events = list(stream_generate(model, tokenizer, prompt, draft_model=drafter, max_tokens=64,
                                      json_schema=schema, block_size=block_size))
        out = [t for event in events for t in event.tokens]
        assert events[-1].finish_reason == "stop" and out + [EOS_ID] == ref
        check_schema("".join(event.text for event in events))
    unconstrained = [t for e in stream_generate(model, tokenizer, prompt, max_tokens=64) for t in e.tokens]
    assert unconstrained != out  # the schema is what shaped it


def test_greedy_with_flexible_whitespace_and_any_object(model, drafter, tokenizer):
    prompt = prompt_ids(tokenizer)
    for schema in (SCHEMA, None):
        ref = reference(model, tokenizer, prompt, schema, 40)
        out, _, _ = constrained(model, tokenizer, prompt, schema, max_tokens=40, drafter=drafter, block_size=8)
        assert out == ref
        assert tokenizer.decode(out).startswith("{")


def test_prompt_lookup_equals_the_constrained_target(model, tokenizer):
    # The prompt holds a valid reply, so lookup proposes it (and wrong continuations of it).
    prompt = prompt_ids(tokenizer, '{"ok":true,"size":"large","n":12} {"ok":false,"size":"small","n":3} ')
    schema = dict(SCHEMA, **COMPACT)
    ref = reference(model, tokenizer, prompt, schema, 64)
    out, cycles, _ = constrained(model, tokenizer, prompt, schema, max_tokens=64, block_size=8, lookup=True)
    assert out == ref
    assert any(accepted for _, accepted in cycles)  # lookup's proposals were verified, some kept


def test_drafts_outside_the_grammar_are_rejected(model, tokenizer):
    prompt = prompt_ids(tokenizer)
    schema = dict(SCHEMA, **COMPACT)
    ref = reference(model, tokenizer, prompt, schema, 64)
    # Always <mask>: never in the grammar, so every drafting cycle rejects its first draft.
    wrong = ScriptedProposer([MASK_ID] * 1000, TARGET_VOCAB)
    out, cycles, constraint = constrained(model, tokenizer, prompt, schema, max_tokens=64, proposer=wrong,
                                          block_size=4)
    assert out == ref
    assert all(accepted == 0 for _, accepted in cycles)
    assert constraint.rejected_drafts == len(cycles) - 1 > 0  # every cycle but the prefill's drafted
    # Tempting drafts: the unmasked target would accept each of them, the masked one only those in the grammar.
    tempting = TemptingProposer(model, tokenizer, schema, len(prompt))
    out, cycles, constraint = constrained(model, tokenizer, prompt, schema, max_tokens=64, proposer=tempting,
                                          block_size=4)
    assert out == ref
    assert constraint.rejected_drafts > 0 and sum(accepted for _, accepted in cycles) > 0
    # The constrained reply itself, proposed: all of it is in the grammar and accepted.
    right = ScriptedProposer(prompt + ref + [MASK_ID] * 8, TARGET_VOCAB)
    out, cycles, constraint = constrained(model, tokenizer, prompt, schema, max_tokens=64, proposer=right,
                                          block_size=4)
    assert out == ref
    assert sum(accepted for _, accepted in cycles) >= len(ref) // 2 and constraint.rejected_drafts == 0


# -- sampling --------------------------------------------------------------------------------------
def test_plain_sampling_draws_what_the_constrained_target_draws(model, tokenizer):
    prompt = prompt_ids(tokenizer)
    for seed in (0, 1, 2):
        mx.random.seed(seed)
        ref = reference(model, tokenizer, prompt, None, 32, sampler=make_sampler(1.0))
        out, _, _ = constrained(model, tokenizer, prompt, None, max_tokens=32, temp=1.0, seed=seed)
        assert out == ref


def masked_distributions(model, tokenizer, prompt, out, schema, temp) -> np.ndarray:
    """(len(out), V) float64: what each output token was to be drawn from (mask, renormalise, temp)."""
    logits = model(mx.array([prompt + out[:-1]], dtype=mx.uint32))[0, len(prompt) - 1:]
    logits = np.array(logits.astype(mx.float32), dtype=np.float64)
    ref = ReferenceMask(tokenizer, schema, len(prompt))
    rows = []
    for i, row in enumerate(logits):
        ref.advance(prompt + out[:i])
        scaled = ref.mask(row)[0].astype(np.float64) / temp
        scaled -= scaled.max()
        p = np.exp(scaled)
        rows.append(p / p.sum())
    return np.array(rows)


def pit_pvalue(outputs, distributions, seed) -> float:
    rng = np.random.default_rng(seed)
    u = []
    for out, probs in zip(outputs, distributions, strict=True):
        for token, q in zip(out, probs, strict=True):
            if q[token] == 0:
                return 0.0  # a token outside the masked distribution
            above = q[q > q[token]].sum() + q[(q == q[token]) & (np.arange(len(q)) < token)].sum()
            u.append(above + rng.random() * q[token])
    return float(chisquare(np.histogram(u, bins=BINS, range=(0.0, 1.0))[0]).pvalue)


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "tempting"])
def test_sampled_dflash_follows_the_masked_distribution(model, drafter, tokenizer, kind):
    """Sample-and-match (a DFlash drafter, tempting drafts), and rejection sampling (DFlash2's stated q)."""
    prompt = prompt_ids(tokenizer)
    draft_model = {"dflash": drafter, "dflash2": tiny_dflash2(model, mask_token_id=MASK_ID)[0]}.get(kind)
    temp = 1.0
    outputs, rejected = [], 0
    for seed in range(30):
        proposer = TemptingProposer(model, tokenizer, None, len(prompt)) if kind == "tempting" else None
        out, _, constraint = constrained(model, tokenizer, prompt, None, max_tokens=24, drafter=draft_model,
                                         proposer=proposer, block_size=8 if draft_model else 4, temp=temp,
                                         seed=seed)
        outputs.append(out)
        rejected += constraint.rejected_drafts
    assert rejected > 0
    masked = [masked_distributions(model, tokenizer, prompt, out, None, temp) for out in outputs]
    assert pit_pvalue(outputs, masked, seed=5) > P_HONEST
    # The same tokens against the unmasked target: grammar tokens are not its samples (the test has power).
    unmasked = []
    for out in outputs:
        logits = model(mx.array([prompt + out[:-1]], dtype=mx.uint32))[0, len(prompt) - 1:]
        unmasked.append(np.array(mx.softmax(logits.astype(mx.float32) / temp, axis=-1), dtype=np.float64))
    assert pit_pvalue(outputs, unmasked, seed=5) < 1e-6


# -- the constraint on its own ----------------------------------------------------------------------
def test_rows_follow_the_draft_up_to_its_first_refused_token(tokenizer):
    constraint = TokenConstraint.for_json(tokenizer, dict(SCHEMA, **COMPACT), TARGET_VOCAB)
    ids = tokenizer.encode('{"ok":tr', add_special_tokens=False)
    before = constraint.allowed()
    rows = constraint.rows(ids + [MASK_ID, ids[0]])
    assert rows.shape == (len(ids) + 3, TARGET_VOCAB)
    fresh = TokenConstraint.for_json(tokenizer, dict(SCHEMA, **COMPACT), TARGET_VOCAB)
    for i, token in enumerate(ids):
        assert (rows[i] == fresh.allowed()).all()
        assert rows[i, token]
        fresh.commit([token])
    assert (rows[len(ids)] == fresh.allowed()).all() and not rows[len(ids), MASK_ID]
    assert rows[len(ids) + 1:].all()  # past the refused token: never used, left open
    assert constraint.rejected_drafts == 1
    assert (constraint.allowed() == before).all()  # the draft was rolled back
    assert not rows[:, tokenizer.vocab_size:][: len(ids) + 1].any()  # padding ids never allowed


def test_a_complete_reply_allows_only_the_stop_tokens(tokenizer):
    constraint = TokenConstraint.for_json(tokenizer, dict(SCHEMA, **COMPACT), TARGET_VOCAB)
    assert not constraint.allowed()[EOS_ID]
    constraint.commit(tokenizer.encode('{"ok":true,"size":"large","n":42}', add_special_tokens=False))
    assert constraint.complete
    assert np.flatnonzero(constraint.allowed()).tolist() == [EOS_ID]
    constraint.commit([EOS_ID])  # a stop token ends the reply; the grammar does not take it


def test_a_satisfied_grammar_allows_stop_and_continuation(tokenizer):
    constraint = TokenConstraint.for_json(tokenizer, {"type": "integer"}, TARGET_VOCAB)
    constraint.commit(tokenizer.encode("12", add_special_tokens=False))
    allowed = constraint.allowed()
    assert allowed[EOS_ID] and allowed[tokenizer.encode("3", add_special_tokens=False)[0]]
    assert not constraint.complete


def test_character_level_and_sentencepiece_tokenizers(tmp_path):
    write_tokenizer(tmp_path / "chars")  # WordLevel with a Fuse decoder: read token by token
    chars = load_tokenizer(tmp_path / "chars", eos_token_ids=[EOS_ID])
    constraint = TokenConstraint.for_json(chars, None, 128)
    assert [chars.decode([t]) for t in np.flatnonzero(constraint.allowed())] == ["{"]
    constraint.commit(chars.encode('{"a": [1, "x"]}', add_special_tokens=False))
    assert np.flatnonzero(constraint.allowed()).tolist() == [EOS_ID]

    from mlx_dflash.convert.gguf_tokenizer import _sentencepiece_bpe
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "{", "}", '"', ":", "a", "▁a"]
    sp = _sentencepiece_bpe(pieces, [0.0] * len(pieces), "<unk>", True)
    sp.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in pieces[:3]])
    PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(tmp_path / "sp"))
    spt = load_tokenizer(tmp_path / "sp", eos_token_ids=[2])
    constraint = TokenConstraint.for_json(spt, None, len(pieces))
    assert pieces.index("{") in np.flatnonzero(constraint.allowed())
    assert grammar_tokenizer(spt) is grammar_tokenizer(spt)  # built once per tokenizer


def test_unsupported_schemas_are_refused_by_name(tokenizer):
    for schema, words in (({"type": "string", "format": "weird"}, "weird"), ({"not": {"type": "string"}}, "not"),
                          ({"$ref": "#/nowhere"}, "nowhere")):
        with pytest.raises(GrammarError, match=words):
            TokenConstraint.for_json(tokenizer, schema, TARGET_VOCAB)


def test_unconstrained_decoding_is_unchanged(model, tokenizer):
    """No constraint: plain steps are still launched ahead, and output is the target's greedy output."""
    prompt = prompt_ids(tokenizer)
    session = DecodingSession(TargetModel(model))
    launched = []
    events = stream_session(session, prompt, make_sampler(0.0), max_tokens=12, stop=set(),
                            detokenizer=tokenizer.detokenizer, policy=FixedBlockSize(1))
    tokens = []
    for event in events:
        tokens += event.tokens
        launched.append(session.launched_ahead)
    assert tokens == greedy_reference(model, prompt, 12)
    assert any(launched)


def test_core_imports_without_llguidance(tokenizer, monkeypatch):
    code = ("import sys; sys.modules['llguidance'] = None\n"
            "import mlx_dflash.generate, mlx_dflash.decoding.session, mlx_dflash.decoding.constraint\n"
            "import mlx_dflash.server.worker.engine, mlx_dflash.server.apis.openai_api\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(StructuredOutputUnavailable, match=r"mlx-dflash\[serve\]"):
        json_schema_grammar(None)


def test_text_the_vocabulary_cannot_spell_ends_the_output_instead_of_failing(tmp_path):
    """A character-level vocabulary without 'ñ': the mask after the opening quote would let the
    unknown-token id through, which the parser then refuses; the row offers only the stop tokens."""
    from helpers.scripted import scripted_pair

    _, tokenizer, _ = scripted_pair(tmp_path, template="{{ messages[0].content }}", strings=['"'],
                                    script=[("x", '"', 50.0)])
    constraint = TokenConstraint.for_json(tokenizer, {"enum": ["ñ"]}, 200)
    quote = int(np.flatnonzero(constraint.allowed())[0])
    constraint.commit([quote])
    row = constraint.allowed()
    assert set(np.flatnonzero(row)) == set(constraint.stop_tokens)
    assert constraint.rows([]).shape == (1, 200)
