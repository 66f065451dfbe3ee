"""Integrations of kvrestore into serving engines (`integrations.vllm`: a vLLM KV connector).

The vLLM-free parts (paged-layout conversion, split planning, background chunk I/O) live in
`vllm_layout`, `vllm_plan`, `vllm_io` and `vllm_load`, importable and tested without vLLM installed.
"""
