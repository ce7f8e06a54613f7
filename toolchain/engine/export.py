"""ONNX export of a (quantized) TensorRT-LLM checkpoint as the engine graph of contract.py.

Standard ONNX ops for embedding, norms, MLP and lm_head over packed 2-D activations [num_tokens, hidden];
explicit quantization as QuantizeLinear / DequantizeLinear pairs that say exactly what the quantize stage
computed (int8 weights per output channel, int4 weights in blocks along the input, fp8 weights per tensor, int8 /
fp8 activations per tensor, the pre-quantization scale as a Mul); attention as two plugin nodes per layer,
`trtbuild::KVCacheWrite` then `trtbuild::PagedAttention`, and a mixture-of-experts FFN as one `trtbuild::MoE` node
taking the layer's router and stacked experts as initializers; the plugin nodes' attributes are the plugins' fields
(ops.py).
TensorRT builds this graph strongly typed; the CPU engine runs it with ONNX Runtime and our reference ops.

One rank of a multi-rank engine (issue 27, `export_model(..., rank=)`) gets its own graph of its own rank file: its
local heads, KV heads and MLP slice, its pipeline stage's layers (renumbered from 0, as in its file), and the
collective nodes of collectives.py where TensorRT-LLM puts them (reference/parallel.py computes the same forward):
row-parallel linears (attention.dense, mlp.proj) end in `trtbuild::AllReduce` then add their bias once; the
vocab-parallel embedding (GPT-2's positions too) looks up its own rows, masked, then all-reduces; lm_head's slices
are all-gathered on the last axis and cut to vocab_size before the cast and softcap, so every rank of the last stage
has the full logits. A non-first stage starts with `trtbuild::Recv` of the previous stage's hidden states, a non-last
one ends with `trtbuild::Send` to the next stage, whose output is its graph output `hidden_states` (no logits).

Names and order are fixed by the checkpoint alone, so the same checkpoint gives the same bytes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import TensorProto, helper

from toolchain.checkpoint.sharding import FIRST_STAGE, LAST_STAGE, padded_vocab
from toolchain.checkpoint.spec import (
    DenseFFN,
    ExpertsFFN,
    LayerSpec,
    ModelSpec,
    Norm,
    experts_unsupported,
    spec_of,
)
from toolchain.checkpoint.trtllm import ModelConfig, check_family_fields, kv_cache_scale
from toolchain.engine.collectives import (
    ALL_GATHER_OP,
    ALL_REDUCE_OP,
    RECV_OP,
    SEND_OP,
    TYPE_IDS,
    AllGatherAttrs,
    AllReduceAttrs,
    CollectiveAttrs,
    RecvAttrs,
    SendAttrs,
)
from toolchain.engine.contract import ATTENTION_OP, INPUTS, OUTPUTS, PLUGIN_DOMAIN, WRITE_OP
from toolchain.engine.geometry import kv_block_shape
from toolchain.engine.ops import MOE_OP, AttentionAttrs, MoEAttrs
from toolchain.errors import UserError
from toolchain.parallel.mapping import RankMapping
from toolchain.quantize import experts
from toolchain.quantize.methods.base import ACTIVATION_SCALE, PREQUANT, Context, quantized
from toolchain.quantize.methods.kv_cache import check_head_size
from toolchain.quantize.methods.nvfp4 import TRT_DOMAIN
from toolchain.quantize.methods.registry import by_algo, kv_by_algo
from toolchain.quantize.scheme import stored
from toolchain.reference.rope import attention_factor

OPSET = 21  # int4 and blocked DequantizeLinear (block_size) arrived in opset 21
OPSET_FP4, IR_FP4 = 23, 11  # FLOAT4E2M1 arrived in opset 23 / IR 11: only graphs holding FP4 use them
EXTERNAL_DATA_BYTES = 2 * 1024**3 - 64 * 1024**2  # protobuf's 2 GiB limit, with room for the graph itself
HIDDEN_STATES = "hidden_states"  # a non-last pipeline stage's graph output: what it sent to the next stage

ONNX_TYPES: dict[torch.dtype, int] = {
    torch.float32: TensorProto.FLOAT,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.int8: TensorProto.INT8,
    torch.int32: TensorProto.INT32,
    torch.int64: TensorProto.INT64,
    torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN,
}
KV_ONNX = {"int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN}
# nvfp4: a float32 pool of NVFP4-dequantized values (contract.KV_DTYPES), scaled (kv_scale) like the code pools
KV_FLOAT_SCALED = {"nvfp4": TensorProto.FLOAT}


def tensor_proto(name: str, t: torch.Tensor) -> TensorProto:
    """Raw little-endian bytes, any dtype torch has (bf16 and fp8 included, which numpy lacks)."""
    proto = TensorProto(name=name, data_type=ONNX_TYPES[t.dtype], dims=list(t.shape))
    proto.raw_data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return proto


class _Builder:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.onnx_dtype = ONNX_TYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()
        self._count = 0

    def has(self, name: str) -> bool:
        return name in self._names

    def add_initializer(self, proto: TensorProto) -> str:
        assert proto.name not in self._names, proto.name
        self._names.add(proto.name)
        self.initializers.append(proto)
        return proto.name

    def const(self, name: str, t: torch.Tensor) -> str:
        return self.add_initializer(tensor_proto(name, t))

    def float_const(self, name: str, t: torch.Tensor) -> str:
        return self.const(name, t.to(self.dtype))

    def node(
        self, op: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "", **attrs: Any
    ) -> list[str]:
        self._count += 1
        outs = [f"{name}" if outputs == 1 else f"{name}:{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"{name}/{op}", domain=domain, **attrs))
        return outs

    def op(self, op: str, inputs: list[str], name: str, **attrs: Any) -> str:
        return self.node(op, inputs, name, **attrs)[0]


class _Consumed(dict[str, torch.Tensor]):
    """The checkpoint's tensors, remembering which ones the export read (`in` is not a read)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__(weights)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return super().__getitem__(name)

    def check_all_read(self, cfg: ModelConfig, source: str) -> None:
        """Refuse tensors the export never read: a field this exporter does not know would otherwise be dropped
        silently and a different model built."""
        left = sorted(set(self) - self.read)
        if left:
            q = cfg.quantization
            shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise UserError(
                f"{source}: {shown} not used by the {cfg.architecture} export (quant_algo {q.quant_algo}, "
                f"kv_cache_quant_algo {q.kv_cache_quant_algo}); refusing rather than dropping it: fix the checkpoint "
                "or its config.json"
            )


