"""The embedded default model: a small random Llama in Hugging Face format, made here, never downloaded; and its
mixture-of-experts sibling, a small random Qwen3-MoE (`make_tiny_moe`, issue 26).

Fixed seed, a few MB, GQA 4:1, untied head, with a byte-level tokenizer, so the whole pipeline can run on
a fresh machine with no data and no network. The weights come from `toolchain.seeded`, so a seed gives the same
bytes on every CPU (transformers' own initialisation draws through torch's ISA-dependent normal generator).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolchain import seeded
from toolchain.atomic import atomic_dir
from toolchain.manifest import StageRecord

INIT_STD = 0.02  # LlamaConfig's initializer_range: the spread transformers would draw the matrices with

# Byte-level BPE without merges: every byte is a token, plus the three Llama specials.
SPECIALS = ("<unk>", "<s>", "</s>")
CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# The MoE sibling: Qwen3-MoE (q/k norms), top-2 of 8 renormalised experts, layer 1 dense among sparse ones, so that
# every MoE feature the CPU engine runs is exercised by the recipe that CI runs (recipes/tiny-moe.yaml).
MOE_CONFIG: dict[str, Any] = {
    **{k: v for k, v in CONFIG.items() if k != "intermediate_size"},
    "intermediate_size": 256,  # the dense layer's MLP
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}

# a plain role-tagged template, so that `serve`'s /v1/chat/completions works on the demo engine
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_level_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(sorted(byte_vocab))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_llama(out: Path, seed: int = 0, force: bool = False) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _make_tiny(out, seed, force, CONFIG, lambda: LlamaForCausalLM(LlamaConfig(**CONFIG, dtype="float32")))


def make_tiny_moe(out: Path, seed: int = 0, force: bool = False) -> dict[str, Any]:
    """The tiny Qwen3-MoE (MOE_CONFIG), made as the tiny Llama is: seeded weights, byte-level tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _make_tiny(
        out, seed, force, MOE_CONFIG, lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_CONFIG, dtype="float32"))
    )


def _make_tiny(
    out: Path, seed: int, force: bool, config: dict[str, Any], new_model: Callable[[], Any]
) -> dict[str, Any]:
    record = StageRecord("tiny-model", details={"seed": seed, "config": config})
    with atomic_dir(out, force) as tmp:
        model = new_model()
        seeded.fill_(list(model.named_parameters()), seed, seeded.matrices(INIT_STD))
        model.save_pretrained(tmp, safe_serialization=True)
        byte_level_tokenizer().save_pretrained(tmp)
        manifest = record.write(tmp)
    params = sum(p.numel() for p in model.parameters())
    return {
        "output_dir": str(out.resolve()),
        "num_parameters": params,
        "seed": seed,
        "outputs": manifest["outputs"],
    }
