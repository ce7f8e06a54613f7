"""The model description every consumer walks: a frozen, validated `ModelSpec` with one `LayerSpec` per layer.

A family module (toolchain/checkpoint/<family>.py) turns its checkpoint config into a spec (`spec(cfg)`); the
reference forward, the ONNX exporter, the tensor-parallel forward, layer-by-layer calibration and SmoothQuant's
norm -> linear pairs all read it, and nothing downstream guesses a layer's kind from which tensors exist. The
config the spec is made from is config.json (TensorRT-LLM's fields, plus ours: docs/conversion.md), so a checkpoint
carries its description with it.

Names are TensorRT-LLM's tensor names (`transformer.layers.{i}.attention.qkv`, ...); the norm names of a layer
are stems under its prefix (`input_layernorm`, ...).

A layer's feed-forward block is a variant, `DenseFFN` or `ExpertsFFN`, and each consumer dispatches on it in one
function: `LayerSpec.mlp_inputs` (its linears), `ReferenceModel.mlp`, the exporter's `ffn`, `sharding.ffn_split` and
`calibrate.check_ffns`. Mixture-of-experts layers (issue 26) are converted and run by the reference forward; where a
stage does not run them yet it refuses them with `experts_unsupported`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

NORMS = ("rms", "layer")
# hidden_act values with TensorRT-LLM's meaning: its `gelu` is the tanh approximation (tensorrt_llm/functional.py),
# the same function as HF's "gelu_new" / "gelu_pytorch_tanh".
ACTIVATIONS = ("silu", "swiglu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
ROPE_SCALINGS = ("linear", "llama3", "yarn")
# How a router turns its logits into the top-k experts' weights: softmax over all experts then the top k (Qwen2-MoE,
# Qwen3-MoE without norm_topk_prob; TensorRT-LLM's normalization_mode NONE), the top k logits then a softmax over them,
# or softmax, top k, and the k weights renormalised to sum to 1 (Mixtral, Qwen3-MoE's norm_topk_prob; TensorRT-LLM's
# RENORMALIZE, as transformers computes it). The last two are equal in exact arithmetic.
ROUTER_NORMS = ("softmax_topk", "topk_softmax", "softmax_topk_renormalise")
_T = TypeVar("_T")


@dataclass(frozen=True)
class Norm:
    """One norm: RMSNorm or LayerNorm (with bias). Gemma's (1 + w) is not a norm kind here: TensorRT-LLM's converter
    writes 1 + w into the checkpoint (`load_gemma_weights`, tensorrt_llm/models/gemma/convert.py) and so do we."""

    name: str  # tensor stem: PREFIX.NAME.weight (and .bias for LayerNorm)
    kind: str = "rms"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kind not in NORMS:
            raise UserError(f"norm {self.name}: kind {self.kind!r} is not one of {', '.join(NORMS)}")
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise UserError(f"'norm_epsilon' {self.eps!r} must be a finite positive number (norm {self.name})")

    @property
    def has_bias(self) -> bool:
        return self.kind == "layer"


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of a layer (rotate-half, GPT-NeoX style): its base and scaling (None: unscaled)."""

    base: float
    scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.base) or self.base <= 1:
            raise UserError(
                f"rotary base {self.base!r} ('rotary_base' or the family's) must be a finite number above 1"
            )
        kind = (self.scaling or {}).get("rope_type", (self.scaling or {}).get("type"))
        if self.scaling is not None and kind not in ROPE_SCALINGS:
            raise UserError(f"'rotary_scaling' type {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}")


def in_layer(index: int, make: Callable[..., _T], **fields: Any) -> _T:
    """`make(**fields)` for layer `index`: a part of a layer (its FFN) validates itself without knowing its layer,
    and its error names the layer here."""
    try:
        return make(**fields)
    except UserError as e:
        raise UserError(f"layer {index}: {e}") from e


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise UserError(f"hidden_act {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")


