"""Training a DFlash drafter with PyTorch (CUDA machines; the CPU for tests), the MLX trainer's recipe.

Same data (`data.Example`), anchors (`anchors.make_batch`), loss weights,
schedule and export layout (`recipe`) as the MLX `Trainer`; same optimizer
(AdamW with bias correction, global-norm clipping) and the same feature
scaling (features divided by their per-channel RMS, folded into `fc` at
export). Weights stay float32; `autocast` runs the forwards in bfloat16.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DFlashError
from . import recipe
from .anchors import Batch, make_batch
from .data import Example
from .torch_model import TorchDFlashDrafter, block_labels, block_token_ids, decayed_cross_entropy, draft_blocks
from .torch_target import TorchTarget

SHARD_BYTES = 16 * 2**20


@dataclass
class TorchTrainConfig:
    steps: int = 1000
    batch: int = 8
    blocks_per_seq: int = 32
    lr: float = recipe.DEFAULT_LR
    warmup: float = 0.04
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
    labels: str = "target"  # "target": the target's greedy predictions; "data": the sequence's own tokens
    autocast: bool = False  # bfloat16 forwards (CUDA); float32 master weights either way


@dataclass
class StepResult:
    loss: float
    accuracy: list[float]  # per block position 1..B-1
    tokens: int
    lr: float


class TorchTrainer:
    def __init__(self, target: TorchTarget, drafter: TorchDFlashDrafter, config: TorchTrainConfig, *,
                 pad_id: int = 0, seed: int = 0, feature_scale: torch.Tensor | None = None):
        if config.labels not in ("target", "data"):
            raise DFlashError(f"labels must be target or data, got {config.labels}")
        self.target, self.drafter, self.config = target, drafter, config
        self.device = target.device
        self.drafter.to(self.device)
        self.pad_id = pad_id
        self.rng = np.random.default_rng(seed)
        self.weights = torch.tensor(recipe.position_weight_values(drafter.block_size, config.gamma),
                                    dtype=torch.float32, device=self.device)
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=config.weight_decay)
        self.feature_scale = feature_scale
        self.step = 0

    def _autocast(self):
        if not self.config.autocast:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def measure_feature_scale(self, examples: Sequence[Example]) -> torch.Tensor:
        """Per-channel RMS of the selected layers over the first sequences, floored at recipe.MIN_SCALE."""
        total, count = None, 0
        for e in examples[: recipe.SCALE_EXAMPLES]:
            tokens = torch.tensor([e.ids], device=self.device)
            with self._autocast():
                _, f = self.target.forward(tokens, self.drafter.target_layer_ids)
            f = f.float().reshape(-1, f.shape[-1])
            s = (f * f).sum(dim=0)
            total = s if total is None else total + s
            count += f.shape[0]
        if total is None:
            raise DFlashError("the feature scale needs at least one training sequence")
        rms = torch.sqrt(total / count)
        self.feature_scale = torch.where(rms < recipe.MIN_SCALE, torch.ones_like(rms), rms)
        return self.feature_scale

    def learning_rate(self, step: int) -> float:
        c = self.config
        return recipe.learning_rate(step, lr=c.lr, steps=c.steps, warmup=c.warmup, min_lr_ratio=c.min_lr_ratio)

    def make_batch(self, examples: Sequence[Example]) -> Batch:
        return make_batch(examples, self.config.blocks_per_seq, self.rng, self.pad_id)

    def _block_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.device
        tokens = torch.as_tensor(batch.tokens, dtype=torch.long, device=d)
        anchors = torch.as_tensor(batch.anchors, dtype=torch.long, device=d)
        with self._autocast():
            hidden, features = self.target.forward(tokens, self.drafter.target_layer_ids)
            if self.config.labels == "data":
                labels_seq = tokens
            else:  # the target's greedy choice for position t + 1 is read at position t
                predicted = self.target.logits(hidden).argmax(dim=-1)
                labels_seq = torch.cat([tokens[:, :1], predicted[:, :-1]], dim=1)
            features = features / self.feature_scale.to(features.dtype)
            labels, valid = block_labels(labels_seq, torch.as_tensor(batch.loss_mask, device=d), anchors,
                                         torch.as_tensor(batch.anchor_valid, device=d), self.drafter.block_size)
            ids = block_token_ids(tokens, anchors, self.drafter.block_size, self.drafter.mask_token_id)
            h = draft_blocks(self.drafter, self.target.embed(ids), features, anchors)
            logits = self.target.logits(h[:, :, 1:])
        loss, hits = decayed_cross_entropy(logits, labels, valid, self.weights)
        return loss, hits, valid

    def train_step(self, batch: Batch) -> StepResult:
        """One optimizer step on one batch: the MLX trainer's step with accum = 1."""
        if self.feature_scale is None:
            raise DFlashError("measure the feature scale before training")
        self.drafter.train()
        lr = self.learning_rate(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, hits, valid = self._block_loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.step += 1
        accuracy = (hits.sum(dim=(0, 1)).float() / valid.sum(dim=(0, 1)).clamp(min=1)).tolist()
        return StepResult(float(loss.detach()), accuracy, int(batch.tokens.size), lr)

    @torch.no_grad()
    def evaluate(self, examples: Sequence[Example], batch: int = 8) -> dict[str, float | list[float]]:
        """Teacher-forced blocks at every anchor of held-out target replies: per-position accuracy and tau.

        When the replies are the target's own greedy output, a block's leading run of hits is
        what the engine would accept there, so 1 + mean run length estimates tau at this block size.
        """
        self.drafter.eval()
        rng = np.random.default_rng(0)
        hits_sum, valid_sum, runs, blocks = None, None, 0.0, 0
        for start in range(0, len(examples), batch):
            b = make_batch(examples[start:start + batch], 10**9, rng, self.pad_id)
            _, hits, valid = self._block_loss(b)
            h, v = hits.sum(dim=(0, 1)), valid.sum(dim=(0, 1))
            hits_sum = h if hits_sum is None else hits_sum + h
            valid_sum = v if valid_sum is None else valid_sum + v
            full = valid.all(dim=-1)  # blocks whose every position is inside a reply
            runs += float(torch.cumprod(hits.int(), dim=-1).sum(dim=-1)[full].sum())
            blocks += int(full.sum())
        accuracy = (hits_sum.float() / valid_sum.clamp(min=1)).tolist() if hits_sum is not None else []
        return {"tau": 1.0 + runs / max(blocks, 1), "blocks": blocks, "accuracy": accuracy}

    def inference_state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The drafter's weights as the engine takes them: `fc` reading raw features (the scale folded in)."""
        state = {k: v.detach().float().cpu() for k, v in self.drafter.state_dict().items()}
        state["fc.weight"] = state["fc.weight"] / self.feature_scale.float().cpu()[None, :]
        return {k: v.to(dtype).contiguous() for k, v in state.items()}

    def export(self, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = SHARD_BYTES
               ) -> Path:
        """Write the z-lab layout (config.json, safetensors in files of at most `shard_bytes`), atomically."""
        return write_drafter(self.inference_state(dtype), self.drafter.config, out_dir, shard_bytes=shard_bytes)


DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def write_drafter(state: dict[str, torch.Tensor], config: dict, out_dir: str | Path, *,
                  shard_bytes: int = SHARD_BYTES) -> Path:
    """config.json and model.safetensors (or numbered shards with an index) into `out_dir`, replaced whole."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if nbytes > shard_bytes:
            raise DFlashError(f"{name} alone ({nbytes} bytes) exceeds the shard size {shard_bytes}")
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    dtype = DTYPE_NAMES.get(next(iter(state.values())).dtype, "float32")
    (tmp / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2) + "\n")
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def planned_steps(budget_seconds: float, seconds_per_step: float) -> int:
    """How many steps fit the budget at the measured pace (at least one)."""
    return max(1, math.floor(budget_seconds / max(seconds_per_step, 1e-9)))
