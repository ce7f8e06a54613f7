"""Reference forward pass of a TensorRT-LLM-format checkpoint, in float32 or float64 on CPU.

Reads only our checkpoint (config.json + rank0.safetensors), never the HF model, so comparing its logits
with transformers' proves the conversion; later stages compare quantized and engine outputs with it.
Attention here is plain causal attention over a dense [batch, seq] batch, the semantics the paged plugin op
must reproduce.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from toolchain.checkpoint.trtllm import ModelConfig, load_rank, read_config
from toolchain.reference.rope import apply_rotary, cos_sin


class ReferenceModel:
    """A decoder-only transformer evaluated straight from TensorRT-LLM tensor names."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        self.config = config
        self.dtype = dtype
        self.w = {name: t.to(dtype) for name, t in weights.items()}

    @classmethod
    def from_checkpoint(cls, directory: Path, dtype: torch.dtype = torch.float32) -> ReferenceModel:
        return cls(read_config(directory), load_rank(directory, 0), dtype)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{prefix}.weight"], self.w.get(f"{prefix}.bias"))

    def _rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.norm_epsilon) * self.w[name]

    def _attention(self, x: torch.Tensor, layer: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        q_dim, kv_dim = c.num_attention_heads * c.head_size, c.num_key_value_heads * c.head_size
        qkv = self._linear(x, f"{layer}.attention.qkv")
        q, k, v = torch.split(qkv, [q_dim, kv_dim, kv_dim], dim=-1)
        q = q.view(b, t, c.num_attention_heads, c.head_size).transpose(1, 2)
        k = k.view(b, t, c.num_key_value_heads, c.head_size).transpose(1, 2)
        v = v.view(b, t, c.num_key_value_heads, c.head_size).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / (c.head_size**0.5)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, t, q_dim)
        return self._linear(out, f"{layer}.attention.dense")

    def _mlp(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        # TensorRT-LLM GatedMLP: proj(act(fc(x)) * gate(x)).
        return self._linear(
            F.silu(self._linear(x, f"{layer}.mlp.fc")) * self._linear(x, f"{layer}.mlp.gate"),
            f"{layer}.mlp.proj",
        )

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [batch, seq] -> logits [batch, seq, vocab] in `self.dtype`."""
        c = self.config
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        positions = torch.arange(input_ids.shape[1])
        cos, sin = cos_sin(positions, c.head_size, c.rotary_base, c.rotary_scaling, self.dtype)
        h = F.embedding(input_ids, self.w["transformer.vocab_embedding.weight"])
        for i in range(c.num_hidden_layers):
            layer = f"transformer.layers.{i}"
            h = h + self._attention(self._rms_norm(h, f"{layer}.input_layernorm.weight"), layer, cos, sin)
            h = h + self._mlp(self._rms_norm(h, f"{layer}.post_layernorm.weight"), layer)
        h = self._rms_norm(h, "transformer.ln_f.weight")
        return F.linear(h, self.w["lm_head.weight"])
