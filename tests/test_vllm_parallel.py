"""The connector's parallel engines without vLLM: which tensor-, pipeline- and data-parallel sizes it
takes (refused by name, never as a layout error), and the link a rank plans with (`prior_link`: its own,
or its share of the host's, which the ranks on one host load over at once)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvrestore.core.errors import UnsupportedModelError
from kvrestore.core.spec import ModelSpec
from kvrestore.integrations.vllm.config import ConnectorConfig, ConnectorContext, parallel_sizes

SPEC = ModelSpec("tiny", 4, 2, 8, 100, torch.float32, fingerprint="ab" * 16)  # 4 layers, 2 KV heads


def engine(tp: int = 1, pp: int = 1, dp: int = 1, nnodes: int = 1) -> SimpleNamespace:
    """vLLM's parallel config, as far as the connector reads it."""
    return SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, nnodes=nnodes
    )


@pytest.mark.parametrize(
    ("tp", "pp", "nnodes", "want"),
    [
        (1, 1, 1, (1, 1, 1)),
        (2, 1, 1, (2, 1, 2)),
        (4, 1, 1, (4, 1, 4)),  # 2 KV heads over 4 ranks: each replicated on two
        (1, 2, 1, (1, 2, 2)),
        (2, 2, 2, (2, 2, 2)),  # 4 ranks on 2 hosts: 2 a host
    ],
)
def test_the_sizes_the_connector_takes(tp, pp, nnodes, want):
    assert parallel_sizes(engine(tp, pp, nnodes=nnodes), SPEC) == want


@pytest.mark.parametrize(
    ("config", "names"),
    [
        (engine(dp=2), "data_parallel_size=2"),
        (engine(tp=3), "tensor_parallel_size=3"),  # 3 ranks do not split 2 KV heads
        (engine(pp=5), "pipeline_parallel_size=5"),  # 5 stages for 4 layers
    ],
)
def test_what_it_does_not_take_is_refused_by_name(config, names):
    with pytest.raises(UnsupportedModelError, match=names):
        parallel_sizes(config, SPEC)


def context(host_ranks: int = 1, tp: int = 1, **extra) -> ConnectorContext:
    config = ConnectorConfig.from_extra({"store_url": "/tmp/kv", **extra})
    return ConnectorContext(config, SPEC, 16, None, tp=tp, host_ranks=host_ranks)  # type: ignore[arg-type]


def test_a_rank_plans_with_the_smaller_of_its_link_and_its_share_of_the_hosts():
    assert context(2, link_bytes_per_s=80e6).prior_link().bytes_per_s == 80e6
    assert context(2, host_link_bytes_per_s=100e6).prior_link().bytes_per_s == 50e6
    assert context(2, link_bytes_per_s=80e6, host_link_bytes_per_s=100e6).prior_link().bytes_per_s == 50e6
    assert context(2, link_bytes_per_s=40e6, host_link_bytes_per_s=100e6).prior_link().bytes_per_s == 40e6
    assert context(2).prior_link() is None


def test_ranks_sharing_a_host_link_load_in_the_time_one_rank_would():
    """tp 2 reads half of each chunk a rank, at half the host's link a rank: the same seconds a token as
    tp 1 reading whole chunks over the whole link (and the split is planned from that)."""
    host = {"host_link_bytes_per_s": 100e6}
    one, two = context(1, tp=1, **host), context(2, tp=2, **host)
    assert two.stored_bytes_per_token == pytest.approx(one.stored_bytes_per_token / 2)
    per_token = [c.stored_bytes_per_token / c.prior_link().bytes_per_s for c in (one, two)]
    assert per_token[1] == pytest.approx(per_token[0])


def test_what_is_learned_of_the_link_is_kept_apart_for_each_number_of_ranks_on_a_host():
    assert context(1).link_key == "/tmp/kv"
    assert context(2).link_key != context(1).link_key != context(4).link_key != context(2).link_key