class _Exporter:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        tokens_per_block: int,
        source: str = "rank0.safetensors",
        rank: RankMapping | None = None,
    ):
        self.cfg, self.w, self.b = cfg, _Consumed(weights), _Builder(dtype)
        self.rank = rank if rank is not None and rank.world_size > 1 else None  # None: the single-rank graph
        self.spec = spec_of(cfg) if self.rank is None else rank_spec(cfg, self.rank)
        self.tp = 1 if self.rank is None else self.rank.tp_size
        self.collectives = 0  # AllReduce's `counter`: the graph's all-reduces numbered from 0
        self.stage_start = 0 if self.rank is None else self.rank.layers(cfg.num_hidden_layers).start
        self.source = source
        self.tokens_per_block = tokens_per_block
        q = cfg.quantization
        kv = kv_by_algo(q.kv_cache_quant_algo, f"{source}'s config.json")
        self.method = by_algo(q.quant_algo)  # reads and exports its quantized linears' tensors
        self.kv_dtype = kv.name if kv else _DTYPE_NAMES[dtype]  # "int8" / "fp8": the KV cache quantization's name
        check_head_size(kv, cfg.head_size, f"{source}'s config.json")
        b = self.b
        self.eps = b.const("norm_epsilon", torch.tensor(cfg.norm_epsilon, dtype=torch.float32))
        self.last_axis = b.const("axis_last", torch.tensor([-1], dtype=torch.int64))

    # -- building blocks --------------------------------------------------------------------------------------
    def norm(self, x: str, norm: Norm, out: str) -> str:
        b, w = self.b, self.w
        weight = b.float_const(f"{norm.name}.weight", w[f"{norm.name}.weight"])
        if norm.kind == "layer":  # LayerNorm (GPT-2)
            bias = b.float_const(f"{norm.name}.bias", w[f"{norm.name}.bias"])
            return b.op("LayerNormalization", [x, weight, bias], out, axis=-1, epsilon=norm.eps)
        # RMSNorm, x * 1/sqrt(mean(x²) + eps) * weight, in primitive ops every backend has, computed in float32
        # whatever the engine dtype (x² overflows fp16 from |x| = 256 on; residual streams go higher)
        xf = x if b.onnx_dtype == TensorProto.FLOAT else b.op("Cast", [x], f"{out}.float", to=TensorProto.FLOAT)
        square = b.op("Mul", [xf, xf], f"{out}.square")
        mean = b.op("ReduceMean", [square, self.last_axis], f"{out}.mean", keepdims=1)
        rms = b.op("Sqrt", [b.op("Add", [mean, self._eps(norm.eps)], f"{out}.var_eps")], f"{out}.rms")
        normed = b.op("Div", [xf, rms], f"{out}.normed")
        if b.onnx_dtype != TensorProto.FLOAT:
            normed = b.op("Cast", [normed], f"{out}.normed_cast", to=b.onnx_dtype)
        return b.op("Mul", [normed, weight], out)

    def _eps(self, eps: float) -> str:
        """The epsilon constant of RMSNorms: one per distinct value (`norm_epsilon` for the model's own)."""
        if eps == self.cfg.norm_epsilon:
            return self.eps
        name = f"norm_epsilon_{eps!r}"
        if not self.b.has(name):
            self.b.const(name, torch.tensor(eps, dtype=torch.float32))
        return name

    def _quantized(self, x: str, prefix: str) -> tuple[str, str]:
        """A quantized linear's GEMM inputs as its method exports them: the input after what the engine does to it
        at run time, and the weight through DequantizeLinear with float32 scales (the quantize stage's own), cast
        to the engine dtype after."""
        b = self.b
        method, linear = stored(self.method, self.cfg, self.spec, self.w, prefix)
        x, dq = method.export(b, linear, x)
        if b.onnx_dtype == TensorProto.FLOAT:
            return x, dq
        return x, b.op("Cast", [dq], f"{prefix}.weight_cast", to=b.onnx_dtype)

    def linear(self, x: str, prefix: str, bias: bool = False) -> str:
        b, w = self.b, self.w
        if quantized(prefix, w):
            method, linear = stored(self.method, self.cfg, self.spec, w, prefix)
            y = method.export_gemm(b, linear, x)  # the whole product where one Gemm cannot say it (per-part scales)
            if y is not None and not bias:
                return y
            if y is not None:
                return b.op("Add", [y, b.float_const(f"{prefix}.bias", w[f"{prefix}.bias"])], f"{prefix}.out")
            x, weight = self._quantized(x, prefix)
        else:
            weight = b.float_const(f"{prefix}.weight", w[f"{prefix}.weight"])
        inputs = [x, weight]
        if bias:
            inputs.append(b.float_const(f"{prefix}.bias", w[f"{prefix}.bias"]))
        return b.op("Gemm", inputs, f"{prefix}.out", transB=1)

    def row_linear(self, x: str, prefix: str, bias: bool = False) -> str:
        """A row-parallel linear (attention.dense, mlp.proj): with tp > 1 each rank's partial product is summed
        over the tp group and the (replicated) bias added once after the sum, as TensorRT-LLM's RowLinear."""
        if self.tp == 1:
            return self.linear(x, prefix, bias)
        y = self.all_reduce(self.linear(x, prefix), f"{prefix}.reduced", f"after {self.global_name(prefix)}")
        if not bias:
            return y
        return self.b.op("Add", [y, self.b.float_const(f"{prefix}.bias", self.w[f"{prefix}.bias"])], f"{prefix}.biased")

    def global_name(self, prefix: str) -> str:
        """ "layer 3 mlp.proj" for a stage's local prefix transformer.layers.1.mlp.proj (errors name the model's
        layer, not the stage file's)."""
        head, _, rest = prefix.removeprefix("transformer.layers.").partition(".")
        return f"layer {self.stage_start + int(head)} {rest}"

    def collective(
        self, op: str, attrs: CollectiveAttrs, x: str, out: str, shape: list[int | str] | None, what: str
    ) -> str:
        """One collective plugin node (collectives.py), its output declared: nothing infers a plugin's shape. The
        node's name says what it is for: the CPU engine's CollectiveError quotes it ("AllReduce after layer 3
        mlp.proj")."""
        b = self.b
        b.nodes.append(helper.make_node(op, [x], [out], name=what, domain=PLUGIN_DOMAIN, **attrs.to_attributes(op)))
        if shape is not None:  # None: a graph output, declared there
            b.value_info.append(helper.make_tensor_value_info(out, b.onnx_dtype, shape))
        return out

    @property
    def type_id(self) -> int:
        return TYPE_IDS[_DTYPE_NAMES[self.b.dtype]]

    def all_reduce(self, x: str, out: str, what: str | None = None) -> str:
        """The sum of `x` [num_tokens, hidden] over this rank's tp group (the experts' output too, under tp);
        `what`: the node's name, what the sum is for (default: `out`)."""
        assert self.rank is not None
        attrs = AllReduceAttrs(type_id=self.type_id, group=self.rank.tp_group, counter=self.collectives)
        self.collectives += 1
        return self.collective(ALL_REDUCE_OP, attrs, x, out, ["num_tokens", self.spec.hidden_size], what or out)

    def activation(self, x: str, act: str, name: str) -> str:
        b = self.b
        if act in ("silu", "swiglu"):
            return b.op("Mul", [x, b.op("Sigmoid", [x], f"{name}.sigmoid")], name)
        if act == "relu":
            return b.op("Relu", [x], name)
        if act in ("gelu", "gelu_new", "gelu_pytorch_tanh"):  # TensorRT-LLM's gelu is the tanh approximation
            return b.op("Gelu", [x], name, approximate="tanh")
        raise UserError(f"hidden_act {act!r} has no ONNX export")

    def qk_norm(self, qkv: str, ls: LayerSpec) -> str:
        """Per-head norms of q and k (Qwen3, Gemma 3), before the plugin applies rotary."""
        c, b, layer = self.spec, self.b, ls.prefix
        assert ls.q_norm is not None and ls.k_norm is not None
        h, kv, d = c.num_heads, c.num_kv_heads, c.head_size
        sizes = b.const(f"{layer}.qkv_sizes", torch.tensor([h * d, kv * d, kv * d], dtype=torch.int64))
        q, k, v = b.node("Split", [qkv, sizes], f"{layer}.qkv_split", outputs=3, axis=1)
        parts = []
        for part, heads, norm, stem in ((q, h, ls.q_norm, "q_layernorm"), (k, kv, ls.k_norm, "k_layernorm")):
            shape = b.const(f"{layer}.{stem}.heads", torch.tensor([-1, heads, d], dtype=torch.int64))
            flat = b.const(f"{layer}.{stem}.flat", torch.tensor([-1, heads * d], dtype=torch.int64))
            x = b.op("Reshape", [part, shape], f"{layer}.{stem}.in")
            parts.append(b.op("Reshape", [self.norm(x, norm, f"{layer}.{stem}.out"), flat], f"{layer}.{stem}.flat_out"))
        return b.op("Concat", [*parts, v], f"{layer}.qkv_normed", axis=1)

    def attention_attrs(self, ls: LayerSpec) -> AttentionAttrs:
        c = self.spec
        rope = ls.rope
        scaling = (rope.scaling if rope else None) or {}
        kind = scaling.get("rope_type", scaling.get("type", "none"))
        kv_scale = 1.0
        if self.kv_dtype in KV_ONNX or self.kv_dtype in KV_FLOAT_SCALED:
            kv_scale = kv_cache_scale(self.w, ls.prefix, self.source)
        return AttentionAttrs(
            layer=ls.index,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_size=c.head_size,
            tokens_per_block=self.tokens_per_block,
            rotary_style="none" if rope is None else "neox",
            rotary_base=float(rope.base) if rope else 10000.0,
            rotary_scaling_type="none" if kind == "default" else kind,
            rotary_scaling_factor=float(scaling.get("factor", 1.0)),
            rotary_low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            rotary_high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            rotary_original_max_positions=int(scaling.get("original_max_position_embeddings", 8192)),
            # YaRN (gpt-oss): transformers' defaults where the config leaves a field out (reference/rope.py)
            rotary_beta_fast=float(scaling.get("beta_fast") or 32.0) if kind == "yarn" else 32.0,
            rotary_beta_slow=float(scaling.get("beta_slow") or 1.0) if kind == "yarn" else 1.0,
            rotary_truncate=int(bool(scaling.get("truncate", True))),
            rotary_attention_factor=attention_factor(scaling or None),
            sinks=int(ls.sinks),
            sliding_window=ls.window or 0,
            kv_cache_dtype=self.kv_dtype,
            kv_scale=kv_scale,
            # the plugin divides scores by sqrt(head_size) * q_scaling (ops.py); a layer's own scale sets it
            q_scaling=c.q_scaling(ls),
        )

    # -- the graph --------------------------------------------------------------------------------------------
    def layer(self, h: str, ls: LayerSpec) -> str:
        """One decoder layer as its LayerSpec describes it (the reference forward's `layer`, in ONNX)."""
        b, layer = self.b, ls.prefix
        q_dim = self.spec.num_heads * self.spec.head_size
        x = self.norm(h, ls.attn_norm, f"{ls.attn_norm.name}.out")
        qkv = self.linear(x, f"{layer}.attention.qkv", ls.qkv_bias)
        if ls.q_norm is not None:
            qkv = self.qk_norm(qkv, ls)
        attrs = self.attention_attrs(ls)
        tables = ["position_ids", "context_lens", "new_lens", "block_tables"]
        b.nodes.append(
            helper.make_node(
                WRITE_OP,
                [qkv, *tables, "kv_cache"],
                [f"{layer}.attention.q"],
                name=f"{layer}.attention/{WRITE_OP}",
                domain=PLUGIN_DOMAIN,
                **attrs.to_attributes(WRITE_OP),
            )
        )
        sinks = []  # gpt-oss: the heads' sink logits, float32 whatever the engine dtype, after the op's six inputs
        if ls.sinks:
            sinks = [b.const(f"{layer}.attention.sinks", self.w[f"{layer}.attention.sinks"].float())]
        b.nodes.append(
            helper.make_node(
                ATTENTION_OP,
                [f"{layer}.attention.q", *tables, "kv_cache", *sinks],
                [f"{layer}.attention.out"],
                name=f"{layer}.attention/{ATTENTION_OP}",
                domain=PLUGIN_DOMAIN,
                **attrs.to_attributes(ATTENTION_OP),
            )
        )
        for name in (f"{layer}.attention.q", f"{layer}.attention.out"):
            b.value_info.append(helper.make_tensor_value_info(name, b.onnx_dtype, ["num_tokens", q_dim]))
        a = self.row_linear(f"{layer}.attention.out", f"{layer}.attention.dense", ls.dense_bias)
        if ls.attn_out_norm is not None:
            a = self.norm(a, ls.attn_out_norm, f"{ls.attn_out_norm.name}.out")
        h = b.op("Add", [h, a], f"{layer}.attn_residual")
        m = self.ffn(self.norm(h, ls.mlp_norm, f"{ls.mlp_norm.name}.out"), ls)
        if ls.mlp_out_norm is not None:
            m = self.norm(m, ls.mlp_out_norm, f"{ls.mlp_out_norm.name}.out")
        return b.op("Add", [h, m], f"{layer}.mlp_residual")

    def ffn(self, x: str, ls: LayerSpec) -> str:
        """The feed-forward block's output before its residual: the one place the export dispatches on the FFN."""
        match ls.ffn:
            case DenseFFN() as ffn:
                return self.dense_ffn(x, ls.prefix, ffn)
            case ExpertsFFN() as ffn:
                return self.experts_ffn(x, ls, ffn)

    def dense_ffn(self, x: str, layer: str, ffn: DenseFFN) -> str:
        b = self.b
        fc = self.linear(x, f"{layer}.mlp.fc", ffn.bias)
        if ffn.gate_up_fused:  # fc = [up; gate] (Phi-3): up * act(gate)
            up, gate = f"{layer}.mlp.up", f"{layer}.mlp.gate_half"
            b.nodes.append(
                helper.make_node("Split", [fc], [up, gate], name=f"{layer}.mlp.split", axis=-1, num_outputs=2)
            )
            m = b.op("Mul", [up, self.activation(gate, ffn.activation, f"{layer}.mlp.act")], f"{layer}.mlp.gated")
        else:
            m = self.activation(fc, ffn.activation, f"{layer}.mlp.act")
            if ffn.gated:  # TensorRT-LLM GatedMLP: proj(act(fc(x)) * gate(x))
                m = b.op("Mul", [m, self.linear(x, f"{layer}.mlp.gate", ffn.bias)], f"{layer}.mlp.gated")
        return self.row_linear(m, f"{layer}.mlp.proj", ffn.bias)

    def experts_ffn(self, x: str, ls: LayerSpec, ffn: ExpertsFFN) -> str:
        """One `trtbuild::MoE` node: the normed hidden states, the router (float32 whatever the engine dtype, as
        TensorRT-LLM's router), the stacked experts' fc [E, 2I, H] ([up; gate]) and proj [E, H, I] in the engine
        dtype (docs/conversion.md, "Mixture-of-experts layers"); fields from the layer's ExpertsFFN. On a rank of a
        tp group (issue 27), the rank file holds its experts' run at its slice of their width (sharding.py): the
        node computes those (expert_offset, num_local_experts) for tokens routed over all experts, and one
        AllReduce over the tp group sums the ranks' parts (TensorRT-LLM's MixtureOfExperts)."""
        b, w, layer = self.b, self.w, ls.prefix
        p = f"{layer}.mlp"
        if ffn.shared is not None or quantized(f"{p}.router", w):
            raise experts_unsupported(f"ONNX export, layer {ls.index}", ffn)  # shared experts, quantized router
        a = MoEAttrs(
            number_of_experts=ffn.num_experts,
            top_k=ffn.top_k,
            expert_hidden_size=self.spec.hidden_size,
            expert_inter_size=ffn.expert_intermediate_size,
            router_norm=ffn.router_norm,
            activation=ffn.activation,
            gated=int(ffn.gated),
            use_bias=int(ffn.bias),
            router_bias=int(ffn.router_bias),
            swiglu_alpha=float(ffn.swiglu_alpha),
            swiglu_beta=float(ffn.swiglu_beta),
            swiglu_limit=0.0 if ffn.swiglu_limit is None else float(ffn.swiglu_limit),
        )
        if self.rank is not None and self.tp > 1:
            mine, moe_tp = self.rank.ep_experts(ffn.num_experts), self.rank.mapping.moe_tp_size
            a = dataclasses.replace(
                a,
                expert_offset=mine.start,
                num_local_experts=len(mine),
                expert_inter_size=ffn.expert_intermediate_size // moe_tp,
            )
        e, n, h = a.number_of_experts, a.local_experts, a.expert_hidden_size
        shapes = {f"{p}.router.weight": (e, h), f"{p}.fc.weight": (n, a.fc_rows, h)}
        shapes[f"{p}.proj.weight"] = (n, h, a.expert_inter_size)
        if ffn.bias:
            shapes |= {f"{p}.fc.bias": (n, a.fc_rows), f"{p}.proj.bias": (n, h)}
        if ffn.router_bias:
            shapes[f"{p}.router.bias"] = (e,)
        inputs, input_scales, prequants = [x], [], []
        for name, shape in shapes.items():
            prefix = name.removesuffix(".weight")
            if name.endswith(".weight") and quantized(prefix, w):  # per expert (quantize/experts.py)
                weight, scale, prequant = self._quantized_experts(prefix, shape)
                inputs.append(weight)
                input_scales += [scale] if scale else []
                prequants += [prequant] if prequant else []
                continue
            tensor = w[name]
            if tuple(tensor.shape) != shape:
                raise UserError(
                    f"{self.source}: {name} is {tuple(tensor.shape)}, layer {ls.index}'s experts need {shape} "
                    f"({f'{n} of {e}' if n != e else e} experts, hidden {h}, expert width {a.expert_inter_size}); "
                    "re-run convert"
                )
            router = name in (f"{p}.router.weight", f"{p}.router.bias")
            inputs.append(b.const(name, tensor.float()) if router else b.float_const(name, tensor))
        if input_scales:  # fp8 / w8a8_sq experts: fc's and proj's per-expert input scales, both or neither
            if len(input_scales) != 2:
                raise UserError(
                    f"{self.source}: {p}: {self.method and self.method.name} experts need both fc and proj "
                    "quantized; re-run quantize"
                )
            fp8 = bool(self.method and self.method.activation_kind == "FP8")
            a = dataclasses.replace(a, fp8_inputs=int(fp8), int8_inputs=int(not fp8))
            inputs += input_scales
        if prequants:  # AWQ / SmoothQuant experts: fc's and proj's per-expert 1/s, both or neither
            if len(prequants) != 2:
                raise UserError(
                    f"{self.source}: {p}: {self.method and self.method.name} experts need both fc and proj "
                    "quantized; re-run quantize"
                )
            a = dataclasses.replace(a, prequant=1)
            inputs += prequants
        out = f"{layer}.mlp.out"
        b.nodes.append(
            helper.make_node(
                MOE_OP, inputs, [out], name=f"{layer}.mlp/{MOE_OP}", domain=PLUGIN_DOMAIN, **a.to_attributes(MOE_OP)
            )
        )
        b.value_info.append(helper.make_tensor_value_info(out, b.onnx_dtype, ["num_tokens", h]))
        return out if self.tp == 1 else self.all_reduce(out, f"{layer}.mlp.reduced")

    def _quantized_experts(self, prefix: str, shape: tuple[int, ...]) -> tuple[str, str | None, str | None]:
        """A stacked experts' weight stored quantized: its codes and scales checked against the shapes the quantize
        stage makes for `shape`, dequantized in the graph, cast to the engine dtype as a dense linear's weight; with
        it, fp8's / w8a8_sq's per-expert input scales [E] in the engine dtype (else None) and AWQ's / SmoothQuant's
        per-expert 1/s [E, in] float32 whatever the engine dtype, as stored (else None)."""
        b = self.b
        method, linear = stored(self.method, self.cfg, self.spec, self.w, prefix)
        ctx = Context(group_size=linear.group_size)
        for name, info in experts.plan(method, prefix, shape, ctx).items():
            if tuple(self.w[name].shape) != info.shape:
                raise UserError(
                    f"{self.source}: {name} is {tuple(self.w[name].shape)}, {prefix}'s {shape[0]} experts of "
                    f"{shape[1:]} need {info.shape} ({method.name}, group size {ctx.group_size}); re-run quantize"
                )
        dq = experts.export(method, b, linear)
        act, pre = experts.activation_scales(method, linear), experts.prequant_scales(method, linear)
        scale = None if act is None else b.float_const(f"{prefix}.{ACTIVATION_SCALE}", act)
        prequant = None if pre is None else b.const(f"{prefix}.{PREQUANT}", pre)
        if b.onnx_dtype == TensorProto.FLOAT:
            return dq, scale, prequant
        return b.op("Cast", [dq], f"{prefix}.weight_cast", to=b.onnx_dtype), scale, prequant

    def embedding(self) -> str:
        """The embedded tokens [num_tokens, hidden]: the first stage's lookup (vocab-parallel under tp)."""
        spec, b = self.spec, self.b
        if self.tp > 1:
            return self.parallel_embedding()
        embed = b.float_const("transformer.vocab_embedding.weight", self.w["transformer.vocab_embedding.weight"])
        h = b.op("Gather", [embed, "input_ids"], "embedding", axis=0)
        if spec.learned_positions:
            pos = b.float_const(
                "transformer.position_embedding.weight", self.w["transformer.position_embedding.weight"]
            )
            h = b.op("Add", [h, b.op("Gather", [pos, "position_ids"], "position_embedding", axis=0)], "embedded")
        return h

    def parallel_embedding(self) -> str:
        """Each rank looks up the ids in its own row range (zero elsewhere), the ranks' rows are summed: token
        and learned position lookups added locally first, so one all-reduce sums both (the sum is linear)."""
        b, cfg = self.b, self.cfg
        h = self.local_lookup("transformer.vocab_embedding", "input_ids", cfg.vocab_size)
        if self.spec.learned_positions:
            pos = self.local_lookup("transformer.position_embedding", "position_ids", cfg.max_position_embeddings)
            h = b.op("Add", [h, pos], "embedded_local")
        return self.all_reduce(h, "embedded_reduced", "of the embedding lookups")

    def local_lookup(self, table: str, ids: str, rows: int) -> str:
        """This rank's part of a vocab-parallel lookup (reference/parallel.py `_lookup`): rows [start, start +
        per_rank) of the zero-padded table, ids outside them giving zeros."""
        assert self.rank is not None
        b = self.b
        per_rank = padded_vocab(rows, self.tp) // self.tp
        weight = b.float_const(f"{table}.weight", self.w[f"{table}.weight"])
        start = b.const(f"{table}.start", torch.tensor(self.rank.tp_rank * per_rank, dtype=torch.int32))
        size = b.const(f"{table}.rows", torch.tensor(per_rank, dtype=torch.int32))
        zero = b.const(f"{table}.zero_id", torch.tensor(0, dtype=torch.int32))
        shifted = b.op("Sub", [ids, start], f"{table}.shifted")
        inside = b.op(
            "And",
            [
                b.op("GreaterOrEqual", [shifted, zero], f"{table}.above"),
                b.op("Less", [shifted, size], f"{table}.below"),
            ],
            f"{table}.inside",
        )
        found = b.op("Gather", [weight, b.op("Where", [inside, shifted, zero], f"{table}.local_ids")], table, axis=0)
        mask = b.op("Unsqueeze", [inside, self.last_axis], f"{table}.mask")
        return b.op("Where", [mask, found, b.float_const(f"{table}.zero", torch.zeros(()))], f"{table}.masked")

    def received(self) -> str:
        """A non-first stage's input: the previous stage's hidden states [num_tokens, hidden]."""
        assert self.rank is not None
        b = self.b
        hidden = b.const("hidden_size", torch.tensor([self.spec.hidden_size], dtype=torch.int64))
        shape = b.op("Concat", [b.op("Shape", ["input_ids"], "num_tokens"), hidden], "received_shape", axis=0)
        like = b.op(
            "ConstantOfShape", [shape], "received_like", value=tensor_proto("zero", torch.zeros(1, dtype=b.dtype))
        )
        attrs = RecvAttrs(type_id=self.type_id, src_rank=self.rank.prev_pp_rank)
        what = f"of the hidden states after layer {self.stage_start - 1} from stage {self.rank.pp_rank - 1}"
        return self.collective(RECV_OP, attrs, like, "received", ["num_tokens", self.spec.hidden_size], what)

    def logits_of(self, picked: str) -> str:
        """lm_head on the picked rows; under tp the ranks' vocab slices gathered on the last axis and the padding
        rows cut, so every rank has the full [num_outputs, vocab_size]."""
        assert self.rank is not None or self.tp == 1
        b = self.b
        logits = self.linear(self.norm(picked, self.spec.final_norm, "transformer.ln_f.out"), "lm_head")
        if self.tp == 1:
            return logits
        assert self.rank is not None
        padded = padded_vocab(self.cfg.vocab_size, self.tp)
        attrs = AllGatherAttrs(type_id=self.type_id, group=self.rank.tp_group, axis=-1)
        shape: list[int | str] = ["num_outputs", padded]
        logits = self.collective(ALL_GATHER_OP, attrs, logits, "lm_head.gathered", shape, "of the lm_head slices")
        if padded == self.cfg.vocab_size:
            return logits
        ends = b.const("vocab_end", torch.tensor([self.cfg.vocab_size], dtype=torch.int64))
        starts = b.const("vocab_start", torch.tensor([0], dtype=torch.int64))
        return b.op("Slice", [logits, starts, ends, self.last_axis], "lm_head.vocab")

    def graph(self) -> onnx.ModelProto:
        spec, b = self.spec, self.b
        first = self.rank is None or self.rank.is_first_stage
        last = self.rank is None or self.rank.is_last_stage
        h = self.embedding() if first else self.received()
        if first and spec.embedding_scale is not None:
            scale = b.float_const("embedding_scale", torch.tensor(spec.embedding_scale))
            h = b.op("Mul", [h, scale], "embedding_scaled")
        for ls in spec.layers:
            h = self.layer(h, ls)
        if not last:
            return self.stage_graph(h)
        picked = b.op("Gather", [h, "logits_index"], "logits_rows", axis=0)
        logits = self.logits_of(picked)
        if b.onnx_dtype != TensorProto.FLOAT:
            logits = b.op("Cast", [logits], "logits_float", to=TensorProto.FLOAT)
        if spec.final_logit_softcap is not None:  # cap * tanh(logits / cap), in float32
            cap = b.const("final_logit_softcap", torch.tensor(spec.final_logit_softcap, dtype=torch.float32))
            capped = b.op("Tanh", [b.op("Div", [logits, cap], "logits_over_cap")], "logits_tanh")
            logits = b.op("Mul", [capped, cap], "logits_capped")
        b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits/Identity"))
        return self.model([self._io(name, spec) for name, spec in OUTPUTS.items()])

    def stage_graph(self, h: str) -> onnx.ModelProto:
        """A non-last pipeline stage: its hidden states sent to the next stage and output as `hidden_states`."""
        assert self.rank is not None
        b = self.b
        attrs = SendAttrs(type_id=self.type_id, tgt_rank=self.rank.next_pp_rank)
        last = self.stage_start + len(self.spec.layers) - 1
        what = f"of the hidden states after layer {last} to stage {self.rank.pp_rank + 1}"
        shape: list[int | str] = ["num_tokens", self.spec.hidden_size]
        self.collective(SEND_OP, attrs, h, HIDDEN_STATES, None, what)
        return self.model([helper.make_tensor_value_info(HIDDEN_STATES, b.onnx_dtype, shape)])

    def model(self, outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
        b = self.b
        self.w.check_all_read(self.cfg, self.source)
        inputs = [self._io(name, spec) for name, spec in INPUTS.items()]
        graph = helper.make_graph(b.nodes, "trtbuild_engine", inputs, outputs, b.initializers, value_info=b.value_info)
        fp4 = any(t.data_type == TensorProto.FLOAT4E2M1 for t in b.initializers)
        opsets = [helper.make_opsetid("", OPSET_FP4 if fp4 else OPSET), helper.make_opsetid(PLUGIN_DOMAIN, 1)]
        if any(n.domain == TRT_DOMAIN for n in b.nodes):  # TensorRT's own ops (NVFP4 / MXFP8 inputs)
            opsets.append(helper.make_opsetid(TRT_DOMAIN, 1))
        model = helper.make_model(
            graph, opset_imports=opsets, ir_version=IR_FP4 if fp4 else 10, producer_name="trtbuild"
        )
        return model

    def _kv_elem(self) -> int:
        return {**KV_ONNX, **KV_FLOAT_SCALED}.get(self.kv_dtype, self.b.onnx_dtype)

    def _kv_value_info(self, name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, self._kv_elem(), list(self._kv_shape()))

    def _kv_shape(self) -> tuple[int | str, ...]:
        c = self.spec  # a rank's own: its stage's layers, its local KV heads
        return (len(c.layers), "num_blocks", *kv_block_shape(c.num_kv_heads, self.tokens_per_block, c.head_size))

    def _io(self, name: str, spec: tuple[str, tuple[str, ...]]) -> onnx.ValueInfoProto:
        elem, dims = spec
        if elem == "kv":
            return self._kv_value_info(name)
        if name == "logits":
            return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["num_outputs", self.cfg.vocab_size])
        return helper.make_tensor_value_info(name, TensorProto.INT32, list(dims))


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def export_model(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    tokens_per_block: int,
    source: str = "rank0.safetensors",
    rank: RankMapping | None = None,
) -> onnx.ModelProto:
    """The engine graph; every tensor of `weights` must be used (`source` names the file in errors). `rank`: the
    graph of that rank of a multi-rank checkpoint, `weights` being its own rank file (None: a single-rank one)."""
    if dtype not in _DTYPE_NAMES:
        raise UserError(f"engine dtype {dtype} not supported; choose float32, float16 or bfloat16")
    check_family_fields(cfg)
    if rank is None or rank.world_size == 1:
        spec_of(cfg).check_tensors(weights, source)  # a tensor the model needs and the checkpoint lacks: one line
    else:
        check_quantization(cfg, rank.world_size, source)
        check_rank_tensors(rank_spec(cfg, rank), rank, weights, source)
    return _Exporter(cfg, weights, dtype, tokens_per_block, source, rank).graph()


