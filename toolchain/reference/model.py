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

from toolchain.checkpoint.spec import DenseFFN, ExpertsFFN, LayerSpec, Norm, spec_of
from toolchain.checkpoint.trtllm import ModelConfig, load_rank, read_config
from toolchain.errors import UserError
from toolchain.reference.rope import apply_rotary, cos_sin


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# hidden_act values (spec.ACTIVATIONS) with TensorRT-LLM's meaning: its `gelu` (tensorrt_llm/functional.py) is the
# tanh approximation, the same function as HF's "gelu_new" / "gelu_pytorch_tanh".
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swiglu": F.silu,
    "gelu": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
}


def swiglu(ffn: ExpertsFFN, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """An expert's activation: up * act(gate), or gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate):
    gate clamped to at most the limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + beta)."""
    if not ffn.clamped_swiglu:
        return ACTIVATIONS[ffn.activation](gate) * up
    if ffn.swiglu_limit is not None:
        gate = gate.clamp(max=ffn.swiglu_limit)
        up = up.clamp(min=-ffn.swiglu_limit, max=ffn.swiglu_limit)
    return gate * torch.sigmoid(gate * ffn.swiglu_alpha) * (up + ffn.swiglu_beta)


class Hooks:
    """Points where calibration observes and fake quantization intervenes; the identity by default."""

    def linear_input(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def linear(self, prefix: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """The whole linear x · weightᵀ (no bias) where the engine does more than transform its input (dynamic
        per-block activation quantization, per-part scales); None: `linear_input`, then the product."""
        return None

    def kv_cache(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def expert_input(self, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """The rows routed to `expert` on their way into its slice of stacked linear PREFIX (mlp.fc: the normed
        hidden states; mlp.proj: the activated intermediate), only those tokens (routed calibration)."""
        return x


class Widened(dict[str, torch.Tensor]):
    """Weights kept in their stored dtype and handed out in `dtype`, one tensor at a time: a float64 forward over a
    float32 or bf16 checkpoint then holds one widened weight at a time, not a widened copy of the model (the
    calibration's: 8 bytes a parameter for the embedding table and every layer would double or quadruple its
    memory). `stored` gives a tensor as it is (the embedding lookup widens only the rows it takes)."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__(weights)
        self.dtype = dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return super().__getitem__(name).to(self.dtype)

    def stored(self, name: str) -> torch.Tensor:
        return super().__getitem__(name)


class ReferenceModel:
    """A decoder-only transformer evaluated straight from TensorRT-LLM tensor names."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        widen_lazily: bool = False,
    ):
        """`widen_lazily`: keep the weights as stored and widen each where it is used (`Widened`): less memory, a
        conversion per use (calibration); else every weight is converted to `dtype` once, here."""
        self.config = config
        self.dtype = dtype
        self.w: dict[str, torch.Tensor] = (
            Widened(weights, dtype) if widen_lazily else {name: t.to(dtype) for name, t in weights.items()}
        )
        self.hooks = Hooks()
        self.spec = spec_of(config)
        self.row_biases = True  # the row-parallel linears' (dense, proj) biases; a TP shard leaves them to the sum
        self._rope_cache: dict[tuple[float, str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_checkpoint(cls, directory: Path, dtype: torch.dtype = torch.float32) -> ReferenceModel:
        """The whole model; a multi-rank (TP/PP) checkpoint is merged back first."""
        config = read_config(directory)
        if config.mapping.world_size == 1:
            weights = load_rank(directory, 0)
        else:
            from toolchain.reference.parallel import merge_ranks  # parallel builds on this module

            weights = merge_ranks(directory)
        spec_of(config).check_tensors(weights, str(directory / "rank0.safetensors"))
        return cls(config, weights, dtype)

    def _linear(self, x: torch.Tensor, prefix: str, bias: bool = False) -> torch.Tensor:
        weight = self.w[f"{prefix}.weight"]
        y = self.hooks.linear(prefix, x, weight)
        if y is None:
            return F.linear(self.hooks.linear_input(prefix, x), weight, self.w[f"{prefix}.bias"] if bias else None)
        return y + self.w[f"{prefix}.bias"] if bias else y

    def norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        weight = self.w[f"{norm.name}.weight"]
        if norm.kind == "layer":
            return F.layer_norm(x, weight.shape, weight, self.w[f"{norm.name}.bias"], norm.eps)
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + norm.eps) * weight

    def _heads(self, x: torch.Tensor, n: int, norm: Norm | None) -> torch.Tensor:
        b, t, _ = x.shape
        x = x.view(b, t, n, self.spec.head_size)
        if norm is not None:  # per-head qk-norm (Qwen3, Gemma 3), before rotary
            x = self.norm(x, norm)
        return x.transpose(1, 2)

    @staticmethod
    def _mask(positions: torch.Tensor, window: int | None) -> torch.Tensor:
        q, k = positions[:, None], positions[None, :]
        allowed = k <= q
        if window is not None:  # each query sees itself and the window-1 tokens before it
            allowed &= q - k < window
        return allowed

    def _rope(self, ls: LayerSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if ls.rope is None:
            return None
        key = (ls.rope.base, repr(ls.rope.scaling), positions.numel())
        if key not in self._rope_cache:
            self._rope_cache[key] = cos_sin(positions, self.spec.head_size, ls.rope.base, ls.rope.scaling, self.dtype)
        return self._rope_cache[key]

    def attention(self, x: torch.Tensor, ls: LayerSpec, positions: torch.Tensor) -> torch.Tensor:
        """The attention block's output before its residual (and before a sandwich norm): dense(attend(qkv(x)))."""
        c = self.spec
        b, t, _ = x.shape
        layer = ls.prefix
        q_dim, kv_dim = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
        q, k, v = torch.split(self._linear(x, f"{layer}.attention.qkv", ls.qkv_bias), [q_dim, kv_dim, kv_dim], dim=-1)
        q = self._heads(q, c.num_heads, ls.q_norm)
        k = self._heads(k, c.num_kv_heads, ls.k_norm)
        v = v.view(b, t, c.num_kv_heads, c.head_size).transpose(1, 2)
        rope = self._rope(ls, positions)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k, v = self.hooks.kv_cache(layer, k, v)  # what the KV cache stores: k after rotary, v
        group = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2)
        # / sqrt(head_size) by default (bit for bit what calibration has always computed), else * the layer's scale
        scores = scores / c.head_size**0.5 if ls.attn_scale is None else scores * ls.attn_scale
        scores = scores.masked_fill(~self._mask(positions, ls.window), float("-inf"))
        if ls.sinks:  # one more logit per head in the denominator (gpt-oss), dropped after the softmax
            sink = self.w[f"{layer}.attention.sinks"].to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, t, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, t, q_dim)
        return self._linear(out, f"{layer}.attention.dense", ls.dense_bias and self.row_biases)

    def mlp(self, x: torch.Tensor, ls: LayerSpec) -> torch.Tensor:
        """The feed-forward block's output before its residual: the one place the forward dispatches on the FFN."""
        match ls.ffn:
            case DenseFFN() as ffn:
                return self.dense_ffn(x, ls.prefix, ffn)
            case ExpertsFFN() as ffn:
                return self.experts_ffn(x, ls.prefix, ffn)

    def dense_ffn(self, x: torch.Tensor, layer: str, ffn: DenseFFN) -> torch.Tensor:
        act, h = ACTIVATIONS[ffn.activation], self._linear(x, f"{layer}.mlp.fc", ffn.bias)
        if ffn.gate_up_fused:  # fc = [up; gate] (Phi-3): up * act(gate), swiglu's second half activated
            up, gate = h.chunk(2, dim=-1)
            h = up * act(gate)
        elif ffn.gated:  # TensorRT-LLM GatedMLP: proj(act(fc(x)) * gate(x))
            h = act(h) * self._linear(x, f"{layer}.mlp.gate", ffn.bias)
        else:
            h = act(h)
        return self._linear(h, f"{layer}.mlp.proj", ffn.bias and self.row_biases)

    def route(self, x: torch.Tensor, layer: str, ffn: ExpertsFFN) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (weights [tokens, top_k], experts [tokens, top_k]) of layer `layer`'s router.

        The logits are computed in float32 (float64 in a float64 forward), as TensorRT-LLM's float32 router does;
        the top k are `torch.topk` of the softmax probabilities, transformers' call, so exact ties pick the same
        experts; the weights are normalised as `ffn.router_norm` says (spec.ROUTER_NORMS)."""
        dtype = torch.promote_types(self.dtype, torch.float32)
        bias = self.w[f"{layer}.mlp.router.bias"].to(dtype) if ffn.router_bias else None
        logits = F.linear(x.to(dtype), self.w[f"{layer}.mlp.router.weight"].to(dtype), bias)
        if ffn.router_norm == "topk_softmax":
            top, experts = torch.topk(logits, ffn.top_k, dim=-1)
            return top.softmax(dim=-1), experts
        top, experts = torch.topk(logits.softmax(dim=-1), ffn.top_k, dim=-1)
        if ffn.router_norm == "softmax_topk_renormalise":
            top = top / top.sum(dim=-1, keepdim=True)
        return top, experts

    def experts_ffn(self, x: torch.Tensor, layer: str, ffn: ExpertsFFN) -> torch.Tensor:
        """A mixture of experts (docs/conversion.md): each token through its top-k experts' gated MLPs
        proj[e] · (act(gate) · up) (+ biases) with fc[e] = [up; gate], the outputs weighed by the router and
        summed; gpt-oss's clamped SwiGLU where the ExpertsFFN says so (`swiglu`)."""
        if ffn.shared is not None or not ffn.gated:
            raise UserError(
                f"{layer}: the reference forward runs gated experts without shared experts; this checkpoint's "
                f"{ffn} is not one of them"
            )
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x, layer, ffn)
        fc, proj = self.w[f"{layer}.mlp.fc.weight"], self.w[f"{layer}.mlp.proj.weight"]
        fc_bias = self.w[f"{layer}.mlp.fc.bias"] if ffn.bias else None
        proj_bias = self.w[f"{layer}.mlp.proj.bias"] if ffn.bias and self.row_biases else None
        out = torch.zeros_like(x)
        for e in sorted(set(experts.flatten().tolist())):
            tokens, slot = torch.where(experts == e)
            xe = self.hooks.expert_input(f"{layer}.mlp.fc", e, x[tokens])
            up, gate = F.linear(xe, fc[e], None if fc_bias is None else fc_bias[e]).chunk(2, dim=-1)
            m = self.hooks.expert_input(f"{layer}.mlp.proj", e, swiglu(ffn, up, gate))
            y = F.linear(m, proj[e], None if proj_bias is None else proj_bias[e])
            out.index_add_(0, tokens, y * weights[tokens, slot, None].to(y.dtype))
        return out.reshape(shape)

    def lookup(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings (plus learned position embeddings), before the spec's embedding scale."""
        name = "transformer.vocab_embedding.weight"
        table = self.w.stored(name) if isinstance(self.w, Widened) else self.w[name]
        h = F.embedding(input_ids, table).to(self.dtype)
        if self.spec.learned_positions:
            h = h + self.w["transformer.position_embedding.weight"][positions]
        return h

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [batch, seq] -> (hidden states, positions); pass both to `layer`."""
        positions = torch.arange(input_ids.shape[1])
        h = self.lookup(input_ids, positions)
        if self.spec.embedding_scale is not None:
            h = h * self.spec.embedding_scale
        return h, positions

    def layer(self, h: torch.Tensor, i: int, positions: torch.Tensor) -> torch.Tensor:
        """Decoder layer i (its weights must be in `self.w`), as its LayerSpec describes it."""
        ls = self.spec.layers[i]
        a = self.attention(self.norm(h, ls.attn_norm), ls, positions)
        h = h + (a if ls.attn_out_norm is None else self.norm(a, ls.attn_out_norm))
        m = self.mlp(self.norm(h, ls.mlp_norm), ls)
        return h + (m if ls.mlp_out_norm is None else self.norm(m, ls.mlp_out_norm))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The norm before lm_head: its input is lm_head's."""
        return self.norm(h, self.spec.final_norm)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self._linear(self.final_norm(h), "lm_head")

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """lm_head of the final norm's output, soft-capped where the spec says so."""
        logits = self.head(h)
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [batch, seq] -> logits [batch, seq, vocab] in `self.dtype`."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        h, positions = self.embed(input_ids)
        for i in range(len(self.spec.layers)):
            h = self.layer(h, i, positions)
        return self.logits(h)