def _check_positive(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{what} {value!r} must be a positive integer")


@dataclass(frozen=True)
class DenseFFN:
    """One MLP every token goes through: proj(act(fc(x))) (`gated` False); TensorRT-LLM's GatedMLP
    proj(act(fc(x)) * gate(x)) (`gated`); or, `gate_up_fused`, fc holding [up; gate] stacked and no mlp.gate:
    proj(up * act(gate)), TensorRT-LLM's Phi-3 `MLP` with its `swiglu` (the second half activated). `bias`: fc,
    gate and proj add one. Its width is the model's intermediate_size."""

    gated: bool = True
    gate_up_fused: bool = False
    activation: str = "silu"
    bias: bool = False

    def __post_init__(self) -> None:
        _check_activation(self.activation)
        if self.gate_up_fused and not self.gated:
            raise UserError("a fused gate/up projection needs a gated MLP")


@dataclass(frozen=True)
class SharedExperts:
    """Experts every token goes through beside the routed ones (DeepSeek, Qwen2-MoE): `count` of them, each
    `intermediate_size` wide, gated or not."""

    count: int
    intermediate_size: int
    gated: bool = True

    def __post_init__(self) -> None:
        _check_positive("shared expert count", self.count)
        _check_positive("shared expert intermediate size", self.intermediate_size)


@dataclass(frozen=True)
class ExpertsFFN:
    """A mixture of experts: a router picks `top_k` of `num_experts` MLPs per token (each `expert_intermediate_size`
        wide, gated like DenseFFN or not) and weighs their outputs as `router_norm` says (ROUTER_NORMS); `shared`
        experts, if any, run on every token. Its tensors (docs/conversion.md, "Mixture-of-experts layers"): mlp.router
    [E, H] float32, mlp.fc [E, 2I, H] holding each expert's [up; gate], mlp.proj [E, H, I]."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    router_norm: str = "softmax_topk"
    gated: bool = True
    activation: str = "silu"
    bias: bool = False  # fc and proj add a bias per expert (mlp.fc.bias [E, 2I], mlp.proj.bias [E, H])
    shared: SharedExperts | None = None
    router_bias: bool = False  # the router adds one (mlp.router.bias [E], float32): gpt-oss
    # gpt-oss's clamped SwiGLU (TensorRT-LLM's MoE swiglu_alpha / swiglu_beta / swiglu_limit): with the gate clamped
    # to at most `swiglu_limit` and the up to [-limit, limit], act = gate * sigmoid(alpha * gate) * (up + beta).
    # The defaults (1, 0, no limit) are the plain gated silu, up * silu(gate).
    swiglu_alpha: float = 1.0
    swiglu_beta: float = 0.0
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        _check_positive("num_experts", self.num_experts)
        _check_positive("expert intermediate size", self.expert_intermediate_size)
        _check_positive("top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise UserError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}; use at most that")
        if self.router_norm not in ROUTER_NORMS:
            raise UserError(f"router normalisation {self.router_norm!r} is not one of {', '.join(ROUTER_NORMS)}")
        _check_activation(self.activation)
        for name in ("swiglu_alpha", "swiglu_beta", "swiglu_limit"):
            value = getattr(self, name)
            if value is None and name == "swiglu_limit":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise UserError(f"'{name}' {value!r} must be a finite number")
        if self.swiglu_alpha <= 0 or (self.swiglu_limit is not None and self.swiglu_limit <= 0):
            raise UserError(
                f"'swiglu_alpha' {self.swiglu_alpha!r} and 'swiglu_limit' {self.swiglu_limit!r} must be positive"
            )
        if self.clamped_swiglu and (not self.gated or self.activation != "silu"):
            raise UserError(
                f"swiglu_alpha/beta/limit apply to gated silu experts, not {self.activation!r} "
                f"({'gated' if self.gated else 'not gated'}); leave them at 1, 0 and null"
            )

    @property
    def clamped_swiglu(self) -> bool:
        """Whether the activation is gpt-oss's SwiGLU rather than the plain up * silu(gate)."""
        return (self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit) != (1.0, 0.0, None)


FFN = DenseFFN | ExpertsFFN  # a layer's feed-forward block


def experts_unsupported(where: str, ffn: ExpertsFFN) -> UserError:
    """The error a stage raises where it meets an ExpertsFFN it does not run yet."""
    return UserError(
        f"{where}: mixture-of-experts layers ({ffn.num_experts} experts, top {ffn.top_k}) are not supported here "
        "yet: convert (tp=1, or split with --tp / --moe-ep), the reference forward and the CPU engine run routed "
        "experts (gpt-oss's included), every quantize method quantizes them on a tp=1 checkpoint (AWQ, SmoothQuant "
        "and fp8 with routed calibration); shared experts and the TensorRT backend do not. Use the onnxruntime "
        "backend, or a dense model"
    )


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer.

    attention block: x -> attn_norm -> qkv (+ bias) -> [qk-norm per head] -> rotary -> attention (window, scale,
                     [sinks])
                     -> dense (+ bias) -> [attn_out_norm] -> + residual
    feed-forward:    x -> mlp_norm -> ffn (DenseFFN: fc -> activation [* gate(x)] -> proj; ExpertsFFN)
                     -> [mlp_out_norm] -> + residual
    """

    index: int
    attn_norm: Norm
    mlp_norm: Norm
    attn_out_norm: Norm | None = None  # Gemma 2/3's sandwich norms: on the block's output, before the residual
    mlp_out_norm: Norm | None = None
    q_norm: Norm | None = None  # per-head norms of q and k before rotary (Qwen3, Gemma 3)
    k_norm: Norm | None = None
    rope: Rope | None = None  # None: learned absolute positions (GPT-2)
    window: int | None = None  # each query sees itself and the window - 1 tokens before it
    attn_scale: float | None = None  # scores = q·k * attn_scale; None: head_size ** -0.5
    qkv_bias: bool = False
    dense_bias: bool = False
    ffn: FFN = DenseFFN()
    # gpt-oss's attention sinks: one learned logit per head (attention.sinks [num_heads], float32) joins every
    # query's softmax denominator and weighs no value
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise UserError(f"layer {self.index}: attention window {self.window!r} must be a positive integer")
        if not isinstance(self.ffn, DenseFFN | ExpertsFFN):
            raise UserError(f"layer {self.index}: ffn {self.ffn!r} is not a DenseFFN or an ExpertsFFN")
        if (self.q_norm is None) != (self.k_norm is None):
            raise UserError(f"layer {self.index}: q and k norms come as a pair")
        if self.attn_scale is not None and (not math.isfinite(self.attn_scale) or self.attn_scale <= 0):
            raise UserError(f"layer {self.index}: attention scale {self.attn_scale!r} must be finite and positive")

    @property
    def prefix(self) -> str:
        return f"transformer.layers.{self.index}"

    def linears(self) -> list[str]:
        """The layer's linear prefixes, in execution order."""
        p = self.prefix
        mlp = self.mlp_inputs()
        return [f"{p}.attention.qkv", f"{p}.attention.dense", *mlp, f"{p}.mlp.proj"]

    def mlp_inputs(self) -> list[str]:
        """The MLP's linears that read its input: fc and gate, or fc alone (plain, or gate and up fused in fc). The
        one place the description names a feed-forward block's linears (what calibration observes, quantization
        quantizes and the checkpoint must hold)."""
        p, ffn = self.prefix, self.ffn
        if isinstance(ffn, ExpertsFFN):  # the router and the stacked experts' [up; gate] both read the MLP's input
            return [f"{p}.mlp.router", f"{p}.mlp.fc"]
        return [f"{p}.mlp.fc", f"{p}.mlp.gate"] if ffn.gated and not ffn.gate_up_fused else [f"{p}.mlp.fc"]

    def smoothing_groups(self) -> list[tuple[Norm | None, list[str]]]:
        """SmoothQuant's pairs: the norm feeding a group of linears that read one input (its 1/s folds into the
        norm's weight), or None where no norm sits in front (the 1/s stays a pre-quant scale on the input). A
        sandwich norm is on a block's output, so it feeds nothing and pairs with nothing."""
        p = self.prefix
        mlp = self.mlp_inputs()
        return [
            (self.attn_norm, [f"{p}.attention.qkv"]),
            (self.mlp_norm, mlp),
            (None, [f"{p}.attention.dense"]),
            (None, [f"{p}.mlp.proj"]),
        ]

    def input_groups(self) -> list[list[str]]:
        """The linears that read one input, a group each: [qkv], [fc, gate] (or [fc]), [dense], [proj]."""
        return [linears for _, linears in self.smoothing_groups()]

    def has_bias(self, linear: str) -> bool:
        """Whether linear `linear` (a prefix of this layer) adds a bias."""
        if linear.endswith(".attention.qkv"):
            return self.qkv_bias
        if linear.endswith(".attention.dense"):
            return self.dense_bias
        if linear.endswith(".mlp.router"):
            return isinstance(self.ffn, ExpertsFFN) and self.ffn.router_bias
        return self.ffn.bias

    def norms(self) -> list[Norm]:
        return [n for n in (self.attn_norm, self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_norm,
                            self.mlp_out_norm) if n is not None]  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """The whole model: embedding (optionally scaled; learned positions or rotary in every layer), the layers, the
    final norm and lm_head (optionally soft-capped logits). Sizes are the checkpoint's (a TP shard's are its own)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    final_norm: Norm
    layers: tuple[LayerSpec, ...]
    learned_positions: bool = False
    embedding_scale: float | None = None  # the embedding lookup is multiplied by it (Gemma: sqrt(hidden))
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if not self.layers:
            raise UserError(f"{self.architecture}: a model needs at least one layer")
        if [ls.index for ls in self.layers] != list(range(len(self.layers))):
            raise UserError(f"{self.architecture}: layer specs must be numbered 0..{len(self.layers) - 1}")
        if any((ls.rope is None) != self.learned_positions for ls in self.layers):
            raise UserError(f"{self.architecture}: every layer has rotary embedding, or none (learned positions)")
        for name in ("embedding_scale", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise UserError(f"{self.architecture}: {name} {value!r} must be a finite positive number")

    @classmethod
    def of(cls, cfg: ModelConfig, final_norm: Norm, layers: tuple[LayerSpec, ...], **model: Any) -> ModelSpec:
        """A family's spec: sizes and tied embeddings from `cfg`, the rest from the family (`model`: the
        ModelSpec fields it sets, e.g. embedding_scale)."""
        return cls(
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_size=cfg.head_size,
            intermediate_size=cfg.intermediate_size,
            final_norm=final_norm,
            layers=layers,
            **model,
        )

    def tensor_names(self) -> list[str]:
        """Every tensor the description reads, by its checkpoint name (a quantized linear keeps PREFIX.weight for
        its codes; its scales come on top)."""

        def norm(n: Norm) -> list[str]:
            return [f"{n.name}.weight", f"{n.name}.bias"] if n.has_bias else [f"{n.name}.weight"]

        names = ["transformer.vocab_embedding.weight", *norm(self.final_norm), "lm_head.weight"]
        if self.learned_positions:
            names.append("transformer.position_embedding.weight")
        for ls in self.layers:
            names += [t for n in ls.norms() for t in norm(n)]
            names += [f"{p}.{k}" for p in ls.linears() for k in ("weight", "bias") if k == "weight" or ls.has_bias(p)]
            names += [f"{ls.prefix}.attention.sinks"] if ls.sinks else []
        return names

    def check_tensors(self, available: Collection[str], source: str) -> None:
        """Refuse a checkpoint that lacks a tensor its config.json's model needs, naming it."""
        missing = [n for n in self.tensor_names() if n not in available]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise UserError(
                f"{source}: {missing[0]}{more} missing, which config.json's {self.architecture} needs (biases, "
                "layers, norms); the weights and config.json do not match: re-run convert"
            )

    def q_scaling(self, layer: LayerSpec) -> float:
        """The attention plugin's field: scores = q·k / (sqrt(head_size) · q_scaling); exactly 1.0 by default."""
        return 1.0 if layer.attn_scale is None else 1 / (layer.attn_scale * self.head_size**0.5)

    def in_features(self, linear: str) -> int:
        """The input width of linear `linear` (a layer's linear prefix, or lm_head): heads * head_size for
        attention.dense, the intermediate size for mlp.proj (an expert's for a mixture of experts), the hidden size
        for the others."""
        if linear == "lm_head":
            return self.hidden_size
        for ls in self.layers:
            if linear in ls.linears():
                p = ls.prefix
                attention = self.num_heads * self.head_size
                ffn = ls.ffn
                width = ffn.expert_intermediate_size if isinstance(ffn, ExpertsFFN) else self.intermediate_size
                widths = {f"{p}.attention.dense": attention, f"{p}.mlp.proj": width}
                return widths.get(linear, self.hidden_size)  # qkv, fc, gate: the normed residual stream
        raise UserError(
            f"{linear} is not a linear of this {self.architecture} (lm_head, or a layer's qkv, dense, fc, gate, "
            "proj); the checkpoint and its config.json do not match: re-run convert"
        )

    @property
    def windows(self) -> list[int | None]:
        return [ls.window for ls in self.layers]


def spec_of(cfg: ModelConfig, source: str = "config.json") -> ModelSpec:
    """The spec of a checkpoint config, made by its family's module; an error names `source` (the config's path)."""
    from toolchain.checkpoint.registry import family_of_config  # the registry imports the family modules

    try:
        return family_of_config(cfg).spec(cfg)
    except UserError as e:
        raise UserError(f"{source}: {e}") from e
