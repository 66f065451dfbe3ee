"""A tiny random-weight Llama checkpoint for the parallel cases: 4 query heads, 2 KV heads, 4 layers.

`initializer_range` 0.1 keeps greedy tokens varied (a smaller one repeats one token). The tokenizer is
SmolLM2's (same vocabulary), copied from the checkpoint the other vLLM tests convert.

    python tests_vllm/tiny_llama.py DIR      # writes the checkpoint into DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_tiny_llama(
    out: Path,
    *,
    seed: int = 0,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
) -> Path:
    """Write the checkpoint (fp32 safetensors, config, tokenizer) into `out`; return `out`. The sizes
    default to the tests' model (head dim 64); benchmarks ask for a larger one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvrestore.backends.hf import smollm2_checkpoint

    source = Path(smollm2_checkpoint())
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


if __name__ == "__main__":
    save_tiny_llama(Path(sys.argv[1]))
