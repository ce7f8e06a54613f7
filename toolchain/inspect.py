"""`trtbuild inspect`: what an artifact directory is, from its config and manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolchain.checkpoint.hf import load_json
from toolchain.checkpoint.trtllm import CONFIG_NAME, read_config
from toolchain.engine.api import BUILD_CONFIG, EngineSpec
from toolchain.errors import UserError
from toolchain.evaluate.report import built_rows
from toolchain.manifest import MANIFEST_NAME, read_manifest


def _manifest_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    tool = manifest.get("toolchain", {})
    return {
        "stage": manifest.get("stage"),
        "toolchain_version": tool.get("version"),
        "git_commit": tool.get("git_commit"),
        "recipe_sha256": manifest.get("recipe_sha256"),
        "inputs": len(manifest.get("inputs", [])),
        "outputs": len(manifest.get("outputs", [])),
        "output_bytes": sum(e["size"] for e in manifest.get("outputs", [])),
        "wall_time_s": manifest.get("wall_time_s"),
        "peak_rss_bytes": manifest.get("peak_rss_bytes"),
        "gpu": (manifest.get("gpu") or {}).get("name"),
        "warnings": manifest.get("warnings", []),
    }


def _hf_model(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    return {
        "kind": "hf-model",
        "architectures": config.get("architectures"),
        **{k: config.get(k) for k in keys},
        "weight_files": sorted(p.name for p in directory.glob("*.safetensors")),
    }


def _checkpoint(directory: Path) -> dict[str, Any]:
    cfg = read_config(directory)
    ranks = sorted(directory.glob("rank*.safetensors"))
    return {
        "kind": "checkpoint",
        "architecture": cfg.architecture,
        "dtype": cfg.dtype,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_size": cfg.head_size,
        "vocab_size": cfg.vocab_size,
        "rotary_scaling": cfg.rotary_scaling,
        "mapping": cfg.to_dict()["mapping"],
        "quantization": cfg.to_dict()["quantization"],
        "rank_files": {p.name: p.stat().st_size for p in ranks},
        "experts": _experts(cfg, directory),
    }


def _experts(cfg: Any, directory: Path) -> str | None:
    """A mixture-of-experts model's routing in one phrase (None for a dense model)."""
    from toolchain.checkpoint.spec import ExpertsFFN, spec_of

    layers = spec_of(cfg, str(directory / CONFIG_NAME)).layers
    sparse = [(ls.index, ls.ffn) for ls in layers if isinstance(ls.ffn, ExpertsFFN)]
    if not sparse:
        return None
    ffn = sparse[0][1]
    return (
        f"top-{ffn.top_k} of {ffn.num_experts} ({ffn.router_norm}), {ffn.expert_intermediate_size} wide, in "
        f"{len(sparse)} of {len(layers)} layers"
    )


# The status of the plugin kernels (docs/kernels.md): one phrase, the same for both backends.
PLUGIN_STATUS = "executed in CI by Triton's interpreter; not yet timed on a GPU"
_CPU_PLUGINS = (
    f"KVCacheWrite, PagedAttention: reference ops on the CPU engine; the Triton kernels are {PLUGIN_STATUS} "
    "(docs/kernels.md)"
)
_TENSORRT_PLUGINS = (
    f"KVCacheWrite, PagedAttention: Triton kernels (PTX) in the plan, {PLUGIN_STATUS}; the TensorRT runtime "
    "backend is not verified on a GPU yet (docs/kernels.md, docs/engine.md)"
)


def _moe_op(directory: Path) -> str:
    """What runs the engine graph's mixture-of-experts nodes, if it has any."""
    import onnx

    from toolchain.engine.api import MODEL_NAME, rank_dir
    from toolchain.engine.contract import PLUGIN_DOMAIN
    from toolchain.engine.ops import MOE_OP

    path = directory / MODEL_NAME
    if not path.is_file():  # a multi-rank engine: rank 0's graph has the same kinds of layers as every rank's
        path = rank_dir(directory, 0) / MODEL_NAME
    if not path.is_file():
        return ""
    graph = onnx.load(str(path), load_external_data=False).graph
    if not any(n.domain == PLUGIN_DOMAIN and n.op_type == MOE_OP for n in graph.node):
        return ""
    return f"; {MOE_OP}: its reference op on the CPU engine, split into MoESort / MoEFc / MoEProj plugins on TensorRT"


