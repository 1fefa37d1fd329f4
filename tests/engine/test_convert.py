"""GGUF to Hugging Face conversion: a tiny GGUF written the way llama.cpp's converter writes one
(Q and K rows permuted, some tensors quantized) round-trips to its source checkpoint; the
conversion is idempotent and atomic. SmolLM2-135M itself, converted once per session into the
user's cache (the ``smollm2`` fixture of tests/support/fixtures.py), answers as transformers does
through the engine: tests/engine/test_engine_model.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from gateway.text.model_template import read_chat_template
from tests.support.tiny_checkpoint import write_tiny_checkpoint
from workers import convert
from workers.engine.checkpoint import read_config
from workers.engine.runner import ModelRunner

# Quantized as the SmolLM2 GGUF is (Q8_0 embeddings, Q4_1 matrices); Q and K stay float32, so that
# their round trip through the permutation is checked against the source bit for bit.
QUANTIZED = {"token_embd.weight": "Q8_0", "blk.0.ffn_up.weight": "Q4_1", "blk.1.attn_v.weight": "Q4_1"}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (its ``permute``)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(model_dir, path) -> dict[str, np.ndarray]:
    """A GGUF of the tiny checkpoint; returns the tensors a faithful conversion must give back."""
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType
    from gguf.quants import dequantize, quantize

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_scaling_type(RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(config["rope_scaling"]["factor"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    special = {token["content"] for token in tokenizer["added_tokens"] if token["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types(
        [TokenType.CONTROL if token in special else TokenType.NORMAL for token, _ in vocab]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    expected = {}
    gguf_names = {hf: gguf for gguf, hf in convert.NAMES.items()}
    for name, weight in load_file(model_dir / "model.safetensors").items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            short = {hf: g for g, hf in convert.LAYER_NAMES.items()}[rest.removesuffix(".weight")]
            gguf_name = f"blk.{layer}.{short}.weight"
        else:
            gguf_name = gguf_names[name]
        stored = weight
        if gguf_name.endswith("attn_q.weight"):
            stored = llama_cpp_permute(weight, config["num_attention_heads"])
        elif gguf_name.endswith("attn_k.weight"):
            stored = llama_cpp_permute(weight, config["num_key_value_heads"])
        if gguf_name in QUANTIZED:
            kind = GGMLQuantizationType[QUANTIZED[gguf_name]]
            packed = quantize(stored, kind)
            writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=kind)
            weight = dequantize(packed, kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(stored))
        expected[name] = weight
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    source = write_tiny_checkpoint(root / "source", tied=False, rope_scaling="linear", seed=4)
    expected = write_gguf(source, root / "tiny.gguf")
    return source, root / "tiny.gguf", expected


def test_a_llama_cpp_gguf_converts_back_to_its_checkpoint(tiny_gguf, tmp_path):
    source, gguf_path, expected = tiny_gguf
    logs: list[str] = []
    out = convert.convert_gguf(gguf_path, tmp_path / "model", log=logs.append)
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted(expected)
    for name, weight in expected.items():
        np.testing.assert_array_equal(tensors[name], weight, err_msg=name)
    assert read_config(out) == read_config(source)
    runner = ModelRunner(out, num_blocks=4)
    text = "<|im_start|>user\nTickets cost 12 coins.<|im_end|>"
    ours, theirs = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (out, source))
    assert ours.encode(text).ids == theirs.encode(text).ids
    assert read_chat_template(out).source == "{{ messages }}" and runner.eos_token_ids == frozenset({2})
    assert logs[0].startswith("reading") and logs[-1].startswith(f"{out}: done in")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_second_conversion_finds_the_first(tiny_gguf, tmp_path):
    _, gguf_path, _ = tiny_gguf
    out = convert.convert_gguf(gguf_path, tmp_path / "model", log=lambda line: None)
    before = (out / "model.safetensors").stat()
    logs: list[str] = []
    assert convert.convert_gguf(gguf_path, out, log=logs.append) == out
    assert logs == [f"{out}: already converted"]
    after = (out / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_an_interrupted_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    _, gguf_path, _ = tiny_gguf

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_write_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_gguf(gguf_path, tmp_path / "model", log=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_an_older_format_is_converted_again_and_a_foreign_directory_refused(tiny_gguf, tmp_path):
    _, gguf_path, _ = tiny_gguf
    out = convert.convert_gguf(gguf_path, tmp_path / "model", log=lambda line: None)
    stamp = json.loads((out / convert.STAMP).read_text())
    (out / convert.STAMP).write_text(json.dumps(stamp | {"format": convert.FORMAT - 1}))
    logs: list[str] = []
    convert.convert_gguf(gguf_path, out, log=logs.append)
    assert "converting again" in logs[0] and json.loads((out / convert.STAMP).read_text()) == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    with pytest.raises(FileExistsError, match="was not written by this converter"):
        convert.convert_gguf(gguf_path, foreign, log=lambda line: None)


def test_the_cache_directory_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert convert.models_dir() == tmp_path / "ferry" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert convert.models_dir() == tmp_path / ".cache" / "ferry" / "models"
    with pytest.raises(
        ValueError, match=r"model: expected one of \['smollm2-135m'\] or a .gguf path, got 'gpt-5'"
    ):
        convert.find_gguf("gpt-5")


def test_the_command_names_what_went_wrong(tiny_gguf, tmp_path, capsys):
    _, gguf_path, _ = tiny_gguf
    convert.main([str(gguf_path), "--out", str(tmp_path / "model")])
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "model")
    with pytest.raises(SystemExit, match="convert: model: expected one of \\['smollm2-135m'\\]"):
        convert.main(["gpt-5"])
    (tmp_path / "mine").mkdir()
    with pytest.raises(SystemExit, match="was not written by this converter"):
        convert.main([str(gguf_path), "--out", str(tmp_path / "mine")])
