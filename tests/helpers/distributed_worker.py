"""Run by `mlx.launch -n 2 --backend ring` from test_distributed.py: each rank writes what it decoded.

    distributed_worker.py OUT_PREFIX
Greedy DFlash (real tiny drafter and a 30%-wrong scripted proposer) and the target alone,
tensor-parallel over the ranks, for qwen3, llama (tied), qwen3_5 and gpt_oss; then seeded
sampling with an oracle proposer (for the chi-square check), a prompt that differs between
ranks (rank 0's is decoded), and seeded sampling with a DFlash2 drafter (rejection sampling).
Models are rebuilt from seeds on every rank (identical weights), then sharded as `load_target` does.
What may differ between ranks (which proposer ran, how often the drafter did) is kept under "rank".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers package

import mlx_dflash  # noqa: E402
from helpers.distributions import PROMPT as SAMPLING_PROMPT  # noqa: E402
from helpers.distributions import SEED as SAMPLING_SEED  # noqa: E402
from helpers.distributions import MemoOracle  # noqa: E402
from helpers.families import build  # noqa: E402
from helpers.tiny import FakeTokenizer, ScriptedProposer, tiny_drafter, tiny_target  # noqa: E402
from helpers.tiny_dflash2 import tiny_dflash2  # noqa: E402
from mlx_dflash.distributed.world import shard_target, world  # noqa: E402
from mlx_dflash.drafters.dflash import DFlashDraftModel  # noqa: E402
from mlx_dflash.proposers.factory import make_proposer  # noqa: E402
from mlx_dflash.targets.model import TargetModel  # noqa: E402

FAMILIES = ["qwen3", "llama_tied", "qwen3_5", "gpt_oss"]
PROMPTS = [[5, 9, 33], [17, 60, 2, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 3], [64, 65, 66, 67]]
MAX_TOKENS = 20
SAMPLES = 500
TOK = FakeTokenizer(eos_token_ids=())  # no stop token: every run decodes MAX_TOKENS


def family_model(name: str):
    if name == "llama_tied":
        model = tiny_target("llama", seed=3)
        model.args.tie_word_embeddings = True  # the lm_head is the embedding: sharded targets keep it whole
        if "lm_head" in model:
            del model["lm_head"]
        return model
    return build(name, seed=1)


def tokens(events) -> list[int]:
    return [t for e in events for t in e.tokens]


DRAFTER_WORK = [0]  # drafter passes (blocks and context injections, v1 and DFlash2) on this rank


def count_drafter_work() -> None:
    for name in ("__call__", "fuse_context"):
        method = getattr(DFlashDraftModel, name)

        def counted(self, *args, _method=method, **kwargs):
            DRAFTER_WORK[0] += 1
            return _method(self, *args, **kwargs)

        setattr(DFlashDraftModel, name, counted)


def drafted(target: TargetModel, drafter, prompt, **kwargs) -> tuple[list[int], dict]:
    """One DFlash generation's tokens, and who drafted on this rank while it ran."""
    before = DRAFTER_WORK[0]
    out = tokens(mlx_dflash.stream_generate(target, TOK, prompt, draft_model=drafter, max_tokens=MAX_TOKENS,
                                            block_size=4, **kwargs))
    return out, {"proposer": type(make_proposer(target, drafter, 4)).__name__,
                 "drafter_work": DRAFTER_WORK[0] - before, "head_sharded": target.head_is_sharded}


def decode(out_prefix: str) -> None:
    w = world()
    count_drafter_work()
    results: dict = {"rank": {}}
    for name in FAMILIES:
        model = family_model(name)
        drafter = tiny_drafter(model, seed=5)  # from the whole model, before sharding (replicated)
        shard_target(model, w)
        target = TargetModel(model)
        for i, prompt in enumerate(PROMPTS):
            alone = tokens(mlx_dflash.stream_generate(target, TOK, prompt, max_tokens=MAX_TOKENS))
            dflash, results["rank"][f"{name}/{i}"] = drafted(target, drafter, prompt)
            proposer = ScriptedProposer(prompt + alone, target.vocab_size, error_rate=0.3, seed=i)
            events = list(mlx_dflash.stream_generate(target, TOK, prompt, draft_model=proposer,
                                                     max_tokens=MAX_TOKENS, block_size=6))
            results[f"{name}/{i}"] = {"alone": alone, "dflash": dflash, "scripted": tokens(events),
                                      "accepted": sum(e.num_draft_accepted for e in events)}
    # Seeded sampling (temperature 1) with an often-right proposer, as test_sampling does on one rank.
    model = tiny_target("qwen3", seed=SAMPLING_SEED, vocab=16, num_layers=2)
    shard_target(model, w)
    target = TargetModel(model)
    mx.random.seed(7)
    samples, accepted = [], 0
    for _ in range(SAMPLES):
        proposer = MemoOracle(model, SAMPLING_PROMPT)
        events = list(mlx_dflash.stream_generate(target, TOK, SAMPLING_PROMPT, draft_model=proposer,
                                                 max_tokens=3, block_size=3, temp=1.0))
        samples.append(tokens(events)[:3])
        accepted += sum(e.num_draft_accepted for e in events)
    results["sampling"] = {"samples": samples, "accepted": accepted}
    # Each rank tokenizes its own prompt text: every rank decodes rank 0's ids.
    model = family_model("qwen3")
    drafter = tiny_drafter(model, seed=5)
    dflash2, _ = tiny_dflash2(model, seed=2, block_size=4)
    shard_target(model, w)
    target = TargetModel(model)
    results["text_prompt"], _ = drafted(target, drafter, "hello" if w.is_main else "another prompt")
    # Seeded sampling with a DFlash2 drafter: rank 0 verifies its sampled drafts by rejection sampling.
    mx.random.seed(11)
    results["dflash2_sampling"] = []
    for i, prompt in enumerate(PROMPTS):
        out, results["rank"][f"dflash2/{i}"] = drafted(target, dflash2, prompt, temp=1.0)
        results["dflash2_sampling"].append(out)
    Path(f"{out_prefix}.rank{w.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    decode(sys.argv[1])
