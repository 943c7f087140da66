"""The DFlash training loop: frozen target, trainable drafter, exact resume.

Each micro-batch: the frozen target runs once over the whole sequences
(capturing the selected layers' outputs, and its own greedy predictions when
those are the labels); random anchors in the assistant spans start draft
blocks, all of which run in one training forward; the loss is the
position-decayed cross-entropy. AdamW with linear warm-up and cosine decay,
gradient accumulation and clipping. Progress goes to a callback; the library
prints nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

from ..drafters.dflash import DFlashDraftModel, ModelArgs, default_target_layer_ids
from ..errors import DFlashError
from ..loading.loaders import load_target
from ..targets.dtypes import DTYPES, cast_floats
from ..targets.model import TargetModel
from . import checkpoint as ckpt
from .anchors import Batch, make_batch
from .data import ExampleStream, load_conversations, prompt_ids, split_heldout
from .evaluate import TauReport, measure_tau
from .export import drafter_config, export_drafter
from .loss import block_labels, decayed_cross_entropy, position_weights
from .model import block_token_ids, draft_blocks, init_from_target
from .recipe import DEFAULT_LR, SCALE_EXAMPLES
from .regenerate import REGENERATED, regenerated_conversations
from .scaling import feature_scale, fold_feature_scale

LABEL_SOURCES = ("target", "data")
# Fields a resumed run may change; everything else comes from the checkpoint.
RESUMABLE = ("steps", "max_minutes", "save_every", "eval_every", "eval_prompts", "eval_max_tokens")
# Fields a resumed run changes only when asked (the schedule then follows the new peak rate).
CHANGEABLE = ("lr",)


@dataclass
class TrainConfig:
    target: str
    data: list[str]
    out: str
    layers: int = 2
    block_size: int = 16
    target_layers: list[int] | None = None
    intermediate_size: int | None = None  # default: the target's
    mask_token_id: int | None = None  # default: a spare special token of the target
    steps: int = 1000
    batch: int = 1
    accum: int = 1
    lr: float = DEFAULT_LR
    warmup: float = 0.04  # fraction of the steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # loss decay; default by block size
    seq_len: int = 512
    blocks_per_seq: int = 32
    labels: str = "target"  # "target": the target's greedy predictions; "data": the data's tokens
    dtype: str = "float32"
    seed: int = 0
    max_minutes: float | None = None
    save_every: int = 100
    eval_every: int = 0  # 0: only at the end
    heldout: int = 32  # conversations kept out of training
    eval_prompts: int = 4
    eval_max_tokens: int = 64
    regenerate: int = 0  # training conversations whose replies the target rewrites first (0: none)
    regenerate_max_tokens: int = 384
    regenerate_batch: int = 16
    init_from_target: bool = True  # draft layers start as copies of the target's top layers

    def check(self) -> None:
        if self.labels not in LABEL_SOURCES:
            raise DFlashError(f"labels must be one of {', '.join(LABEL_SOURCES)}, got {self.labels}")
        if self.dtype not in DTYPES:
            raise DFlashError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype}")
        for name in ("layers", "steps", "batch", "accum", "seq_len", "blocks_per_seq", "regenerate_max_tokens",
                     "regenerate_batch"):
            if getattr(self, name) < 1:
                raise DFlashError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise DFlashError(f"block size must be >= 2, got {self.block_size}")
        if self.regenerate < 0:
            raise DFlashError(f"regenerate must be >= 0, got {self.regenerate}")
        if not self.lr > 0:
            raise DFlashError(f"learning rate must be > 0, got {self.lr}")


@dataclass
class TrainEvent:
    """What the loop reports: kind is start | step | eval | checkpoint | done."""

    kind: str
    step: int
    steps: int
    loss: float = math.nan
    accuracy: list[float] = field(default_factory=list)  # per block position 1..B-1
    lr: float = 0.0
    tokens_per_s: float = 0.0  # sequence tokens through the target per second
    elapsed: float = 0.0
    tau: float | None = None
    path: str | None = None
    message: str = ""


@dataclass
class TrainResult:
    step: int
    status: str  # finished | time budget | interrupted
    out: Path
    drafter_dir: Path | None
    tau: float | None
    elapsed: float


Callback = Callable[[TrainEvent], None]


def _no_callback(event: TrainEvent) -> None:
    pass


def choose_mask_token(tokenizer: Any, vocab_rows: int) -> int:
    """A token id the chat data never uses: the tokenizer's mask token, a spare row, or an idle special."""
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None and 0 <= mask_id < vocab_rows:
        return int(mask_id)
    if len(tokenizer.get_vocab()) < vocab_rows:
        return vocab_rows - 1
    reserved = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = [i for i, tok in added.items()
                if getattr(tok, "special", False) and i not in reserved and str(tok) not in template
                and 0 <= i < vocab_rows]
    if not specials:
        raise DFlashError("the target's tokenizer has no spare token for the mask; give --mask-token-id")
    return max(specials)


