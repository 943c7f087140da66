"""Run every mode on every prompt, interleaved, and check that greedy outputs agree.

Modes run back to back on the same prompt (not one whole pass per mode), so slow
drift of the machine (heat, other load) hits all modes alike, and the mode that goes
first rotates from one prompt run to the next, so that no mode always runs after the
same other one (its leftover memory and cache state) or always first. With greedy decoding
every mode must produce the baseline's exact tokens: a mismatch is a failure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import DFlashError
from .datasets import Prompt
from .engines import Engine, Run

WARMUP_TOKENS = 8


@dataclass
class BenchConfig:
    max_tokens: int = 256
    temp: float = 0.0
    seed: int | None = 0
    repeats: int = 1
    think: bool | None = None  # None: the template's default
    contexts: Sequence[int | None] = (None,)  # None: the prompt as it is; n: padded to about n tokens


@dataclass
class Record:
    """One mode's run of one prompt turn (the JSON file's per-prompt record)."""

    dataset: str
    prompt_id: str
    turn: int
    context: int | None
    repeat: int
    mode: str
    block_size: int | str | None  # "auto": chosen each cycle
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_s: float
    decode_tps: float
    peak_memory_gb: float
    finish_reason: str | None
    acceptance_lengths: list[int]
    draft_s: float
    verify_s: float
    match: bool | None  # greedy: same tokens as the baseline; None when sampling
    first_mismatch: int | None  # index of the first differing token
    block_size_histogram: dict[int, int] = field(default_factory=dict)  # cycles per block size
    predicted_tokens: float = 0.0  # `auto`: the cost model's expectation, summed over its cycles
    predicted_seconds: float = 0.0
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # proposed tokens kept: dflash, lookup
    tree_budget: int | str = 0  # draft-tree nodes per cycle, "auto" (chosen each cycle) or 0 (linear blocks)
    tree_shape: str | None = None  # "spine" or "paper" for tree modes
    tree_sizes: list[int] = field(default_factory=list)  # each cycle's tree nodes (0: a linear block)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BenchResult:
    records: list[Record] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], think: bool | None) -> list[int]:
    """Prompt ids through the chat template (thinking switched where the template has it)."""
    if getattr(tokenizer, "chat_template", None):
        kwargs = {} if think is None else {"enable_thinking": think}
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
    return list(tokenizer.encode("\n\n".join(m["content"] for m in messages)))


def filler_text(tokenizer: Any, pool: Sequence[str], num_tokens: int) -> str:
    """About `num_tokens` tokens of real benchmark text (other prompts), to pad a context."""
    if num_tokens <= 0 or not pool:
        return ""
    parts, size, i = [], 0, 0
    while size < num_tokens:  # ~1 token per 2+ characters: stop once surely long enough
        parts.append(pool[i % len(pool)])
        size += len(parts[-1]) // 2 + 1
        i += 1
    ids = list(tokenizer.encode("\n\n".join(parts)))
    while len(ids) < num_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:num_tokens])


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _record(prompt: Prompt, turn: int, context: int | None, repeat: int, engine: Engine, run: Run,
            match: bool | None, mismatch: int | None) -> Record:
    decoded = max(len(run.tokens) - 1, 0)  # the first token comes from the prefill
    return Record(
        prompt.dataset, prompt.id, turn, context, repeat, engine.name, engine.block_size, run.prompt_tokens,
        len(run.tokens), run.ttft_s, run.decode_s, decoded / run.decode_s if run.decode_s > 0 else 0.0,
        run.peak_memory_gb, run.finish_reason, run.acceptance_lengths, run.draft_s, run.verify_s, match, mismatch,
        dict(sorted(Counter(run.block_sizes).items())), run.predicted_tokens, run.predicted_seconds,
        dict(run.accepted_by_source), getattr(engine, "tree_budget", 0), getattr(engine, "tree_shape", None),
        list(run.tree_sizes),
    )


def padded_text(tokenizer: Any, prompt: Prompt, context: int, pool: Sequence[str], think: bool | None) -> str:
    """The prompt after about `context` tokens of the other prompts' text (`--context`)."""
    base = len(chat_ids(tokenizer, [{"role": "user", "content": "\n\n" + prompt.turns[0]}], think))
    filler = filler_text(tokenizer, [p for p in pool if p != prompt.turns[0]] or pool, context - base)
    return filler + "\n\n" + prompt.turns[0] if filler else prompt.turns[0]


def run_bench(
    engines: Sequence[Engine],
    tokenizer: Any,
    prompts: Sequence[Prompt],
    config: BenchConfig,
    on_step: Callable[[Prompt, int], None] | None = None,
) -> BenchResult:
    """Every prompt (each turn, context and repeat) through every engine; engines[0] is the reference.

    A multi-turn prompt continues with the reference's answer, so every mode sees the same conversation.
    `on_step(prompt, turn)` is called after each prompt turn (progress display).
    """
    if not engines:
        raise DFlashError("no modes to benchmark")
    if not prompts:
        raise DFlashError("no prompts to benchmark")
    if config.repeats < 1 or config.max_tokens < 1:
        raise DFlashError("--repeats and --max-tokens must be >= 1")
    pool = [p.turns[0] for p in prompts]
    warm = chat_ids(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}], config.think)
    for engine in engines:  # compile/allocate once before anything is timed
        engine.run(warm, max_tokens=min(WARMUP_TOKENS, config.max_tokens), temp=config.temp, seed=config.seed)
    result = BenchResult()
    greedy = config.temp == 0
    rounds = 0
    for context in config.contexts:
        for prompt in prompts:
            for repeat in range(config.repeats):
                messages: list[dict[str, str]] = []
                for turn, text in enumerate(prompt.turns):
                    if turn == 0 and context:
                        text = padded_text(tokenizer, prompt, context, pool, config.think)
                    messages.append({"role": "user", "content": text})
                    ids = chat_ids(tokenizer, messages, config.think)
                    runs = _run_rotated(engines, rounds, ids, config)
                    rounds += 1
                    reference = runs[0].tokens
                    for engine, run in zip(engines, runs, strict=True):
                        mismatch = first_mismatch(reference, run.tokens) if greedy else None
                        if greedy and mismatch is not None:
                            result.failures.append(
                                f"{prompt.dataset}/{prompt.id} turn {turn + 1}"
                                f"{f' context {context}' if context else ''} repeat {repeat + 1}: "
                                f"{engine.name} differs from {engines[0].name} at generated token {mismatch}"
                            )
                        match = (mismatch is None) if greedy else None
                        result.records.append(_record(prompt, turn, context, repeat, engine, run, match, mismatch))
                    messages.append({"role": "assistant", "content": tokenizer.decode(reference)})
                    if on_step is not None:
                        on_step(prompt, turn)
    return result


def running_order(num_engines: int, round_index: int) -> list[int]:
    """The engines' order in one round: rotated by one each round (records stay in engine order)."""
    first = round_index % num_engines
    return [(first + i) % num_engines for i in range(num_engines)]


def _run_rotated(engines: Sequence[Engine], round_index: int, ids: list[int], config: BenchConfig) -> list[Run]:
    runs: dict[int, Run] = {}
    for i in running_order(len(engines), round_index):
        runs[i] = engines[i].run(ids, max_tokens=config.max_tokens, temp=config.temp, seed=config.seed)
    return [runs[i] for i in range(len(engines))]
