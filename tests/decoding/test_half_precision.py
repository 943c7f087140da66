"""Greedy decoding is exact in half precision, the dtype a Mac computes in by default.

On Metal (and CUDA) `default_dtype()` is None: the target runs in its checkpoint's
bfloat16 or float16 and the drafter is cast to the target's dtype (`mlx_dflash.load`); the
other tests run float32. Here every target family of the fixtures (the five core
families, and the hybrid GatedDeltaNet, sliding-window and multimodal ones that
`test_families.build` makes) is cast to bfloat16 and to float16 as `mlx_lm.convert` casts
a checkpoint (every floating parameter, norms included, but what the model's
`cast_predicate` keeps: Qwen3.5's A_log), with a tiny DFlash drafter cast as
`load_drafter` casts it. Greedy decoding (the real drafter at blocks 4 and 16; the
default, `auto` with prompt lookup; an often-right lookup in blocks of 8, so that deep
verify positions decide and rejections roll back) is compared with mlx-lm's
`generate_step` on the same cast target (`tiny.greedy_reference`, keeping the
log-probabilities it yields).

Two things are checked at every emitted token, up to any divergence:
- the token equals the target alone's;
- the log-probabilities the decoding chose it from (a verify pass's row, which computed
  several positions in one forward) equal the target alone's (a one-token step's) within
  ROW_ULPS units in the last place of the dtype at the row's magnitude.
Rounding may differ between a forward of L positions and one of one position, and at a
near-tie the argmax can then flip. A flip is not hidden: the first differing token is
located, the target alone's logits there are recomputed (same dtype; float32 for the
record), the margin between its token and the one emitted must be within FLIP_ULPS ulp
(rows within ROW_ULPS can only trade two logits that close), and it is printed and
warned about with family, dtype, position and margin. Any other divergence fails: a real
bug. After a flip the check goes on against the target alone continuing the emitted
tokens. Most runs must be equal token for token, so the test cannot pass vacuously.

On this CPU every run is exact, and the rows are bitwise equal except for the sliding-window
families in float16 (a few ulp: the attention sums a rotating cache's keys in another
order after a multi-token forward). MLX's CPU GatherMM (MoE experts) is float32-only: there
it is computed in float32 and rounded to the input dtype, as the Metal kernel accumulates.
"""

from __future__ import annotations

import warnings
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from helpers.families import FAMILIES, HYBRID_CONFIGS, build
from helpers.tiny import VOCAB, FakeTokenizer, greedy_reference, tiny_drafter
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_dflash
from mlx_dflash.decoding.block_size import FixedBlockSize
from mlx_dflash.decoding.loop import stream_session
from mlx_dflash.decoding.sampling import make_sampler
from mlx_dflash.decoding.session import DecodingSession
from mlx_dflash.proposers.dflash import DFlashProposer
from mlx_dflash.proposers.lookup import PromptLookup
from mlx_dflash.targets.dtypes import cast_floats
from mlx_dflash.targets.model import TargetModel, check_forward

ALL_FAMILIES = sorted(set(FAMILIES) | set(HYBRID_CONFIGS))
# name -> (dtype, significand precision in bits, the implicit bit included)
HALF = {"bfloat16": (mx.bfloat16, 8), "float16": (mx.float16, 11)}
# The decoding's log-probabilities vs the target alone's, in ulp at the row's largest |value|.
# On this CPU: 0, but up to 4 for gemma3 and 2 for gpt-oss in float16 (see above).
ROW_ULPS = 8
FLIP_ULPS = 2 * ROW_ULPS  # a flip's margin: both logits moved by ROW_ULPS, towards each other
MIN_EXACT = 0.75  # of each family x dtype's runs, at least this share equal the target alone exactly
MAX_TOKENS = 40

