"""The core vocabulary every layer shares: model spec, chunk keys, KV containers, errors, traces."""