def build_drafter_args(config: TrainConfig, target: TargetModel, tokenizer: Any) -> ModelArgs:
    t = target.args
    heads = t.num_attention_heads
    layer_ids = config.target_layers or default_target_layer_ids(target.num_layers, config.layers)
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DFlashError(f"target layers {bad} are outside the target's {target.num_layers} layers")
    if len(set(layer_ids)) != len(layer_ids):
        # The default rule repeats layers for very shallow targets.
        raise DFlashError(f"target layers {list(layer_ids)} repeat a layer; give distinct --target-layers")
    mask_id = config.mask_token_id if config.mask_token_id is not None else choose_mask_token(
        tokenizer, target.vocab_size)
    return ModelArgs.from_dict({
        "hidden_size": target.hidden_size, "num_hidden_layers": config.layers,
        "intermediate_size": config.intermediate_size or t.intermediate_size,
        "num_attention_heads": heads, "num_key_value_heads": getattr(t, "num_key_value_heads", heads),
        "head_dim": getattr(t, "head_dim", None) or target.hidden_size // heads,
        "vocab_size": target.vocab_size, "rms_norm_eps": getattr(t, "rms_norm_eps", 1e-6),
        "rope_theta": getattr(t, "rope_theta", 10000.0), "rope_scaling": getattr(t, "rope_scaling", None),
        "max_position_embeddings": getattr(t, "max_position_embeddings", 40960) or 40960,
        "block_size": config.block_size, "num_target_layers": target.num_layers,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(layer_ids),
                          "block_size": config.block_size},
    })


