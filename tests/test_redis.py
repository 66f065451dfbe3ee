"""What only Redis has: URLs with a db and a prefix, passwords, TLS, kvrestore's own capacity over a
SCAN, event loops, and a Redis Cluster (one node owning every slot: the cluster protocol, redirects and
all, against a real `redis-server --cluster-enabled yes`)."""

from __future__ import annotations

import shutil
import subprocess
from functools import partial

import anyio
import anyio.from_thread
import pytest

from kvrestore import open_store
from kvrestore.core.errors import StoreError
from kvrestore.stores import BoundedStore

from .redis_server import RedisServer
from .s3_server import free_port
from .test_stores import K1, K3, evict_under_capacity
from .test_stores import test_contract as check_contract

pytest.importorskip("redis")  # the kvrestore[redis] extra


def run(fn, *args):
    return anyio.run(partial(fn, *args))


async def put_get(store, key=K1, data=b"hello"):
    """Write, then read back both ways (`get`; `read_into`, over the store's own connections)."""
    async with store:
        await store.put(key, data)
        buf = bytearray(64)
        size = await store.read_into(key, memoryview(buf))
        got = await store.get(key)
        assert size == len(data) and bytes(buf[:size]) == got
        return got


def test_objects_live_under_the_db_and_prefix(redis_server):
    store = open_store(f"{redis_server.url.rsplit('/', 1)[0]}/3/team/model-a")
    assert store.db == 3 and store.prefix == "team/model-a"
    assert run(put_get, store) == b"hello"
    client = redis_server.client()
    client.select(3)
    assert client.keys("team/model-a/*") == [f"team/model-a/{K1}".encode()]
    assert client.get(f"team/model-a/{K1}") == b"hello"
    client.delete(f"team/model-a/{K1}")


def test_the_default_prefix(redis_server):
    store = open_store(f"redis://127.0.0.1:{redis_server.port}")
    assert (
        store.db == 0
        and store.prefix == "kvrestore"
        and store.name.endswith(f":{redis_server.port}/0/kvrestore")
    )


def test_password_in_the_url_or_as_a_keyword_and_a_wrong_one_is_a_store_error():
    with RedisServer(password="s3cret!") as server:
        base = f"127.0.0.1:{server.port}/0"
        assert run(put_get, open_store(f"redis://:s3cret%21@{base}")) == b"hello"
        assert run(put_get, open_store(f"redis://{base}", password="s3cret!")) == b"hello"
        assert "s3cret" not in repr(open_store(f"redis://:s3cret%21@{base}"))
        for store in (open_store(f"redis://{base}", password="wrong"), open_store(f"redis://{base}")):
            with pytest.raises(StoreError, match="(?i)auth|password"):
                run(put_get, store)


def test_tls(tmp_path):
    """`rediss://` against a server that speaks TLS only, its certificate trusted through `ssl_ca_certs`."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    server = RedisServer(
        tls_cert_file=str(cert), tls_key_file=str(key), tls_ca_cert_file=str(cert), tls_auth_clients="no"
    )
    port = server.port
    server.extra["port"] = "0"  # no plain TCP: TLS on the same port number
    server.extra["tls_port"] = str(port)
    with server:
        good = open_store(f"rediss://127.0.0.1:{port}/0", ssl_ca_certs=str(cert))
        assert good.tls and run(put_get, good) == b"hello"


def test_capacity_is_kvrestores_own_where_asked_and_rebuilt_from_a_scan(redis_url):
    store = open_store(redis_url, capacity_bytes=250)
    assert isinstance(store, BoundedStore)

    assert evict_under_capacity(store) == [True, False, True]
    assert store.bytes_used == 200 and store.evictions == 1

    async def scan():
        async with open_store(redis_url) as plain:
            return {o.key: o.size for o in await plain.scan()}

    assert run(scan) == {K1: 100, K3: 100}


def test_a_store_survives_a_new_event_loop(redis_url):
    """redis-py binds connections to their loop: a second anyio.run, or a portal thread, makes new ones."""
    store = open_store(redis_url)

    async def put(data):
        await store.put(K1, data)
        return await store.get(K1)

    assert run(put, b"one") == b"one"
    assert run(put, b"two") == b"two"
    with anyio.from_thread.start_blocking_portal() as portal:
        assert portal.call(put, b"three") == b"three"
        portal.call(store.close)


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free too."""
    import socket

    for _ in range(1000):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@pytest.fixture(scope="module")
def cluster_node():
    """One `redis-server --cluster-enabled yes` that owns all 16384 slots: a whole cluster."""
    server = RedisServer(cluster_port(), cluster_enabled="yes", cluster_config_file="nodes.conf")
    with server:
        client = server.client()
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        for _ in range(200):  # the node takes the slots over within a few cluster ticks
            if client.execute_command("CLUSTER", "INFO").decode().find("cluster_state:ok") >= 0:
                break
            anyio.run(anyio.sleep, 0.05)
        yield server


def test_redis_cluster_contract(cluster_node):
    store = open_store(f"redis+cluster://127.0.0.1:{cluster_node.port}/c")
    assert store.cluster
    check_contract(store)


def test_a_server_that_never_answers_is_bounded_by_the_deadline():
    """A socket that accepts and never answers: a chunk read past its deadline is a StoreTimeoutError,
    the store is then left alone, and the caller's buffer never sees a byte (the abandoned read goes on
    into a buffer of the store's own)."""
    import socket

    from kvrestore.core.errors import StoreTimeoutError
    from kvrestore.stores.deadline import Deadlines, DeadlineStore

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    store = open_store(f"redis://127.0.0.1:{port}/0", socket_timeout=60)
    bounded = DeadlineStore(store, Deadlines(lookup_s=0.3, load_s=0.3))
    buf = bytearray(100)

    async def body():
        with pytest.raises(StoreTimeoutError):
            await bounded.read_into(K1, memoryview(buf))
        with pytest.raises(StoreTimeoutError, match="timed out recently"):
            await bounded.contains([K1])
        await store.close()

    try:
        run(body)
    finally:
        listener.close()  # the abandoned read's connection ends with the test
    assert bytes(buf) == bytes(100)