_rng = np.random.default_rng(0)
PROMPTS = {
    "short": [5, 17, 33, 90],
    "repeats": [40, 41, 77, 12, 9, 63] * 4,  # prompt lookup finds matches in it; past the window (8)
    "long": [int(t) for t in _rng.integers(4, VOCAB, 100)],
}
# The decodings of each prompt: the real drafter at blocks of 4 and 16 (it rarely guesses right:
# its verify passes decide at their first positions), `default` (what `stream_generate` does
# unasked: `auto` block sizes, prompt lookup on) and `lookup` (an often-right lookup in blocks
# of 8). Each on two prompts or more.
RUNS = {
    "short": ("block4", "block16", "default", "lookup"),
    "repeats": ("block16", "default", "lookup"),
    "long": ("block4", "lookup"),
}
RESULTS: dict[tuple[str, str], dict] = {}  # (family, dtype) -> what happened, for the summary


@pytest.fixture(scope="module", autouse=True)
def half_gather_mm():
    """MLX's CPU GatherMM is float32-only: compute it in float32 there, rounded to the input dtype."""
    probe = mx.gather_mm(mx.zeros((1, 1, 2), mx.bfloat16), mx.zeros((2, 2, 2), mx.bfloat16),
                         rhs_indices=mx.array([0], mx.uint32))
    try:
        mx.eval(probe)
        supported = True
    except RuntimeError:  # "[GatherMM::eval] Currently only supports float32."
        supported = False
    if supported:
        yield
        return
    native = mx.gather_mm

    def gather_mm(a, b, *args, **kwargs):
        if a.dtype in (mx.float16, mx.bfloat16):
            return native(a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs).astype(a.dtype)
        return native(a, b, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx, "gather_mm", gather_mm)
        yield


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if RESULTS:
        print("\nhalf precision, family x dtype: runs equal to the target alone, near-tie flips, largest row gap")
        for (family, dtype), r in sorted(RESULTS.items()):
            flips = "; ".join(f"{f['run']} token {f['position']} margin {f['ulps']:.2f} ulp" for f in r["flips"])
            print(f"  {family:12s} {dtype:9s} {r['exact']}/{r['runs']} exact, {len(r['flips'])} near-tie flips"
                  f"{' (' + flips + ')' if flips else ''}; rows within {r['gap']:.2f} ulp; real drafter "
                  f"accepted {r['accepted']} tokens; default cycles {dict(r['default'])}")


def converted(model, dtype: mx.Dtype):
    """`model` cast as `mlx_lm.convert --dtype` casts a checkpoint (what a Mac then loads as is)."""
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda path, p: p.astype(dtype) if keep(path) and mx.issubdtype(p.dtype, mx.floating) else p,
        model.parameters()))
    mx.eval(model.parameters())
    return model


def half_pair(family: str, name: str):
    """The family's tiny target and DFlash drafter, cast to `name` as they load on a Mac."""
    seed = FAMILIES.get(family, 1)
    model = converted(build(family, seed=seed), HALF[name][0])
    layer_ids = None if family in FAMILIES else [0, 3]  # as conftest / test_families make them
    drafter = tiny_drafter(build(family, seed=seed), block_size=16, target_layer_ids=layer_ids)
    cast_floats(drafter, TargetModel(model).dtype)  # load(): dtype=mx_dtype or target.dtype (None on a Mac)
    return model, drafter


def ulp(scale, precision: int):
    """One unit in the last place of numbers of magnitude `scale`, `precision` significand bits."""
    return np.exp2(np.floor(np.log2(scale)) - (precision - 1))


def target_alone(model, prompt: list[int], n: int) -> tuple[list[int], mx.array | None]:
    """`tiny.greedy_reference` (mlx-lm's generate_step), with the log-probabilities it yields (n, V)."""
    tokens, rows = [], []
    for token, logprobs in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=n):
        tokens.append(int(token))
        rows.append(logprobs)
    return tokens, mx.stack(rows) if rows else None


def plain_step_logits(model, context: list[int], steps: list[int]) -> mx.array:
    """The logits after the last of `steps`, computed as generate_step computes them: context[:-1]
    in one forward, then context[-1] and `steps` one token at a time."""
    cache = make_prompt_cache(model)
    if len(context) > 1:
        mx.eval(model(mx.array([context[:-1]], mx.uint32), cache=cache))
    for token in context[-1:] + steps:
        row = model(mx.array([[token]], mx.uint32), cache=cache)[0, -1]
        mx.eval(row)
    return row


