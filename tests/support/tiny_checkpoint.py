"""Write a tiny random Llama checkpoint with a real tokenizer, for fast tests.

    python -m tests.support.tiny_checkpoint DIR [--untied] [--rope-scaling linear|llama3] [--seed N]
        [--layers N] [--context N]

The directory is what transformers writes for ``LlamaForCausalLM`` (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with a ChatML template), so transformers loads it too and serves as the oracle. The network is
small (hidden 64, 4 heads sharing 2 KV heads, head dim 16) and its weights are drawn wide
enough that greedy choices are clear-cut, not near-ties that float rounding could flip. The
tokenizer is a byte-level BPE trained in-process on a fixed text: the same ids every time,
well under a second.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROPE_SCALINGS = {
    # Small original contexts, so that the scaling bends frequencies the tests' positions reach.
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}
TEXT = """\
A ferry crosses the river every morning before the fog lifts. The pilot counts the cars, the
bicycles and the people on foot, and when the deck is full she sounds the horn twice. Nobody
waits for the last passenger: the next crossing leaves in twenty minutes, and the one after
that in twenty more. In winter the river is slow and grey; in spring it carries whole trees
down from the hills, and the pilot steers around them with a patience learned over 1,024
crossings. Tickets cost 3 coins for a walker, 7 for a cart and 12 for a truck with a trailer.
What is the capital of France? Paris, said the boy, and the pilot laughed and asked him the
capital of the river instead. The river has no capital, he said, only banks and bridges.
"""


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXT.splitlines(), trainer=trainer)
    return tokenizer


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    tied: bool = True,
    rope_scaling: str | None = None,
    seed: int = 0,
    num_layers: int = 2,
    context: int = 256,
) -> Path:
    """Write the checkpoint into ``out_dir`` (created if missing) and return its path;
    ``context`` is its ``max_position_embeddings`` (the engine's ``max_model_len``)."""
    if rope_scaling is not None and rope_scaling not in ROPE_SCALINGS:
        raise ValueError(
            f"rope_scaling: expected one of {sorted(ROPE_SCALINGS)} or None, got {rope_scaling!r}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    vocab, hidden, ffn, heads, kv_heads, head_dim = tokenizer.get_vocab_size(), 64, 128, 4, 2, 16
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": ROPE_SCALINGS.get(rope_scaling),
        "tie_word_embeddings": tied,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm() -> torch.Tensor:
        return 1.0 + normal(hidden, std=0.1)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0), "model.norm.weight": norm()}
    if not tied:
        tensors["lm_head.weight"] = normal(vocab, hidden, std=0.4)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (heads * head_dim, hidden),
            "self_attn.k_proj": (kv_heads * head_dim, hidden),
            "self_attn.v_proj": (kv_heads * head_dim, hidden),
            "self_attn.o_proj": (hidden, heads * head_dim),
            "mlp.gate_proj": (ffn, hidden),
            "mlp.up_proj": (ffn, hidden),
            "mlp.down_proj": (hidden, ffn),
        }
        for name, (rows, cols) in shapes.items():
            tensors[f"{prefix}{name}.weight"] = normal(rows, cols, std=cols**-0.5)
        tensors[prefix + "input_layernorm.weight"] = norm()
        tensors[prefix + "post_attention_layernorm.weight"] = norm()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "chat_template": CHAT_TEMPLATE,
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation_config = {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0}
    for name, content in (
        ("config.json", config),
        ("generation_config.json", generation_config),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--untied", action="store_true", help="a separate lm_head (default: tied)")
    parser.add_argument("--rope-scaling", choices=sorted(ROPE_SCALINGS), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=256, help="max_position_embeddings")
    args = parser.parse_args(argv)
    out = write_tiny_checkpoint(
        args.out_dir,
        tied=not args.untied,
        rope_scaling=args.rope_scaling,
        seed=args.seed,
        num_layers=args.layers,
        context=args.context,
    )
    print(out)


if __name__ == "__main__":
    main()
