"""Mixture-of-experts families (Mixtral, Qwen3-MoE; issue 26's first slice): the checkpoint holds TensorRT-LLM's MoE
layout (docs/conversion.md, "Mixture-of-experts layers"), every source tensor is consumed, the reference forward
routes every token to the experts transformers' router picks (ties included), and what is not implemented is
refused with one line before anything is written. Logit parity itself: models.PARITY (test_family_parity)."""

from __future__ import annotations

import json
import shutil
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import BASE, wide_init
from models import MIXTRAL, QWEN3_MOE, hf_classes
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from toolchain import seeded
from toolchain.checkpoint.convert import OutputTensor, _stacked, convert
from toolchain.checkpoint.hf import HFCheckpoint
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import ExpertsFFN, spec_of
from toolchain.checkpoint.trtllm import read_config
from toolchain.errors import UserError
from toolchain.reference.model import ReferenceModel

# Qwen3-MoE with a dense layer among sparse ones (mlp_only_layers [1]: layers 0 and 2 sparse), renormalised top-3.
QWEN3 = {**QWEN3_MOE, "norm_topk_prob": True}


def _is_norm(name: str) -> bool:
    return "norm" in name and name.endswith("weight")


def save(path: Path, arch: str, config: dict[str, Any], tie_router_rows: bool = False) -> Path:
    """A random model saved by transformers; `tie_router_rows`: expert 2's router row made expert 1's in every layer,
    so every token's logits for the two are exactly equal and top-k must break the tie as transformers does."""
    config_cls, model_cls = hf_classes(arch)
    model = model_cls(config_cls(**{**BASE, **config}))
    seeded.fill_(list(model.named_parameters()), 0, wide_init(_is_norm))
    if tie_router_rows:
        with torch.no_grad():
            for module in _routers(model):
                module.weight[2] = module.weight[1]
    model.save_pretrained(path, safe_serialization=True)
    return path


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' router modules (MixtralTopKRouter, Qwen3MoeTopKRouter), in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(HF dir, checkpoint) per case, made once for the module."""
    root = tmp_path_factory.mktemp("moe")
    cases = {
        "mixtral": ("mixtral", MIXTRAL, False),
        "mixtral-ties": ("mixtral", {**MIXTRAL, "num_local_experts": 4}, True),
        "qwen3_moe": ("qwen3_moe", QWEN3, False),
        "qwen3_moe-unnormalised-ties": ("qwen3_moe", {**QWEN3, "norm_topk_prob": False}, True),
    }
    out = {}
    for name, (arch, config, ties) in cases.items():
        hf = save(root / name / "hf", arch, config, ties)
        convert(hf, root / name / "ckpt")
        out[name] = (hf, root / name / "ckpt")
    return out