def margins(logits: mx.array, a: int, b: int) -> tuple[float, float, float]:
    """(top-2 margin, logit[a] - logit[b], largest |logit|) of a row, in float32."""
    row = np.array(logits.astype(mx.float32))
    top = np.sort(row)[-2:]
    return float(top[1] - top[0]), float(row[a] - row[b]), float(np.abs(row).max())


def near_tie(family: str, name: str, model, context: list[int], steps: list[int], a: int, b: int) -> dict:
    """The target alone's margin between its token `a` and the emitted `b` after context + steps,
    recomputed in the dtype and (for the record) in float32."""
    row = plain_step_logits(model, context, steps)
    assert int(mx.argmax(row - mx.logsumexp(row, keepdims=True))) == a, "the replay lost the reference"
    top2, pair, scale = margins(row, a, b)
    fp32_top2, fp32_pair, _ = margins(plain_step_logits(build(family, seed=FAMILIES.get(family, 1)), context, steps),
                                      a, b)
    unit = float(ulp(scale, HALF[name][1]))
    return dict(top2=top2, pair=pair, scale=scale, ulps=abs(pair) / unit, fp32_top2=fp32_top2, fp32_pair=fp32_pair,
                target=a, emitted=b)


def row_gap(name: str, ours: mx.array, theirs: mx.array) -> np.ndarray:
    """Per position: the largest |difference| of two rows of log-probabilities, in ulp at theirs' magnitude."""
    ours, theirs = (np.array(x.astype(mx.float32)) for x in (ours, theirs))
    return np.abs(ours - theirs).max(axis=-1) / ulp(np.abs(theirs).max(axis=-1), HALF[name][1])


def check_exact(family: str, name: str, run: str, model, prompt: list[int], out: list[int], rows: mx.array | None,
                reference: list[int], reference_rows: mx.array | None) -> tuple[list[dict], float]:
    """`out` (and the log-probabilities `rows` it was chosen from) equal the target alone's, up
    to near-tie flips. Returns the flips and the largest row gap (ulp); anything else fails."""
    flips, start, worst = [], 0, 0.0
    while True:
        p = next((i for i, (x, y) in enumerate(zip(out[start:], reference, strict=True)) if x != y), len(reference))
        same = min(p + 1, len(reference))  # up to the first differing token, both saw the same tokens
        if rows is not None and same:
            gap = row_gap(name, rows[start : start + same], reference_rows[:same])
            worst = max(worst, float(gap.max()))
            at = start + int(gap.argmax())
            assert gap.max() <= ROW_ULPS, (
                f"{family} {name} prompt {len(prompt)} tokens, {run}: the log-probabilities token {at} was chosen "
                f"from are {gap.max():.2f} ulp from the target alone's (> {ROW_ULPS}): not rounding")
        if p == len(reference):
            return flips, worst
        position = start + p
        tie = near_tie(family, name, model, prompt + out[:start], reference[:p], reference[p], out[position])
        line = (f"{family} {name} prompt {len(prompt)} tokens, {run}: token {position} is {out[position]}, the "
                f"target alone's {reference[p]}; its margin {tie['pair']:.4g} = {tie['ulps']:.2f} ulp at |logit| "
                f"{tie['scale']:.3g} (top-2 {tie['top2']:.4g}; float32: {tie['fp32_pair']:.4g}, top-2 "
                f"{tie['fp32_top2']:.4g})")
        assert tie["ulps"] <= FLIP_ULPS, f"NOT a near-tie (> {FLIP_ULPS} ulp): {line}"
        print("near-tie flip: " + line)
        warnings.warn("near-tie flip: " + line, stacklevel=2)
        flips.append(dict(tie, run=run, position=position))
        assert len(flips) <= 3, f"{family} {name} {run}: too many flips"
        start = position + 1
        if start == len(out):
            return flips, worst
        # From here on: the target alone continuing the emitted tokens.
        reference, reference_rows = target_alone(model, prompt + out[:start], len(out) - start)


