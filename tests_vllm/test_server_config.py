"""A vLLM OpenAI server with a connector configuration that cannot work does not come up: it exits with
an error (the connector's `KVRestoreError`, raised where vLLM first asks the connector, before vLLM
profiles and warms the model up) instead of serving without the connector or failing later."""

from __future__ import annotations

import pytest

from kvrestore.tools.vllm_server import ServerError, VLLMServer, kv_transfer


@pytest.fixture(scope="module")
def model_dir():
    from kvrestore.backends.hf import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.mark.parametrize(
    "extra",
    [
        {"store_url": "STORE", "chunk_sise": 128},  # a typo
        {"store_url": "memory://"},  # the server's scheduler and worker are two processes here
        {"store_url": "FILE/kv"},  # under a file: cannot be created
    ],
    ids=["unknown-key", "memory-across-processes", "unusable-directory"],
)
def test_a_server_with_a_bad_connector_config_does_not_start(model_dir, tmp_path, extra):
    (tmp_path / "file").write_text("a file, not a directory")
    extra = {
        k: v.replace("STORE", str(tmp_path / "kv")).replace("FILE", str(tmp_path / "file"))
        if isinstance(v, str)
        else v
        for k, v in extra.items()
    }
    server = VLLMServer(
        model_dir, kv_transfer=kv_transfer("KVRestoreConnector", extra), log_path=tmp_path / "log"
    )
    with pytest.raises(ServerError, match="exited"):
        server.start()
    assert server.proc is not None and server.proc.returncode != 0
    assert not server.healthy()
