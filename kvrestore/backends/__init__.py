"""Model backends. `kvrestore.backends.hf.HFBackend` drives HuggingFace decoder models."""
