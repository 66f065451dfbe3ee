"""Serve token-id prompts with a dummy-weight Llama on vLLM in this process; print JSON (tests_vllm/test_gpu.py).

    python tests_vllm/gpu_serve.py SPEC_JSON

SPEC: model (a directory with a config.json), fingerprint, tokens (the prompt's ids), max_tokens,
eager, extra (kvrestore's `kv_connector_extra_config`, or null for vLLM alone), dump (a path: save the
pages of the tokens the connector loaded, gathered back as ``[L, 2, H, T, D]``, with `torch.save`).
Prints ``{"ids": [...], "logprobs": [...], "records": [...]}``.
"""

from __future__ import annotations

import json
import os
import sys

# the GPU host's vLLM bundle leaves FlashInfer out (GPU.md), which vLLM's sampler imports unless told not
# to use it
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
# the engine in this process: the connector's records and its worker's pages are read from here (on a
# GPU vLLM otherwise runs its engine core in a process of its own)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if spec["extra"] is not None:
        kv = KVTransferConfig(
            kv_connector="KVRestoreConnector",
            kv_connector_module_path="kvrestore.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={**spec["extra"], "fingerprint": spec["fingerprint"]},
        )
    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=len(spec["tokens"]) + spec["max_tokens"] + 16,
        enable_prefix_caching=False,
        enforce_eager=spec["eager"],
        gpu_memory_utilization=0.3,
        kv_transfer_config=kv,
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=1, detokenize=False)
    out = llm.generate({"prompt_token_ids": spec["tokens"]}, params, use_tqdm=False)[0].outputs[0]
    logprobs = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs or [], strict=False)]
    records: list[dict] = []
    if kv is not None:
        from kvrestore.chunkio.pages import gather
        from kvrestore.integrations.vllm import connector

        connector.flush_saves()
        records = connector.records()
        loaded = [r for r in records if r["event"] == "loaded"]
        if spec.get("dump") and loaded:
            (worker,) = list(connector._WORKERS)
            views = list(zip(worker.paged.k, worker.paged.v, strict=True))
            pages = gather(views, loaded[0]["blocks"], 0, loaded[0]["tokens"])
            torch.save(pages.cpu(), spec["dump"])
    print(json.dumps({"ids": list(out.token_ids), "logprobs": logprobs, "records": records}), flush=True)


if __name__ == "__main__":
    main()