class Trainer:
    def __init__(self, config: TrainConfig, *, resume: bool = False, target_model: nn.Module | None = None,
                 tokenizer: Any = None, on_regenerate: Callable[[int, int], None] | None = None,
                 change: tuple[str, ...] = ()):
        """Load the target and data (regenerating replies first when asked) and build the drafter.

        on_regenerate(done, total) reports regeneration progress. `change`: fields a resumed
        run takes from `config` besides `RESUMABLE` ("lr": a new peak rate from here on).
        """
        out = Path(config.out)
        state = None
        if resume:
            state = ckpt.read_state(out)
            saved = dict(state.config)
            unknown = set(change) - set(CHANGEABLE)
            if unknown:
                raise DFlashError(f"a resumed run cannot change {', '.join(sorted(unknown))}")
            saved.update({k: getattr(config, k) for k in RESUMABLE + tuple(change)})
            config = TrainConfig(**saved)
        config.check()
        self.config, self.out = config, out
        self.dtype = DTYPES[config.dtype]
        if target_model is None:
            target_model, tokenizer = load_target(config.target, dtype=self.dtype)
        else:
            cast_floats(target_model, self.dtype)
        target_model.freeze()
        self.target = TargetModel(target_model)
        self.tokenizer = tokenizer
        conversations = load_conversations(config.data)
        train, heldout = split_heldout(conversations, config.heldout, config.seed)
        if config.regenerate:
            train = regenerated_conversations(self.target, tokenizer, train[: config.regenerate], out / REGENERATED,
                                              max_tokens=config.regenerate_max_tokens,
                                              max_prompt_tokens=max(config.seq_len - 32, config.seq_len // 2),
                                              batch_size=config.regenerate_batch,
                                              progress=on_regenerate)
        self.stream = ExampleStream(tokenizer, train, max_tokens=config.seq_len, seed=config.seed)
        self.eval_prompts = self._eval_prompts(heldout)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        mx.random.seed(config.seed)  # the drafter's initial weights
        self.args = build_drafter_args(config, self.target, tokenizer)
        self.drafter = DFlashDraftModel(self.args)
        if config.init_from_target and state is None:
            init_from_target(self.drafter, self.target)
        cast_floats(self.drafter, self.dtype)
        self.weights = position_weights(config.block_size, config.gamma)
        # Bias correction matters here: early steps would otherwise move by a fraction of lr.
        self.optimizer = optim.AdamW(learning_rate=self._schedule(), weight_decay=config.weight_decay,
                                     bias_correction=True)
        self.rng = np.random.default_rng(config.seed)
        self.step, self.elapsed_before = 0, 0.0
        if state is not None:
            ckpt.load_weights(out, self.drafter, self.optimizer)
            self.feature_scale = ckpt.load_extra(out).get("feature_scale")
            if self.feature_scale is None:
                raise DFlashError(f"{out}: the checkpoint has no feature scale (written by an older version)")
            self.step, self.elapsed_before = state.step, state.elapsed
            self.stream.restore(state.data)
            self.rng.bit_generator.state = state.rng
        else:
            self.optimizer.init(self.drafter.trainable_parameters())
            self.feature_scale = self._measure_feature_scale(train)
        self.loss_and_grad = nn.value_and_grad(self.drafter, self._loss)

    def _measure_feature_scale(self, train: list) -> mx.array:
        """Per-channel RMS of the selected target layers over the first training sequences."""
        stream = ExampleStream(self.tokenizer, train, max_tokens=self.config.seq_len, seed=self.config.seed)
        features = []
        for _ in range(SCALE_EXAMPLES):
            tokens = mx.array([stream.next().ids])
            _, f = self.target.forward(tokens, [None] * self.target.num_layers, self.args.target_layer_ids)
            mx.eval(f)
            features.append(f)
        return feature_scale(features)

    def inference_drafter(self) -> DFlashDraftModel:
        """The trained drafter as the engine and the export take it: reading raw target features."""
        return fold_feature_scale(self.drafter, self.feature_scale)

    def _eval_prompts(self, heldout: list) -> list[list[int]]:
        prompts = []
        for conversation in heldout:
            ids = prompt_ids(self.tokenizer, conversation)
            if len(ids) <= self.config.seq_len:
                prompts.append(ids)
            if len(prompts) == self.config.eval_prompts:
                break
        return prompts

    def _schedule(self) -> Callable[[mx.array], mx.array]:
        c = self.config
        warmup = max(1, round(c.warmup * c.steps))
        decay = optim.cosine_decay(c.lr, max(1, c.steps - warmup), end=c.lr * c.min_lr_ratio)
        return optim.join_schedules([optim.linear_schedule(c.lr / warmup, c.lr, warmup), decay], [warmup])

    def _target_pass(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Features of the selected layers, and the label wanted at every position."""
        hidden, features = self.target.forward(tokens, [None] * self.target.num_layers,
                                               self.args.target_layer_ids)
        if self.config.labels == "data":
            return features, tokens
        # The target's greedy choice for position t + 1 is read at position t.
        predicted = mx.argmax(self.target.logits(hidden), axis=-1).astype(tokens.dtype)
        return features, mx.concatenate([tokens[:, :1], predicted[:, :-1]], axis=1)

    def _loss(self, block_embeddings, features, anchors, labels, valid):
        hidden = draft_blocks(self.drafter, block_embeddings, features, anchors)
        logits = self.target.logits(hidden[:, :, 1:]).astype(mx.float32)
        return decayed_cross_entropy(logits, labels, valid, self.weights)

    def _micro_step(self, batch: Batch) -> tuple[mx.array, Any, mx.array, mx.array]:
        tokens = mx.array(batch.tokens)
        anchors = mx.array(batch.anchors)
        features, labels_seq = self._target_pass(tokens)
        features = mx.stop_gradient(features) / self.feature_scale.astype(features.dtype)
        labels, valid = block_labels(labels_seq, mx.array(batch.loss_mask), anchors,
                                     mx.array(batch.anchor_valid), self.config.block_size)
        ids = block_token_ids(tokens, anchors, self.config.block_size, self.args.mask_token_id)
        embeddings = self.target.embed(ids)
        (loss, hits), grads = self.loss_and_grad(embeddings, features, anchors, labels, valid)
        return loss, grads, hits.sum(axis=(0, 1)), valid.sum(axis=(0, 1))

    def train_step(self) -> tuple[float, list[float], int]:
        """One optimizer step over `accum` micro-batches; returns loss, accuracies, tokens."""
        c = self.config
        total_grads, losses, hits, counts, tokens = None, [], 0, 0, 0
        for _ in range(c.accum):
            examples = [self.stream.next() for _ in range(c.batch)]
            tokens += sum(len(e.ids) for e in examples)
            batch = make_batch(examples, c.blocks_per_seq, self.rng, self.pad_id)
            loss, grads, h, n = self._micro_step(batch)
            total_grads = grads if total_grads is None else tree_map(mx.add, total_grads, grads)
            mx.eval(loss, total_grads, h, n)
            losses.append(loss.item())
            hits, counts = hits + h, counts + n
        if c.accum > 1:
            total_grads = tree_map(lambda g: g / c.accum, total_grads)
        if c.grad_clip > 0:
            total_grads, _ = optim.clip_grad_norm(total_grads, c.grad_clip)
        self.optimizer.update(self.drafter, total_grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state)
        self.step += 1
        accuracy = (hits.astype(mx.float32) / mx.maximum(counts, 1)).tolist()
        return float(np.mean(losses)), accuracy, tokens

    def evaluate(self, block_size: int | None = None) -> TauReport:
        return measure_tau(self.target, self.tokenizer, self.inference_drafter(), self.eval_prompts,
                           max_tokens=self.config.eval_max_tokens, block_size=block_size or self.config.block_size)

    def save(self, data_state: dict[str, int], rng_state: dict[str, Any], elapsed: float) -> Path:
        state = ckpt.CheckpointState(self.step, dataclasses.asdict(self.config), data_state, rng_state, elapsed)
        return ckpt.save_checkpoint(self.out, self.drafter, self.optimizer, state,
                                    drafter_config(self.args, self.dtype), {"feature_scale": self.feature_scale})

    def _log(self, record: dict[str, Any]) -> None:
        with (self.out / "train_log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def run(self, callback: Callback = _no_callback) -> TrainResult:
        c = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        callback(TrainEvent("start", self.step, c.steps, message=f"{len(self.eval_prompts)} held-out prompts"))
        # The data/RNG state after the last completed step: a resume repeats nothing.
        self._snapshot = (self.stream.state(), self.rng.bit_generator.state)
        with _deferred_interrupt() as interrupt:
            try:
                status = self._loop(callback, start, interrupt)
            except KeyboardInterrupt:
                status = "interrupted"
        elapsed = self.elapsed_before + time.perf_counter() - start
        path = self.save(*self._snapshot, elapsed)
        callback(TrainEvent("checkpoint", self.step, c.steps, elapsed=elapsed, path=str(path)))
        drafter_dir, tau = None, None
        if status != "interrupted":
            drafter_dir = export_drafter(self.inference_drafter(), self.out / "drafter", dtype=self.dtype)
            tau = self._eval_event(callback, elapsed) if self.eval_prompts else None
        callback(TrainEvent("done", self.step, c.steps, elapsed=elapsed, tau=tau, message=status,
                            path=str(drafter_dir) if drafter_dir else None))
        return TrainResult(self.step, status, self.out, drafter_dir, tau, elapsed)

    def _loop(self, callback: Callback, start: float, interrupt: _Interrupt) -> str:
        c = self.config
        budget = c.max_minutes * 60 if c.max_minutes else math.inf
        last_step_time = 0.0
        while self.step < c.steps:
            if interrupt.requested:
                return "interrupted"
            if time.perf_counter() - start + last_step_time > budget:
                return "time budget"
            t0 = time.perf_counter()
            loss, accuracy, tokens = self.train_step()
            self._snapshot = (self.stream.state(), self.rng.bit_generator.state)
            last_step_time = time.perf_counter() - t0
            elapsed = self.elapsed_before + time.perf_counter() - start
            lr = self.optimizer.learning_rate.item()
            event = TrainEvent("step", self.step, c.steps, loss, accuracy, lr, tokens / last_step_time, elapsed)
            self._log({"step": self.step, "loss": loss, "accuracy": accuracy, "lr": lr,
                       "tokens_per_s": event.tokens_per_s, "elapsed": elapsed})
            callback(event)
            if self.step >= c.steps:
                break
            if c.save_every and self.step % c.save_every == 0:
                path = self.save(*self._snapshot, elapsed)
                callback(TrainEvent("checkpoint", self.step, c.steps, elapsed=elapsed, path=str(path)))
            if c.eval_every and self.step % c.eval_every == 0:
                self._eval_event(callback, elapsed)
        return "finished"

    def _eval_event(self, callback: Callback, elapsed: float) -> float:
        report = self.evaluate()
        self._log({"step": self.step, "tau": report.tau, "eval_tokens": report.num_tokens})
        callback(TrainEvent("eval", self.step, self.config.steps, elapsed=elapsed, tau=report.tau,
                            message=f"{report.num_prompts} prompts, {report.num_tokens} tokens"))
        return report.tau


class _Interrupt:
    requested = False


@contextmanager
def _deferred_interrupt() -> Iterator[_Interrupt]:
    """The first Ctrl-C asks the loop to stop after the current step; a second one stops at once."""
    flag = _Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