def _engine(directory: Path) -> dict[str, Any]:
    spec = EngineSpec.from_dir(directory)
    compat = spec.compatibility or {}
    return {
        "kind": "engine",
        "engine": {
            "backend": spec.backend,
            "dtype": spec.dtype,
            "architecture": spec.architecture,
            "quant_algo": spec.quantization.get("quant_algo"),
            "kv_cache": spec.kv_cache.dtype,
            "limits": spec.limits.to_json(),
            "tensorrt": compat.get("tensorrt"),
            "gpu": compat.get("gpu"),
            "sm": compat.get("sm"),
            "driver": compat.get("driver"),
            "cuda": compat.get("cuda"),
            "onnxruntime": spec.onnxruntime,
            # until the CUDA plugins and the TensorRT runtime have run on a GPU (docs/kernels.md, docs/engine.md)
            "plugins": (_TENSORRT_PLUGINS if spec.backend == "tensorrt" else _CPU_PLUGINS) + _moe_op(directory),
            **_ranks(directory, spec),
        },
    }


def _ranks(directory: Path, spec: EngineSpec) -> dict[str, Any]:
    """A multi-rank engine's mapping and, per rank, its part (from build_config.json) and its files with the
    hashes its manifest records (nothing for a single-rank engine)."""
    if spec.world_size == 1:
        return {}
    manifest = read_manifest(directory) if (directory / MANIFEST_NAME).is_file() else {}
    heads = (manifest.get("details") or {}).get("rank_heads") or [None] * spec.world_size
    outputs = manifest.get("outputs", [])
    m = spec.mapping
    return {
        "mapping": {"world_size": m.world_size, "tp_size": m.tp_size, "pp_size": m.pp_size},
        "ranks": [
            {
                "rank": part.rank,
                "tp_rank": part.tp_rank,
                "pp_rank": part.pp_rank,
                "layers": list(part.layers),
                "heads": heads[part.rank] if part.rank < len(heads) else None,
                "kv_heads": part.kv_cache.num_kv_heads,
                "files": {
                    e["path"]: {"size": e["size"], "sha256": e["sha256"]}
                    for e in outputs
                    if e["path"].startswith(f"rank{part.rank}/")
                },
            }
            for part in spec.ranks
        ],
    }


def rank_lines(e: dict[str, Any], indent: str = "") -> list[str]:
    """`inspect`'s lines for a multi-rank engine: the mapping, then one line per rank."""
    m = e["mapping"]
    lines = [
        f"{indent}  mapping       tp {m['tp_size']} x pp {m['pp_size']} = {m['world_size']} ranks "
        "(rank = pp_rank * tp_size + tp_rank)"
    ]
    for r in e["ranks"]:
        start, stop = r["layers"]
        files = ", ".join(f"{p} ({f['size']:,} B, sha256 {f['sha256'][:12]})" for p, f in r["files"].items())
        lines.append(
            f"{indent}  rank {r['rank']:<8} tp {r['tp_rank']}, pp {r['pp_rank']}: layers {start}-{stop - 1} "
            f"({stop - start}), heads "
            f"{r['heads'] if r['heads'] is not None else '?'}, KV heads {r['kv_heads']}; {files or 'no files'}"
        )
    return lines


