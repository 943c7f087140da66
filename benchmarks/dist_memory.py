"""Memory per rank of a tensor-parallel target plus a replicated DFlash drafter, from the configs.

    python benchmarks/dist_memory.py [--ranks 2 4] [--config-dir DIR]

mlx-lm's tensor parallelism for Qwen3/Llama splits every decoder layer's attention heads and MLP
columns across the ranks and keeps the embedding and lm_head whole on each; the drafter is whole on
every rank. Without --config-dir the table uses the published configs' values written below
(Qwen3-4B/8B and their z-lab b16 drafters: 5 layers of the target's width, fc over 5 target layers).
Weights only: add the KV cache (2 x layers x kv_heads x head_dim x bytes per token, split across
ranks) and MLX's working memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PUBLISHED = {
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
DRAFTER_LAYERS, DRAFTER_TARGET_LAYERS = 5, 5


def layer_params(c: dict) -> int:
    h, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return h * q + 2 * h * kv + q * h + 2 * hd + 3 * h * c["intermediate_size"] + 2 * h


def split(c: dict) -> tuple[int, int]:
    """(parameters split across ranks, parameters every rank holds) of a target."""
    embed = c["vocab_size"] * c["hidden_size"]
    whole = embed * (1 if c["tie_word_embeddings"] else 2) + c["hidden_size"]
    return c["num_hidden_layers"] * layer_params(c), whole


def drafter_params(c: dict) -> int:
    h = c["hidden_size"]
    return DRAFTER_LAYERS * layer_params(c) + DRAFTER_TARGET_LAYERS * h * h + 2 * h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--config-dir", type=Path, help="Directories NAME/config.json to use instead")
    args = parser.parse_args()
    configs = PUBLISHED if args.config_dir is None else {
        p.parent.name: json.loads(p.read_text()) for p in sorted(args.config_dir.glob("*/config.json"))}
    head = "| target | bits | whole target | " + " | ".join(f"per rank, {n} ranks" for n in args.ranks) + " |"
    print(head)
    print("|" + " --- |" * (3 + len(args.ranks)))
    for name, c in configs.items():
        shard, whole = split(c)
        draft = drafter_params(c)
        for bits, per in (("bf16", 2.0), ("4-bit", 0.5 + 4 / 64)):  # 4-bit: scales and biases per 64
            cells = [f"{(shard / n + whole + draft) * per / 1e9:.1f} GB" for n in args.ranks]
            print(f"| {name} + DFlash b16 | {bits} | {(shard + whole) * per / 1e9:.1f} GB + "
                  f"{draft * per / 1e9:.1f} GB drafter | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
