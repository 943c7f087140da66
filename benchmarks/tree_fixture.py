"""A trained tiny target + DFlash drafter pair for benchmarking draft trees and `--block-size auto`.

    python benchmarks/tree_fixture.py [DIR] [--rebuild] [--check]

DIR (default ~/.cache/mlx-dflash/tree-fixture) receives

    target/         an mlx-lm llama directory (4 layers, hidden 64, vocabulary 32) with its tokenizer
    drafter/        a 1-layer DFlash drafter (block 8) trained for it by the project's own MLX trainer
                    (`mlx_dflash.train.Trainer`, on the target's own greedy replies: `regenerate`)
    prompts.jsonl   10 held-out prompts, one JSON record a line: {"id", "prompt", "ids"}: `prompt` is
                    the user text (the bench's {"id", "prompt"} form: the target's chat template renders
                    it to exactly `ids`), `ids` the prompt's token ids (BOS included), ready to generate from
    train/          the drafter's training run (regenerated data, checkpoint, log)
    fixture.json    how it was built and what `--check` measured

and is reused when it is complete (`--rebuild` builds it again; the build is deterministic up to
floating-point summation order). The build takes a few CPU minutes.

The language (token ids 4..31; 0..3 are <unk> <s> </s> <mask>): values 0..26 (ids 4..30,
written a..z and #) count up by a step s in {1, 2, 4} modulo 27 for runs of RUN_LENGTH values;
then a patch: the marker `|` (id 31) and three values of a fixed random hash H of the two values
before each (h1 = H[x_-2, x_-1], h2 = H[x_-1, h1], h3 = H[h1, h2]); then the next run counts on
from h3 with step STEPS[h2 % 3]. The target learns it well (its greedy text has that shape; its
hash and run lengths need not be exact: what matters is its own greedy output).

What it is for: a DFlash drafter that is mostly right and spread thin. With the drafter alone
(prompt lookup off), blocks of 8 are mostly accepted inside runs, while each `|` starts a "bad
patch" the briefly trained drafter mostly gets wrong: the three hash values and the first values
of the next run (whose step is hashed too), 3-7 cycles of one token, after which it is right
again. The drafter is trained briefly on purpose (330 steps): its argmax is usually right but its
top-1 probability is often well under 0.9, the case where draft trees and the block-size policy
have real choices to make. As built here (`--check`): tau 5.1 at fixed block 8 over the 10
prompts x 64 tokens (per prompt 3.2-7.9), the drafted tokens' argmax right 72% of the time, their
top-1 probability median 0.86 and under 0.9 for 56% of them. `benchmarks/bench_tree.py` uses it.
"""

# ruff: noqa: I001  (mlx_dflash first: on Linux it loads OpenBLAS before mlx.core)
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import mlx_dflash  # noqa: F401  (OpenBLAS before mlx.core on Linux)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

DEFAULT_DIR = Path("~/.cache/mlx-dflash/tree-fixture").expanduser()
FORMAT = 1  # bump when the construction changes: an older fixture is then rebuilt

# The language.
VOCAB = 32
BOS, EOS, MASK = 1, 2, 3
NUM_VALUES = 27  # values 0..26 are ids 4..30
PATCH = 31  # the patch marker `|`
STEPS = (1, 2, 4)  # run steps (coprime with 27)
RUN_LENGTH = 40
CHARS = "abcdefghijklmnopqrstuvwxyz#|"  # ids 4..31
HASH_SEED = 1234

# The target.
TARGET_CONFIG = dict(
    model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=4, rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=4096,
    tie_word_embeddings=False, rope_theta=10000.0, eos_token_id=EOS, bos_token_id=BOS,
)
TARGET_STEPS = 300
TARGET_BATCH, TARGET_SEQ = 16, 128

