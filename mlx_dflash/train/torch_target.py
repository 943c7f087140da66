"""The target model in PyTorch, for the PyTorch trainer: loading, layer features, batched greedy replies.

A GGUF target is dequantized by the `gguf` package and renamed by the same
code that converts it for MLX (`convert.gguf`), then built as a Hugging Face
model; a Hugging Face directory loads as it is. Features are the raw outputs
of the chosen decoder layers, taken with forward hooks (Hugging Face's last
`hidden_states` entry is after the final norm, so it cannot stand for a layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import DFlashError


class TorchTarget:
    """A frozen causal LM with the handles the trainer needs: embedding, lm_head, layer features."""

    def __init__(self, model: nn.Module):
        self.model = model.eval().requires_grad_(False)
        self.inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = self.inner.layers
        self.num_layers = len(self.layers)
        self.embedding = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.embedding.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(final-normed hidden states (B, T, D), the chosen layers' outputs concatenated (B, T, k*D))."""
        captured: dict[int, torch.Tensor] = {}

        def hook(index: int):
            def keep(module, args, output):
                captured[index] = output[0] if isinstance(output, tuple) else output
            return keep

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in layer_ids]
        try:
            out = self.inner(input_ids=tokens, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return out.last_hidden_state, torch.cat([captured[i] for i in layer_ids], dim=-1)

    @torch.no_grad()
    def greedy(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop: Sequence[int], pad_id: int
               ) -> list[tuple[list[int], int | None]]:
        """Greedy replies of prompts decoded together: (reply tokens, the stop token that ended it or None)."""
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), P), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token is at the same column
            ids[b, P - len(p):] = torch.tensor(list(p))
            attention[b, P - len(p):] = 1
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                                  max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                  eos_token_id=list(stop), pad_token_id=pad_id)
        replies = []
        stops = set(stop)
        for row in out[:, P:].tolist():
            end = next((i for i, t in enumerate(row) if t in stops), None)
            replies.append((row, None) if end is None else (row[:end], row[end]))
        return replies


def _hf_config(config: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return AutoConfig.for_model(config["model_type"], **fields)


def model_from_weights(config: dict[str, Any], weights: dict[str, Any]) -> nn.Module:
    """A Hugging Face causal LM in float32 from its config dict and named arrays (every key checked)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_hf_config(config), dtype=torch.float32)
    state = model.state_dict()
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    missing = set(state) - set(weights) - tied
    extra = set(weights) - set(state)
    if missing or extra:
        raise DFlashError(f"target weights do not fit the model: missing {sorted(missing)[:4]}, "
                          f"unexpected {sorted(extra)[:4]}")
    with torch.no_grad():
        for name, value in weights.items():
            tensor = torch.tensor(value)
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise DFlashError(f"target weight {name}: shape {tuple(tensor.shape)}, "
                                  f"the model wants {tuple(state[name].shape)}")
            state[name].copy_(tensor)
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    return model


def load_torch_target(path: str | Path, device: str | torch.device = "cpu") -> TorchTarget:
    """A GGUF file (llama, qwen2, qwen3) or a Hugging Face directory, in float32 on `device`."""
    path = Path(path)
    if path.is_file():
        from ..convert.gguf import config_from_metadata, hf_weights, read_dequantized

        tensors, meta = read_dequantized(path)
        config = config_from_metadata(meta, tensors, str(path))
        model = model_from_weights(config, hf_weights(tensors, config))
    elif path.is_dir():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        raise DFlashError(f"{path}: no such target (a GGUF file or a Hugging Face directory)")
    return TorchTarget(model.to(device))