def _routing(hf_dir: Path, ckpt: Path, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """The experts transformers' routers chose per token and layer, the reference forward's, and its model."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    theirs: list[torch.Tensor] = []
    for router in _routers(hf):
        router.register_forward_hook(lambda _m, _i, out: theirs.append(out[2]))
    with torch.no_grad():
        hf(ids)
    ref = ReferenceModel.from_checkpoint(ckpt)
    ours: list[torch.Tensor] = []
    route = ref.route

    def recorded(x: torch.Tensor, layer: str, ffn: ExpertsFFN) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(x, layer, ffn)
        ours.append(experts)
        return weights, experts

    ref.route = recorded  # type: ignore[method-assign]
    ref.forward(ids)
    return theirs, ours, ref


@pytest.mark.parametrize("name", ["mixtral", "mixtral-ties", "qwen3_moe", "qwen3_moe-unnormalised-ties"])
def test_every_token_goes_to_the_experts_transformers_picks(name: str, converted: dict[str, tuple[Path, Path]]) -> None:
    hf_dir, ckpt = converted[name]
    ids = torch.randint(0, BASE["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(3))
    theirs, ours, ref = _routing(hf_dir, ckpt, ids)
    sparse = [ls for ls in ref.spec.layers if isinstance(ls.ffn, ExpertsFFN)]
    assert len(theirs) == len(ours) == len(sparse) > 0
    for layer, (expected, got) in zip(sparse, zip(theirs, ours, strict=True), strict=True):
        assert isinstance(layer.ffn, ExpertsFFN)
        assert got.shape == (ids.numel(), layer.ffn.top_k)
        assert torch.equal(got, expected), f"layer {layer.index}: the experts chosen differ from transformers'"
        assert len(set(got.flatten().tolist())) > layer.ffn.top_k  # the routing is not trivially one set
    if "ties" in name:  # experts 1 and 2 score exactly alike: where only one of them fits, the tie-break decides
        split = [((got == 1).any(-1) != (got == 2).any(-1)).sum().item() for got in ours]
        assert sum(split) > 0


def test_the_checkpoint_holds_tensorrt_llm_s_moe_layout(converted: dict[str, tuple[Path, Path]]) -> None:
    """Mixtral: router [E, H] float32 = gate; fc [E, 2I, H] = each expert's [w3 (up); w1 (gate)]; proj [E, H, I] =
    w2. Qwen3-MoE: the same from gate/up/down_proj; its dense layer 1 has Llama's fc (gate_proj), gate (up_proj)."""
    for name, names in (("mixtral", ("block_sparse_moe.gate", "w1", "w3", "w2")),
                        ("qwen3_moe", ("mlp.gate", "gate_proj", "up_proj", "down_proj"))):  # fmt: skip
        hf_dir, ckpt = converted[name]
        src, out = load_file(hf_dir / "model.safetensors"), load_file(ckpt / "rank0.safetensors")
        cfg = read_config(ckpt)
        moe = cfg.family_fields["moe"]
        experts, size = moe["num_experts"], cfg.family_fields["moe_intermediate_size"]
        router, gate, up, down = names
        container = router.rsplit(".", 1)[0]
        p, s = "transformer.layers.0.mlp", f"model.layers.0.{container}.experts"
        assert out[f"{p}.router.weight"].dtype == torch.float32
        assert torch.equal(out[f"{p}.router.weight"], src[f"model.layers.0.{router}.weight"])
        assert out[f"{p}.fc.weight"].shape == (experts, 2 * size, BASE["hidden_size"])
        assert out[f"{p}.proj.weight"].shape == (experts, BASE["hidden_size"], size)
        assert spec_of(cfg).in_features(f"{p}.proj") == size
        for e in range(experts):
            assert torch.equal(out[f"{p}.fc.weight"][e, :size], src[f"{s}.{e}.{up}.weight"])
            assert torch.equal(out[f"{p}.fc.weight"][e, size:], src[f"{s}.{e}.{gate}.weight"])
            assert torch.equal(out[f"{p}.proj.weight"][e], src[f"{s}.{e}.{down}.weight"])
    _, ckpt = converted["qwen3_moe"]
    out, config = load_file(ckpt / "rank0.safetensors"), json.loads((ckpt / "config.json").read_text())
    assert config["mlp_only_layers"] == [1] and config["moe"]["normalization_mode"] == 1
    assert config["moe"]["top_k"] == 3 and config["moe_shared_expert_intermediate_size"] == 0
    assert out["transformer.layers.1.mlp.fc.weight"].shape == (BASE["intermediate_size"], BASE["hidden_size"])
    assert "transformer.layers.1.mlp.router.weight" not in out and "transformer.layers.0.mlp.gate.weight" not in out


def test_bfloat16_experts_keep_a_float32_router(tmp_path: Path) -> None:
    hf = save(tmp_path / "hf", "mixtral", {**MIXTRAL, "num_local_experts": 4})
    convert(hf, tmp_path / "ckpt", dtype="bfloat16")
    out = load_file(tmp_path / "ckpt" / "rank0.safetensors")
    assert out["transformer.layers.1.mlp.router.weight"].dtype == torch.float32
    assert out["transformer.layers.1.mlp.fc.weight"].dtype == torch.bfloat16
    assert out["transformer.layers.1.mlp.proj.weight"].dtype == torch.bfloat16


def test_qwen3_moe_decoder_sparse_step_and_both_expert_count_names(tmp_path: Path) -> None:
    """decoder_sparse_step 2 makes layers 0 and 2 dense, mlp_only_layers adds 3 (sparse: 1); released configs say
    num_experts, transformers 5.x writes num_local_experts: either alone is read."""
    config = {**QWEN3, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    hf = save(tmp_path / "hf", "qwen3_moe", config)
    data = json.loads((hf / "config.json").read_text())
    data["num_experts"] = data.pop("num_local_experts")
    (hf / "config.json").write_text(json.dumps(data))
    convert(hf, tmp_path / "ckpt")
    cfg = read_config(tmp_path / "ckpt")
    assert cfg.family_fields["mlp_only_layers"] == [0, 2, 3]
    assert cfg.family_fields["moe"]["num_experts"] == 8


def _edit_config(hf: Path, **changes: Any) -> None:
    data = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**data, **changes}))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"shared_expert_intermediate_size": 64}, r"'shared_expert_intermediate_size' 64 \(shared experts\) is not "
                                                  r"supported; it must be 0 or absent"),
        ({"num_experts": 6}, r"'num_experts' 6, 'num_local_experts' 8 disagree"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 exceeds the 8 experts"),
        ({"mlp_only_layers": [5]}, r"'mlp_only_layers' names layer 5, outside 0\.\.2"),
        ({"decoder_sparse_step": 0}, r"'decoder_sparse_step' must be a positive integer, got 0"),
        ({"norm_topk_prob": "yes"}, r"'norm_topk_prob' must be true or false, got 'yes'"),
    ],
)  # fmt: skip
def test_qwen3_moe_values_we_do_not_implement_are_refused_before_writing(
    changes: dict[str, Any], expected: str, converted: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    hf = Path(shutil.copytree(converted["qwen3_moe"][0], tmp_path / "hf"))
    _edit_config(hf, **changes)
    with pytest.raises(UserError, match=expected):
        convert(hf, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_every_source_tensor_is_consumed_or_the_conversion_is_refused(
    converted: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """An expert more than config.json counts (or one fewer) is a checkpoint the converter does not understand."""
    hf = Path(shutil.copytree(converted["mixtral"][0], tmp_path / "hf"))
    tensors = load_file(hf / "model.safetensors")
    extra = "model.layers.0.block_sparse_moe.experts.8.w1.weight"
    save_file({**tensors, extra: tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()},
              hf / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(UserError, match=r"1 tensor\(s\) not consumed by the MixtralForCausalLM converter: " + extra):
        convert(hf, tmp_path / "ckpt")
    _edit_config(hf, num_local_experts=9)
    with pytest.raises(UserError, match=r"tensor\(s\) the MixtralForCausalLM config requires are missing: "):
        convert(hf, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_config_with_a_moe_value_we_do_not_implement_is_refused(
    converted: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    ckpt = Path(shutil.copytree(converted["mixtral"][1], tmp_path / "ckpt"))
    data = json.loads((ckpt / "config.json").read_text())
    for changes, expected in (
        ({"moe": {**data["moe"], "normalization_mode": 2}}, r"'moe\.normalization_mode' 2 is not supported; "
                                                            r"supported: 0 \(softmax_topk\), 1 \(softmax_topk_renorm"),
        ({"moe_shared_expert_intermediate_size": 128},
         r"'moe_shared_expert_intermediate_size' 128: shared experts are not supported for MixtralForCausalLM"),
        ({"mlp_only_layers": [0, 0]}, r"'mlp_only_layers' \[0, 0\] must list distinct layers in 0\.\.1"),
    ):  # fmt: skip
        (ckpt / "config.json").write_text(json.dumps({**data, **changes}))
        with pytest.raises(UserError, match=r"config\.json: " + expected):
            read_config(ckpt)


def test_experts_split_over_ranks_only_where_they_divide(
    converted: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Tensor and expert parallelism of experts (issue 27): a split that does not divide the experts is refused in
    one line naming the valid sizes (tests/parallel/test_sharding_moe.py checks the splits themselves)."""
    hf, _ = converted["mixtral"]
    with pytest.raises(UserError, match=r"expert-parallel size 4 \(--moe-ep\) at tp 2 .* valid --moe-ep at tp 2: 1, 2"):
        convert(hf, tmp_path / "tp2", tp=2, moe_ep=4)
    assert not (tmp_path / "tp2").exists()


def test_convert_holds_one_expert_s_source_at_a_time(converted: dict[str, tuple[Path, Path]]) -> None:
    """The stacked tensor is filled from one source tensor at a time: each is released before the next is read."""
    hf_dir, _ = converted["mixtral"]
    ckpt = HFCheckpoint.open(hf_dir)
    names = tuple(f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(8) for w in ("w3", "w1"))
    alive: list[weakref.ref[np.ndarray[Any, Any]]] = []
    with ckpt.reader() as reader:
        get = reader.get

        def tracked(name: str) -> np.ndarray[Any, Any]:
            assert all(ref() is None for ref in alive), "a previous expert's source is still held"
            tensor = get(name)
            alive.append(weakref.ref(tensor))
            return tensor

        reader.get = tracked  # type: ignore[method-assign]
        rule = Rule("transformer.layers.0.mlp.fc.weight", names, experts=8)
        stacked = _stacked(OutputTensor(rule.dst, rule, (8, 96, 64)), reader, np.dtype(np.float32))
    assert len(alive) == len(names)
    assert torch.equal(torch.from_numpy(stacked[3, 48:]), load_file(hf_dir / "model.safetensors")[names[7]])