# The drafter's data and training.
PROMPT_TOKENS = 24  # language tokens after BOS
REPLY_TOKENS = 96
CONVERSATIONS = 400  # the trainer keeps 32 out
DRAFTER = dict(layers=1, block_size=8, target_layers=[1, 3], steps=330, batch=8, lr=2e-3, blocks_per_seq=12,
               seq_len=128, warmup=0.05)

NUM_PROMPTS = 10
PROMPT_SEED = 10_000  # held-out prompts: seeds no training sequence uses
GEN_TOKENS = 64


def hash_table() -> np.ndarray:
    return np.random.default_rng(HASH_SEED).integers(0, NUM_VALUES, size=(NUM_VALUES, NUM_VALUES))


def language(rng: np.random.Generator):
    """An endless token stream of the language from a random state and phase."""
    table = hash_table()
    v, s = int(rng.integers(NUM_VALUES)), STEPS[int(rng.integers(len(STEPS)))]
    prev, left = (v - s) % NUM_VALUES, int(rng.integers(1, RUN_LENGTH + 1))
    while True:
        for _ in range(left):
            prev, v = v, (v + s) % NUM_VALUES
            yield v + 4
        yield PATCH
        h1 = int(table[prev, v])
        h2 = int(table[v, h1])
        h3 = int(table[h1, h2])
        yield from (h1 + 4, h2 + 4, h3 + 4)
        s, prev, v, left = STEPS[h2 % len(STEPS)], h2, h3, RUN_LENGTH


def sequence(seed: int, length: int) -> list[int]:
    """BOS and `length - 1` tokens of the language, from the state seeded by `seed`."""
    stream = language(np.random.default_rng(seed))
    return [BOS] + [next(stream) for _ in range(length - 1)]


def text(ids: list[int]) -> str:
    return "".join(CHARS[i - 4] for i in ids if i >= 4)