def _eval(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """An eval stage's verdict, per-gate results, key metrics and what was built, from its manifest."""
    details = manifest.get("details") or {}
    if manifest.get("stage") != "eval" or not isinstance(details.get("quality"), dict):
        return None
    gates = details.get("gates") or []
    q = details["quality"]
    return {
        "verdict": ("PASS" if details.get("passed") else "REGRESSION") if gates else "no gates set",
        "passed": details.get("passed"),
        "gates": gates,
        "metrics": {
            "kld_mean": q.get("kld_mean"),
            "same_top1": q.get("same_top1"),
            "ppl_ratio": q.get("ppl_ratio"),
            "tokens": q.get("tokens"),
            "golden_exact": details.get("golden_exact"),
            "golden_prompts": details.get("golden_prompts"),
        },
        "built": details.get("built"),
    }


def eval_lines(ev: dict[str, Any], indent: str = "") -> list[str]:
    """`inspect`'s lines for an eval verdict: the verdict, the key metrics, then one line per gate."""
    m = ev["metrics"]
    golden = ""
    if m.get("golden_exact") is not None:
        golden = f", golden exact {100 * m['golden_exact']:.1f} %"
        golden += f" of {m['golden_prompts']} prompts" if m.get("golden_prompts") else ""
    lines = [
        f"{indent}  eval          {ev['verdict']}: mean KLD {m['kld_mean']:.6g}, same top-1 "
        f"{100 * m['same_top1']:.2f} %, PPL ratio {m['ppl_ratio']:.5f}{golden} ({m['tokens']:,} tokens)"
    ]
    lines += [
        f"{indent}  gate          {g['gate']} {g['value']:.6g} vs {g['limit']:g}: {'pass' if g['pass'] else 'FAIL'}"
        for g in ev["gates"]
    ]
    if ev.get("built"):
        rows = dict(built_rows(ev["built"]))
        lines.append(
            f"{indent}  built         {rows['method']}, KV cache {rows['KV cache']}, {rows['backend']}, engine "
            f"manifest {(ev['built'].get('engine_manifest_sha256') or 'none')[:16]}"
        )
    return lines


def describe(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory; pass a checkpoint or run output directory")
    info: dict[str, Any] = {"path": str(directory.resolve())}
    if (directory / CONFIG_NAME).is_file():
        config = load_json(directory / CONFIG_NAME)
        hf_style = "architecture" not in config and "architectures" in config
        info.update(_hf_model(directory, config) if hf_style else _checkpoint(directory))
    if (directory / BUILD_CONFIG).is_file():
        info.update(_engine(directory))
    children = [p for p in sorted(directory.iterdir()) if p.is_dir() and (p / MANIFEST_NAME).is_file()]
    if children:
        info["kind"] = info.get("kind", "run")
        info["stages"] = {p.name: describe(p) for p in children}
    if "kind" not in info and not (directory / MANIFEST_NAME).is_file():
        raise UserError(f"{directory}: neither {CONFIG_NAME} nor {MANIFEST_NAME}; not a trtbuild artifact")
    if (directory / MANIFEST_NAME).is_file():
        manifest = read_manifest(directory)
        info["manifest"] = _manifest_summary(manifest)
        info.setdefault("kind", info["manifest"]["stage"])
        if (verdict := _eval(manifest)) is not None:
            info["eval"] = verdict
    evals = [child["eval"] for child in info.get("stages", {}).values() if "eval" in child]
    if "eval" not in info and len(evals) == 1:  # a run dir: its report's verdict at the top
        info["eval"] = evals[0]
    return info


def describe_lines(info: dict[str, Any], indent: str = "", eval_shown: bool = False) -> list[str]:
    """`trtbuild inspect`'s text: one block per artifact, a run's stages indented under it."""
    lines = [f"{indent}{info['path']}  ({info['kind']})"]
    if "eval" in info and not eval_shown:  # a run's verdict at its top, not again under its report stage
        lines += eval_lines(info["eval"], indent)
    if info["kind"] == "hf-model":
        lines.append(
            f"{indent}  hugging face  {info['architectures']}, {info['num_hidden_layers']} layers, hidden "
            f"{info['hidden_size']}, vocab {info['vocab_size']}, weights {', '.join(info['weight_files'])}"
        )
    if "architecture" in info:
        lines += [
            f"{indent}  architecture  {info['architecture']}  dtype {info['dtype']}",
            f"{indent}  shape         {info['layers']} layers, hidden {info['hidden_size']}, heads "
            f"{info['heads']}/{info['kv_heads']} kv, head_size {info['head_size']}, vocab {info['vocab_size']}",
            f"{indent}  rotary        scaling {info['rotary_scaling']}",
            f"{indent}  mapping       {info['mapping']}",
            f"{indent}  quantization  {info['quantization']['quant_algo'] or 'none'} "
            f"(kv cache: {info['quantization']['kv_cache_quant_algo'] or 'none'})",
            f"{indent}  rank files    " + ", ".join(f"{n} ({s:,} B)" for n, s in info["rank_files"].items()),
        ]
        if info.get("experts"):
            lines.append(f"{indent}  experts       {info['experts']}")
    if "engine" in info:
        e = info["engine"]
        limits = e["limits"]
        lines += [
            f"{indent}  engine        {e['architecture']} on {e['backend']}, {e['dtype']}, "
            f"{e['quant_algo'] or 'unquantized'}, kv cache {e['kv_cache']}",
            f"{indent}  limits        batch {limits['max_batch_size']}, tokens/call {limits['max_num_tokens']}, "
            f"seq {limits['max_seq_len']}, {limits['tokens_per_block']} tokens/block, {limits['num_blocks']} blocks",
            f"{indent}  built with    TensorRT {e['tensorrt'] or '-'}, GPU {e['gpu'] or '-'} (SM {e['sm'] or '-'}), "
            f"driver {e['driver'] or '-'}, CUDA {e['cuda'] or '-'}, onnxruntime {e['onnxruntime'] or '-'}",
            f"{indent}  plugins       {e['plugins']}",
        ]
        if "mapping" in e:
            lines += rank_lines(e, indent)
    if "manifest" in info:
        m = info["manifest"]
        lines.append(
            f"{indent}  manifest      stage {m['stage']}, trtbuild {m['toolchain_version']} "
            f"({(m['git_commit'] or 'no git')[:12]}), {m['inputs']} inputs, {m['outputs']} outputs "
            f"({m['output_bytes']:,} B), {m['wall_time_s']} s, peak RSS {m['peak_rss_bytes'] / 2**20:.0f} MiB"
        )
        lines += [f"{indent}  warning       {w}" for w in m["warnings"]]
    for child in info.get("stages", {}).values():
        lines += describe_lines(child, indent + "  ", "eval" in info)
    return lines
