"""Serve prompts with a real vLLM engine in this process; print one JSON line per prompt.

    python tests_vllm/serve.py --model DIR --tokens 2000 [--connector kvrestore|example|none]
        [--extra '{"store_url": "..."}'] [--max-tokens 8] [--offsets 0 3000]
        [--lora ADAPTER_DIR --requests '[{"offset": 0, "salt": "a", "lora": true}, ...]']

Each prompt is `--tokens` ids of kvrestore's reference text (starting `--offsets` ids in), served with
greedy sampling; the output has the generated ids, their logprobs and the time to the first token
(a generate call of one token, measured before the full one, when `--ttft` is given). Last, one line
``{"records": [...], "metrics": {...}}``: the connector's records (`integrations.vllm.stats.records`) and, with
`--metrics`, the ``vllm:kvrestore_*`` counters vLLM exported. `--requests` serves the listed prompts
instead, each with its `cache_salt` and under the LoRA adapter `--lora` (vLLM started with LoRA on)
where `lora` is true; each line then also has the request's `request_id`, `salt` and `lora`. Used by the vLLM test tier and
`benchmarks/vllm_connector.py` as "a new process".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def prompt_ids(tokenizer, n_tokens: int, offset: int = 0) -> list[int]:
    """`n_tokens` ids of the reference text, `offset` ids in: the prompts every vLLM test serves."""
    from kvrestore.tools.text import reference_tokens

    return reference_tokens(tokenizer, offset + n_tokens)[offset:]


def engine(model: str, connector: str, extra: dict, **options: Any) -> Any:
    """vLLM's engine as every case here runs it (eager, fp32, no prefix cache unless `options` turn it
    on), with `connector`'s KV transfer ("kvrestore" or "example"; none for any other) and `options`
    (LLM's)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    names = {
        "kvrestore": {
            "kv_connector": "KVRestoreConnector",
            "kv_connector_module_path": "kvrestore.integrations.vllm",
        },
        "example": {"kv_connector": "ExampleConnector"},
    }
    kv = None
    if connector in names:
        kv = KVTransferConfig(**names[connector], kv_role="kv_both", kv_connector_extra_config=extra)
    return LLM(
        model=model,
        max_model_len=4096,
        enforce_eager=True,
        dtype="float32",
        kv_transfer_config=kv,
        **{"enable_prefix_caching": False, **options},
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000])
    ap.add_argument("--offsets", type=int, nargs="+", default=[0])
    ap.add_argument("--connector", choices=("kvrestore", "example", "none"), default="kvrestore")
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--ttft", action="store_true", help="time a one-token generate (the TTFT) only")
    ap.add_argument("--repeat", type=int, default=1, help="serve each prompt this many times")
    ap.add_argument(
        "--warmup", action="store_true", help="serve a short unrelated prompt first (not reported)"
    )
    ap.add_argument(
        "--exit", action="store_true", help="exit right after serving, without shutting vLLM down"
    )
    ap.add_argument(
        "--metrics", action="store_true", help="turn vLLM's stats on; print its kvrestore counters"
    )
    ap.add_argument(
        "--together", action="store_true", help="ask every prompt at once (one generate), not one by one"
    )
    ap.add_argument(
        "--step-tokens", type=int, default=None, help="vLLM's token budget per step, prompts cut across steps"
    )
    ap.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size")
    ap.add_argument("--pp", type=int, default=1, help="vLLM's pipeline_parallel_size")
    ap.add_argument("--lora", default=None, help="a LoRA adapter directory: vLLM serves with LoRA on")
    ap.add_argument(
        "--prefix-caching", action="store_true", help="vLLM's own prefix cache on (off by default)"
    )
    ap.add_argument(
        "--requests", default=None, help='JSON list of {"offset", "salt", "lora"}: the prompts to serve'
    )
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s", stream=sys.stderr)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    t0 = time.perf_counter()
    lora_options = {"enable_lora": True, "max_lora_rank": 16} if args.lora else {}
    options = {"disable_log_stats": not args.metrics, **lora_options}
    if args.prefix_caching:
        options["enable_prefix_caching"] = True
    if args.tp > 1 or args.pp > 1:
        options |= {"tensor_parallel_size": args.tp, "pipeline_parallel_size": args.pp}
    if args.step_tokens is not None:
        options |= {"max_num_batched_tokens": args.step_tokens, "enable_chunked_prefill": True}
    llm = engine(args.model, args.connector, json.loads(args.extra), **options)
    print(json.dumps({"event": "ready", "seconds": time.perf_counter() - t0}), flush=True)
    tok = AutoTokenizer.from_pretrained(args.model)
    if args.warmup:  # vLLM's first request in a process pays a few seconds of one-time set-up
        llm.generate(
            {"prompt_token_ids": prompt_ids(tok, 32, 20000)}, SamplingParams(max_tokens=1), use_tqdm=False
        )
    if args.requests:
        asked = [
            (n, r["offset"], r.get("salt"), bool(r.get("lora")))
            for n in args.tokens
            for r in json.loads(args.requests)
        ]
    else:
        asked = [(n, o, None, False) for n in args.tokens for o in args.offsets]
    adapter = None
    if args.lora:
        from vllm.lora.request import LoRARequest

        adapter = LoRARequest("adapter", 1, args.lora)
    params = SamplingParams(temperature=0.0, max_tokens=1 if args.ttft else args.max_tokens, logprobs=1)
    prompts = []
    for n, offset, salt, _ in asked:
        prompt = {"prompt_token_ids": prompt_ids(tok, n, offset)}
        if salt is not None:
            prompt["cache_salt"] = salt
        prompts.append(prompt)
    # one generate per prompt, or one for all (--together: vLLM schedules them in the same steps)
    groups = [list(range(len(asked)))] if args.together else [[i] for i in range(len(asked))]
    for group in groups:
        for _ in range(args.repeat):
            loras = [adapter if asked[i][3] else None for i in group]
            t = time.perf_counter()
            outputs = llm.generate(
                [prompts[i] for i in group],
                params,
                use_tqdm=False,
                lora_request=(loras if any(loras) else None) if args.together else loras[0],
            )
            seconds = time.perf_counter() - t
            for i, done in zip(group, outputs, strict=True):
                n, offset, salt, lora = asked[i]
                out = done.outputs[0]
                logprobs = [
                    lp[t_id].logprob for t_id, lp in zip(out.token_ids, out.logprobs or [], strict=False)
                ]
                row = {"tokens": n, "offset": offset, "seconds": seconds, "ids": list(out.token_ids)}
                row |= {"logprobs": logprobs, "request_id": done.request_id, "salt": salt, "lora": lora}
                print(json.dumps(row), flush=True)
    # let background writes finish before the process exits (--exit: as a script that just ends does)
    shutdown = getattr(llm.llm_engine, "shutdown", None)
    if shutdown is not None and not args.exit:
        shutdown()
    metrics = {}
    if args.metrics:
        llm.llm_engine.do_log_stats()  # the last interval's stats reach the counters
        for m in llm.get_metrics():
            if m.name.startswith("vllm:kvrestore_"):
                metrics[m.name.removeprefix("vllm:kvrestore_")] = getattr(m, "value", None)
    records = []
    if args.connector == "kvrestore":
        from kvrestore.integrations.vllm.stats import records as kept

        records = kept()
    print(json.dumps({"records": records, "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