def check_quantization(cfg: ModelConfig, world_size: int, source: str) -> None:
    """Multi-rank engines are built from unquantized checkpoints only (issue 27, decision D1)."""
    q = cfg.quantization
    if q.quant_algo or q.kv_cache_quant_algo:
        raise UserError(
            f"{source}: a quantized checkpoint (quant_algo {q.quant_algo}, kv_cache_quant_algo "
            f"{q.kv_cache_quant_algo}) split over {world_size} ranks; multi-rank engines are built from unquantized "
            "checkpoints only: convert with --tp 1 --pp 1 to quantize, or build the unquantized split checkpoint"
        )


def _localized(ls: LayerSpec, index: int) -> LayerSpec:
    """Layer `ls` renumbered as a pipeline stage's file names it (its norms' tensor stems included)."""
    old, new = f"{ls.prefix}.", f"transformer.layers.{index}."
    norms = {
        name: dataclasses.replace(n, name=new + n.name.removeprefix(old))
        for name in ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm")
        if (n := getattr(ls, name)) is not None
    }
    return dataclasses.replace(ls, index=index, **norms)


def rank_spec(cfg: ModelConfig, rank: RankMapping) -> ModelSpec:
    """The model as rank `rank` holds it: its local heads, KV heads and MLP width, its stage's layers numbered from
    0 (their kinds, windows and rotary those of the global layers they are)."""
    heads, kv_heads = rank.local_heads(cfg)
    local = dataclasses.replace(
        cfg,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=cfg.intermediate_size // rank.tp_size,
    )
    spec = spec_of(local)
    stage = rank.layers(cfg.num_hidden_layers)
    return dataclasses.replace(spec, layers=tuple(_localized(spec.layers[g], g - stage.start) for g in stage))


def check_rank_tensors(spec: ModelSpec, rank: RankMapping, weights: dict[str, torch.Tensor], source: str) -> None:
    """A rank file must hold its stage's tensors: the layers, the embeddings on the first stage, ln_f and lm_head on
    the last (rank_spec's names)."""
    names = [
        n
        for n in spec.tensor_names()
        if (rank.is_first_stage or not n.startswith(FIRST_STAGE))
        and (rank.is_last_stage or not n.startswith(LAST_STAGE))
    ]
    missing = [n for n in names if n not in weights]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(
            f"{source}: {missing[0]}{more} missing, which rank {rank.rank} (tp rank {rank.tp_rank}, pp rank "
            f"{rank.pp_rank}) of config.json's {spec.architecture} needs; re-run convert"
        )


def save_model(model: onnx.ModelProto, path: Path) -> list[Path]:
    """model.onnx, with its weights in model.onnx.data past protobuf's 2 GiB; returns the files written."""
    size = sum(len(t.raw_data) for t in model.graph.initializer)
    if size < EXTERNAL_DATA_BYTES:
        path.write_bytes(model.SerializeToString(deterministic=True))
        return [path]
    data = path.with_name(path.name + ".data")
    onnx.save_model(
        model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=1024
    )
    return [path, data]