class OracleLookup(PromptLookup):
    """Prompt lookup that proposes the reference continuation, the tokens at fixed random
    positions (15%) wrong: every acceptance length occurs, so deep verify positions decide
    tokens, and rejections roll back (replaying the kept inputs on hybrid targets)."""

    WRONG = np.random.default_rng(1).random(1024) < 0.15  # by absolute position

    def __init__(self, sequence: list[int]):
        super().__init__()
        self.sequence = sequence

    def propose(self, tokens, limit):
        super().propose(tokens, limit)  # the index is kept as the real one keeps it
        start = len(tokens)
        out = self.sequence[start : start + limit]
        return [(t + 1) % VOCAB if self.WRONG[start + i] else t for i, t in enumerate(out)]


def decode(run: str, model, drafter, prompt: list[int], reference: list[int]):
    """One greedy decoding of MAX_TOKENS: (tokens, the rows they were chosen from, GenerationStats)."""
    if run == "lookup":
        session = DecodingSession(TargetModel(model), lookup=OracleLookup(prompt + reference + [0] * 16))
        events = list(stream_session(session, prompt, make_sampler(0.0), max_tokens=MAX_TOKENS, stop=set(),
                                     detokenizer=FakeTokenizer().detokenizer, policy=FixedBlockSize(8)))
    else:
        size = {"block4": 4, "block16": 16, "default": None}[run]  # None: `auto` with prompt lookup, the default
        events = list(mlx_dflash.stream_generate(model, FakeTokenizer(eos_token_ids=()), prompt, draft_model=drafter,
                                                 max_tokens=MAX_TOKENS, block_size=size))
    rows = mx.concatenate([e.logprobs for e in events if e.tokens])
    return [t for e in events for t in e.tokens], rows, events[-1].stats


@pytest.mark.parametrize("name", list(HALF))
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_half_precision_greedy_equals_the_target_alone(family, name):
    dtype = HALF[name][0]
    model, drafter = half_pair(family, name)
    target = TargetModel(model)
    # Cast as a converted checkpoint is, norms too; the drafter and its context cache as well.
    kept = getattr(model, "cast_predicate", lambda _: True)
    for path, p in tree_flatten(model.parameters()):
        assert p.dtype == dtype or not kept(path), (path, p.dtype)
    assert target.dtype == dtype and drafter.norm.weight.dtype == dtype
    assert DFlashProposer(drafter, target, max_block_size=16).cache.dtype == dtype
    check_forward(target)  # load_target's self-check holds in half precision too

    result = RESULTS[family, name] = dict(exact=0, runs=0, flips=[], gap=0.0, accepted=0, lookup=0,
                                          default=Counter())
    for key, prompt in PROMPTS.items():
        reference, reference_rows = target_alone(model, prompt, MAX_TOKENS)
        assert reference_rows.dtype == dtype  # computed in half precision ...
        if key == "short":  # ... which rounds: float32 gives other numbers
            fp32 = target_alone(build(family, seed=FAMILIES.get(family, 1)), prompt, 1)[1]
            assert not mx.array_equal(fp32, reference_rows[:1].astype(mx.float32)).item()
        for run in RUNS[key]:
            out, rows, stats = decode(run, model, drafter, prompt, reference)
            assert len(out) == MAX_TOKENS and rows.shape == reference_rows.shape, (run, len(out), rows.shape)
            flips, gap = check_exact(family, name, run, model, prompt, out, rows, reference, reference_rows)
            result["runs"] += 1
            result["exact"] += not flips
            result["flips"] += flips
            result["gap"] = max(result["gap"], gap)
            lengths = stats.acceptance_lengths
            if run == "lookup":
                result["lookup"] = max(result["lookup"], max(lengths))
            elif run == "default":  # what `auto` chose: cycles by source, and plain steps
                result["default"].update(stats.cycles_by_source, plain=stats.block_sizes.count(1))
            else:  # the real drafter's accepted tokens
                result["accepted"] += sum(lengths) - len(lengths)
    # Not vacuous: most runs equal the target alone token for token, and verify passes decided
    # tokens at deep positions (some of the lookup's blocks of 8 were accepted whole).
    assert result["exact"] >= MIN_EXACT * result["runs"], result
    assert result["lookup"] == 8, result


