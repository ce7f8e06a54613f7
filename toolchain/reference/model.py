"""Reference forward pass of a TensorRT-LLM-format checkpoint, in float32 or float64 on CPU.

Reads only our checkpoint (config.json + rank0.safetensors), never the HF model, so comparing its logits
with transformers' proves the conversion; later stages compare quantized and engine outputs with it.
Attention here is plain causal attention over a dense [batch, seq] batch, the semantics the paged plugin op
must reproduce.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from toolchain.checkpoint.trtllm import ModelConfig, load_rank, read_config
from toolchain.reference.rope import apply_rotary, cos_sin


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# hidden_act values with TensorRT-LLM's meaning: its `gelu` (tensorrt_llm/functional.py) is the tanh
# approximation, the same function as HF's "gelu_new" / "gelu_pytorch_tanh".
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swiglu": F.silu,
    "gelu": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
}


class Hooks:
    """Points where calibration observes and fake quantization intervenes; the identity by default."""

    def linear_input(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def kv_cache(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class ReferenceModel:
    """A decoder-only transformer evaluated straight from TensorRT-LLM tensor names."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        self.config = config
        self.dtype = dtype
        self.w = {name: t.to(dtype) for name, t in weights.items()}
        self.hooks = Hooks()

    @classmethod
    def from_checkpoint(cls, directory: Path, dtype: torch.dtype = torch.float32) -> ReferenceModel:
        """The whole model; a multi-rank (TP/PP) checkpoint is merged back first."""
        config = read_config(directory)
        if config.mapping.world_size == 1:
            return cls(config, load_rank(directory, 0), dtype)
        from toolchain.reference.parallel import merge_ranks  # parallel builds on this module

        return cls(config, merge_ranks(directory), dtype)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        x = self.hooks.linear_input(prefix, x)
        return F.linear(x, self.w[f"{prefix}.weight"], self.w.get(f"{prefix}.bias"))

    def _norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """LayerNorm when the checkpoint has a bias for it (GPT-2), else RMSNorm (Llama, Qwen, Mistral)."""
        weight, bias = self.w[f"{prefix}.weight"], self.w.get(f"{prefix}.bias")
        if bias is not None:
            return F.layer_norm(x, weight.shape, weight, bias, self.config.norm_epsilon)
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.norm_epsilon) * weight

    def _heads(self, x: torch.Tensor, n: int, layer: str, norm: str) -> torch.Tensor:
        b, t, _ = x.shape
        x = x.view(b, t, n, self.config.head_size)
        if f"{layer}.attention.{norm}.weight" in self.w:  # per-head qk-norm (Qwen3), before rotary
            x = self._norm(x, f"{layer}.attention.{norm}")
        return x.transpose(1, 2)

    def _mask(self, t: int) -> torch.Tensor:
        q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = k <= q
        if self.config.sliding_window is not None:  # each query sees itself and the window-1 tokens before it
            allowed &= q - k < self.config.sliding_window
        return allowed

    def _attention(self, x: torch.Tensor, layer: str, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        q_dim, kv_dim = c.num_attention_heads * c.head_size, c.num_key_value_heads * c.head_size
        q, k, v = torch.split(self._linear(x, f"{layer}.attention.qkv"), [q_dim, kv_dim, kv_dim], dim=-1)
        q = self._heads(q, c.num_attention_heads, layer, "q_layernorm")
        k = self._heads(k, c.num_key_value_heads, layer, "k_layernorm")
        v = v.view(b, t, c.num_key_value_heads, c.head_size).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k, v = self.hooks.kv_cache(layer, k, v)  # what the KV cache stores: k after rotary, v
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / (c.head_size**0.5)
        probs = scores.masked_fill(~self._mask(t), float("-inf")).softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, t, q_dim)
        return self._linear(out, f"{layer}.attention.dense")

    def _mlp(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        act = ACTIVATIONS[self.config.hidden_act]
        h = act(self._linear(x, f"{layer}.mlp.fc"))
        if f"{layer}.mlp.gate.weight" in self.w:  # TensorRT-LLM GatedMLP: proj(act(fc(x)) * gate(x))
            h = h * self._linear(x, f"{layer}.mlp.gate")
        return self._linear(h, f"{layer}.mlp.proj")

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """input_ids [batch, seq] -> (hidden states, rotary cos/sin or None)."""
        c = self.config
        positions = torch.arange(input_ids.shape[1])
        h = F.embedding(input_ids, self.w["transformer.vocab_embedding.weight"])
        rope = None
        if c.position_embedding_type == "learned_absolute":
            h = h + self.w["transformer.position_embedding.weight"][positions]
        else:
            rope = cos_sin(positions, c.head_size, c.rotary_base, c.rotary_scaling, self.dtype)
        return h, rope

    def layer(self, h: torch.Tensor, i: int, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Decoder layer i (its weights must be in `self.w`)."""
        layer = f"transformer.layers.{i}"
        h = h + self._attention(self._norm(h, f"{layer}.input_layernorm"), layer, rope)
        return h + self._mlp(self._norm(h, f"{layer}.post_layernorm"), layer)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [batch, seq] -> logits [batch, seq, vocab] in `self.dtype`."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        h, rope = self.embed(input_ids)
        for i in range(self.config.num_hidden_layers):
            h = self.layer(h, i, rope)
        return self._linear(self.final_norm(h), "lm_head")

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The norm before lm_head: its input is lm_head's."""
        return self._norm(h, "transformer.ln_f")