def write_tokenizer(path: Path) -> None:
    """A character-level fast tokenizer: <s> + the user's text is the prompt, the reply follows it directly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<mask>", *CHARS])}
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   mask_token="<mask>", clean_up_tokenization_spaces=False)
    fast.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}</s>"
        "{% else %}<s>{{ m['content'] }}{% endif %}{% endfor %}"
    )
    fast.save_pretrained(str(path))


def train_target(path: Path, log) -> None:
    """Train the tiny llama on the language (Adam, warm-up then cosine) and save it as an mlx-lm directory."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(TARGET_CONFIG)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(TARGET_CONFIG))
    warmup = 30
    schedule = optim.join_schedules([optim.linear_schedule(1e-4, 3e-3, warmup),
                                     optim.cosine_decay(3e-3, TARGET_STEPS - warmup, 1e-4)], [warmup])
    optimizer = optim.Adam(learning_rate=schedule)

    def loss_fn(model, x):
        return nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]).mean()

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    start = time.perf_counter()
    for step in range(TARGET_STEPS):
        seeds = range(step * TARGET_BATCH, (step + 1) * TARGET_BATCH)
        x = mx.array([sequence(s, TARGET_SEQ) for s in seeds])
        loss, grads = loss_and_grad(model, x)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        if step % 50 == 0 or step == TARGET_STEPS - 1:
            log(f"target step {step + 1}/{TARGET_STEPS}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=2) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    write_tokenizer(path)


def write_chat_data(path: Path) -> None:
    """Conversations of the language: the user's turn a prompt, the assistant's its continuation
    (the trainer replaces the replies with the target's own greedy ones)."""
    base = 1_000_000  # seeds apart from the target's training sequences
    with path.open("w") as f:
        for i in range(CONVERSATIONS):
            ids = sequence(base + i, 1 + PROMPT_TOKENS + REPLY_TOKENS)
            user, reply = text(ids[: 1 + PROMPT_TOKENS]), text(ids[1 + PROMPT_TOKENS:])
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": reply}]}) + "\n")


def train_drafter(root: Path, log) -> dict:
    from mlx_dflash.train import TrainConfig, Trainer

    data = root / "train" / "chat.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    write_chat_data(data)
    d = DRAFTER
    config = TrainConfig(
        target=str(root / "target"), data=[str(data)], out=str(root / "train"), layers=d["layers"],
        block_size=d["block_size"], target_layers=d["target_layers"], steps=d["steps"], batch=d["batch"],
        lr=d["lr"], warmup=d["warmup"], seq_len=d["seq_len"], blocks_per_seq=d["blocks_per_seq"],
        labels="target", seed=0, save_every=0, eval_every=0, eval_prompts=4, eval_max_tokens=GEN_TOKENS,
        regenerate=CONVERSATIONS, regenerate_max_tokens=REPLY_TOKENS, regenerate_batch=32,
    )
    trainer = Trainer(config)
    start = time.perf_counter()

    def report(event) -> None:
        if event.kind == "step" and (event.step % 20 == 0 or event.step == config.steps):
            acc = " ".join(f"{a:.2f}" for a in event.accuracy)
            log(f"drafter step {event.step}/{config.steps}: loss {event.loss:.3f} acc[1..7] {acc} "
                f"({time.perf_counter() - start:.0f} s)")
        elif event.kind == "eval":
            log(f"drafter tau (trainer's held-out prompts, block 8): {event.tau:.2f}")

    result = trainer.run(report)
    shutil.copytree(result.drafter_dir, root / "drafter", dirs_exist_ok=True)
    return {"steps": result.step, "status": result.status, "trainer_tau": result.tau, "config": d}


def write_prompts(path: Path) -> None:
    with path.open("w") as f:
        for i in range(NUM_PROMPTS):
            ids = sequence(PROMPT_SEED + i, 1 + PROMPT_TOKENS)
            f.write(json.dumps({"id": f"p{i}", "prompt": text(ids), "ids": ids}) + "\n")


def complete(root: Path) -> bool:
    try:
        return json.loads((root / "fixture.json").read_text()).get("format") == FORMAT and all(
            (root / p).exists() for p in ("target/model.safetensors", "drafter/model.safetensors", "prompts.jsonl"))
    except (OSError, ValueError):
        return False


def build(root: Path = DEFAULT_DIR, *, rebuild: bool = False, log=print) -> Path:
    """The fixture in `root`, built there unless a complete one is already there."""
    root = Path(root).expanduser()
    if complete(root) and not rebuild:
        return root
    for part in ("target", "drafter", "train", "prompts.jsonl", "fixture.json"):
        p = root / part
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_target(root / "target", log)
    target_seconds = time.perf_counter() - start
    drafter = train_drafter(root, log)
    write_prompts(root / "prompts.jsonl")
    seconds = time.perf_counter() - start
    log(f"built in {seconds:.0f} s (target {target_seconds:.0f} s)")
    (root / "fixture.json").write_text(json.dumps({
        "format": FORMAT, "build_seconds": round(seconds, 1), "target_seconds": round(target_seconds, 1),
        "target": {k: v for k, v in TARGET_CONFIG.items()}, "target_steps": TARGET_STEPS,
        "language": {"values": NUM_VALUES, "steps": STEPS, "run_length": RUN_LENGTH, "hash_seed": HASH_SEED},
        "drafter": drafter, "prompts": {"count": NUM_PROMPTS, "tokens": 1 + PROMPT_TOKENS, "seed": PROMPT_SEED},
    }, indent=2) + "\n")
    return root


def load(root: Path = DEFAULT_DIR):
    """(target model, tokenizer, drafter, prompts): prompts as dicts with "id", "prompt" and "ids"."""
    root = Path(root).expanduser()
    model, tokenizer, drafter = mlx_dflash.load(root / "target", root / "drafter")
    prompts = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return model, tokenizer, drafter, prompts


def check(root: Path, log=print) -> dict:
    """Greedy, drafter alone, fixed block 8 on the held-out prompts: tau, per-position acceptance,
    the drafter's top-1 probabilities, and the text with each cycle's accepted drafts marked."""
    from mlx_dflash.decoding.block_size import FixedBlockSize
    from mlx_dflash.decoding.loop import stream_session
    from mlx_dflash.decoding.sampling import make_sampler
    from mlx_dflash.decoding.session import DecodingSession
    from mlx_dflash.proposers.factory import make_lookup, make_proposer
    from mlx_dflash.targets.model import as_target

    model, tokenizer, drafter, prompts = load(root)
    target = as_target(model)
    top1, right, lengths = [], [], []
    reached = [0] * 7
    accepted = [0] * 7
    for p in prompts:
        proposer = make_proposer(target, drafter, 8)
        drafts: list[tuple[list[int], list[float]]] = []
        original = getattr(proposer, "draft_logits", None)  # the proposer's scores (None: tau only)

        def recording(last_token, position, block_size, original=original, drafts=drafts):
            logits = original(last_token, position, block_size)
            probs = mx.softmax(logits.astype(mx.float32), axis=-1)
            drafts.append((mx.argmax(probs, axis=-1).tolist(), mx.max(probs, axis=-1).tolist()))
            return logits

        if original is not None:
            proposer.draft_logits = recording
        session = DecodingSession(target, proposer, lookup=make_lookup(False))
        tokens, marks, cycle_lengths = [], [], []
        events = stream_session(session, p["ids"], make_sampler(0.0), max_tokens=GEN_TOKENS,
                                stop=set(tokenizer.eos_token_ids), detokenizer=tokenizer.detokenizer,
                                policy=FixedBlockSize(8))
        for i, event in enumerate(events):
            if i:  # the first event is the prefill's token
                cycle_lengths.append(len(event.tokens))
            marks.append(text(event.tokens))
            tokens += event.tokens
        # Each draft against what the target emitted after its pending token.
        pos = 1  # tokens[0] came from the prefill
        for (ids, probs), n in zip(drafts, cycle_lengths, strict=False):
            truth = tokens[pos: pos + 7]
            ok = True
            for k, (t, q) in enumerate(zip(ids, probs, strict=False)):
                if k >= len(truth):
                    break
                if ok:
                    reached[k] += 1
                    accepted[k] += t == truth[k]
                top1.append(q)
                right.append(t == truth[k])
                ok = ok and t == truth[k]
            pos += n
        lengths += cycle_lengths
        log(f"{p['id']}: tau {np.mean(cycle_lengths):.2f}  {text(p['ids'])} > {' '.join(marks)}")
    top1_np, right_np = np.array(top1 or [np.nan]), np.array(right or [False])
    summary = {
        "tau_block8": float(np.mean(lengths)),
        "acceptance_by_position": [round(a / max(r, 1), 3) for a, r in zip(accepted, reached, strict=True)],
        "draft_argmax_right": float(right_np.mean()),
        "draft_top1_median": float(np.median(top1_np)),
        "draft_top1_under_0.9": float((top1_np < 0.9).mean()),
        "draft_top1_under_0.9_when_right": float((top1_np[right_np] < 0.9).mean()),
    }
    log(f"tau at block 8 (fixed, drafter alone): {summary['tau_block8']:.2f} over {len(lengths)} cycles; "
        f"accepted by position (when reached): {summary['acceptance_by_position']}")
    log(f"drafted tokens: argmax right {summary['draft_argmax_right']:.0%}, top-1 probability median "
        f"{summary['draft_top1_median']:.2f}, under 0.9 for {summary['draft_top1_under_0.9']:.0%} "
        f"({summary['draft_top1_under_0.9_when_right']:.0%} of the right ones)")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--rebuild", action="store_true", help="build again even if a complete fixture is there")
    parser.add_argument("--check", action="store_true", help="measure tau and the drafter's confidence at block 8")
    args = parser.parse_args()
    root = build(args.dir, rebuild=args.rebuild, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(root)
    if args.check:
        summary = check(root)
        meta = json.loads((root / "fixture.json").read_text())
        meta["check"] = summary
        (root / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