def test_the_checker_tells_near_ties_from_real_divergences():
    """Control: the checker rejects rows that are not the target's (even where every token is) and
    a token the target alone clearly did not choose; it accepts and reports a flip at a near-tie
    (a decoding that broke the tie the other way), then checks what follows against the target
    continuing the flipped tokens: a decoding that went on as if nothing had flipped fails."""
    family, name = "qwen3", "bfloat16"
    model, _ = half_pair(family, name)
    prompt = PROMPTS["short"]
    reference, rows = target_alone(model, prompt, MAX_TOKENS)
    assert reference == greedy_reference(model, prompt, MAX_TOKENS)  # the same ground truth
    assert check_exact(family, name, "control", model, prompt, reference, rows, reference, rows) == ([], 0.0)

    # The target's tokens, from rows off by more than rounding at one position.
    unit = float(ulp(np.abs(np.array(rows[20].astype(mx.float32))).max(), 8))
    shifted = mx.concatenate([rows[:20], rows[20:21] + mx.array(np.arange(VOCAB) % 2 * 16 * unit, rows.dtype),
                              rows[21:]])
    with pytest.raises(AssertionError, match="token 20 was chosen from are .* ulp .*not rounding"):
        check_exact(family, name, "control", model, prompt, reference, shifted, reference, rows)

    logits = np.array(mx.stack([rows[i] for i in range(MAX_TOKENS)]).astype(mx.float32))
    runner_up = []  # the best token but the target's own (which may tie with it)
    for row, token in zip(logits, reference, strict=True):
        others = row.copy()
        others[token] = -np.inf
        runner_up.append(int(others.argmax()))
    margin = np.array([row[t] - row[r] for row, t, r in zip(logits, reference, runner_up, strict=True)])
    units = ulp(np.abs(logits).max(axis=-1), 8)

    decisive = int((margin / units).argmax())
    wrong = reference[:decisive] + [runner_up[decisive]] + reference[decisive + 1 :]
    with pytest.raises(AssertionError, match=f"NOT a near-tie.*token {decisive} is {runner_up[decisive]}"):
        check_exact(family, name, "control", model, prompt, wrong, None, reference, rows)

    tie = int(np.flatnonzero(margin <= units)[0])  # the first near-tie (within 1 ulp of log-probability)
    assert tie < MAX_TOKENS // 2, tie
    flipped = reference[:tie] + [runner_up[tie]]
    rest, rest_rows = target_alone(model, prompt + flipped, MAX_TOKENS - len(flipped))
    honest = mx.concatenate([rows[: tie + 1], rest_rows])  # at the tie, the same row: either token
    with pytest.warns(UserWarning, match=f"near-tie flip: .*token {tie} is {runner_up[tie]}"):
        flips, gap = check_exact(family, name, "control", model, prompt, flipped + rest, honest, reference, rows)
    assert [(f["position"], f["emitted"], f["target"]) for f in flips] == [(tie, runner_up[tie], reference[tie])]
    assert gap == 0.0 and flips[0]["ulps"] <= 2  # (a log-probability's ulp, at a larger magnitude, is 1-2 logit ulp)
    # A decoding that emitted the flip but went on as if it had not (its cache kept the other token):
    # its rows after the flip are the old ones, not the target's continuing the emitted tokens.
    with pytest.raises(AssertionError, match=f"token {tie + 1} was chosen from .*not rounding"), \
            pytest.warns(UserWarning):
        check_exact(family, name, "control", model, prompt, flipped + reference[tie + 1 :], rows, reference, rows)
