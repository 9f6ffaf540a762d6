"""A small causal transformer for the model-in-the-loop demo.

Rollouts come from its logits through the producer's sampler, and the
trainer recomputes the same log-probs from the same weights, so the demo
shows on a real model what the transported supports are for. It is small
enough to build and run on CPU in seconds. Weights are saved as
safetensors (no pickle), with the configuration and a weight version in
the file's metadata, so a producer can reload them when the file changes.

torch is imported here: only the model's own producers and trainer load it.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from rollstream.common.errors import InvalidInput


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 4096
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    max_len: int = 1024  # positions: prompt, every turn and every tool answer together

    def __post_init__(self):
        for spec in fields(self):
            if getattr(self, spec.name) < 1:
                raise InvalidInput(f"{spec.name} must be at least 1, got {getattr(self, spec.name)}")
        if self.d_model % self.heads:
            raise InvalidInput(f"d_model must be a multiple of heads, got d_model={self.d_model}, heads={self.heads}")


class _Block(nn.Module):
    """Pre-norm attention (causal) and MLP, each added to the residual."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attention_out = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, width // self.heads)
                   .permute(2, 0, 3, 1, 4))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm and an
    output projection: `forward(tokens [B, T]) -> logits [B, T, vocab]`,
    where row `t` scores the token after position `t` (with `last_only`,
    `[B, 1, vocab]` for the last position alone: what generating needs)."""

    def __init__(self, config: TinyLMConfig = TinyLMConfig(), *, seed: int = 0):
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(_Block(config.d_model, config.heads) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=False)
        with torch.no_grad():  # from the seed alone, whatever the global RNG state
            for name, parameter in self.named_parameters():
                if parameter.dim() > 1:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5 / parameter.shape[-1] ** 0.5)
                elif name.endswith("bias"):
                    parameter.zero_()

    def forward(self, tokens: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        length = tokens.shape[-1]
        if length > self.config.max_len:
            raise InvalidInput(f"a sequence may have at most max_len={self.config.max_len} tokens, got {length}")
        positions = torch.arange(length, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.output(self.final_norm(x[:, -1:] if last_only else x))


_VERSION_KEY = "weight_version"


def save_weights(model: TinyLM, path: str | os.PathLike, version: str) -> None:
    """Write the weights, config and `version` to `path` atomically (a
    reader never sees a half-written file)."""
    metadata = {name: str(value) for name, value in asdict(model.config).items()}
    metadata[_VERSION_KEY] = version
    partial = f"{path}.partial"
    save_file({name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}, partial, metadata)
    os.replace(partial, path)


def load_weights(path: str | os.PathLike) -> tuple[TinyLM, str]:
    """The model a `save_weights` file holds, and its weight version."""
    # One handle for the version and the tensors: a writer may replace the file between two opens.
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        missing = [f.name for f in fields(TinyLMConfig) if f.name not in metadata] + (
            [] if _VERSION_KEY in metadata else [_VERSION_KEY])
        if missing:
            raise InvalidInput(f"{path} is not a TinyLM weights file: its metadata lacks {missing}")
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    model = TinyLM(TinyLMConfig(**{f.name: int(metadata[f.name]) for f in fields(TinyLMConfig)}))
    model.load_state_dict(tensors)
    return model.eval(), metadata[_VERSION_KEY]
