"""Integrations of kvrestore into serving engines (`integrations.vllm`: a vLLM KV connector)."""
