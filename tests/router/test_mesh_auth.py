"""The authenticated mesh: every ZeroMQ port admits only peers holding the deployment's keys, each port only
its roles, and control messages only from the operator (mesh_keys.py). Real sockets on loopback, and a real
deployment attacked as a local process without (or with the wrong) credentials would."""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

import mii_async
from mii_async import protocol as P
from mii_async.mesh_keys import ensure_keys, find_keys
from mii_async.transport import DealerSocket, RouterSocket, start_authenticator
from tests.mesh_helpers import present_keys, until

FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


def _handshake(sock: zmq.Socket, address: str, send: bytes | None = None, timeout_s: float = 30.0) -> int:
    """Connects `sock` to `address` (sending `send`, if given) and returns the first handshake outcome its
    monitor reports: EVENT_HANDSHAKE_SUCCEEDED or a failure. The monitor is attached before connecting: a
    loopback handshake can be over before a later one would see it."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        sock.connect(address)
        if send is not None:
            sock.send(send)
        assert mon.poll(int(timeout_s * 1000)), "no handshake outcome"
        return recv_monitor_message(mon)["event"]
    finally:
        sock.disable_monitor()
        mon.close(linger=0)


def _raw(ctx: zmq.Context, address: str, keys_dir: str | None, role: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir is not None:
        present_keys(sock, keys_dir, role)
    return sock


def _client_only(keys_dir: str, dest) -> str:
    """What a deployment's user is handed: the server's public key and the client pair, nothing else."""
    os.makedirs(dest, mode=0o700)
    for name in ("server.key", "client.key", "client.key_secret"):
        shutil.copy(os.path.join(keys_dir, name), dest)
    return str(dest)


def test_each_socket_admits_its_roles_and_stamps_them(tmp_path):
    """The clients' socket admits client and operator keys and tells them apart; a worker's key, an unknown
    key and a peer without CURVE are refused at the handshake. The workers' socket admits the worker key only."""
    keys = ensure_keys(str(tmp_path / "keys"))
    stranger = ensure_keys(str(tmp_path / "stranger"))          # well-formed keys of another deployment
    client_dir = _client_only(keys, tmp_path / "handed")

    async def main():
        ctx = zmq.asyncio.Context()
        auth = start_authenticator(ctx, keys)
        clients = RouterSocket(ctx, "tcp://127.0.0.1:*", keys, "clients")
        workers = RouterSocket(ctx, "tcp://127.0.0.1:*", keys, "workers")
        dealers = []
        try:
            for curve_dir, want in ((client_dir, "client"), (keys, "operator")):
                d = DealerSocket(ctx, clients.address, curve_dir=curve_dir)
                dealers.append(d)
                await d.send(P.Query(req_id=want, what="ping"))
                got = await asyncio.wait_for(clients.recv(), 30)
                assert (got.message.req_id, got.role) == (want, want)
            sync = zmq.Context()
            try:
                cases = [(clients.address, keys, "worker"), (clients.address, stranger, "client"),
                         (clients.address, None, ""), (workers.address, keys, "client"),
                         (workers.address, keys, "operator"), (workers.address, None, "")]
                for address, curve_dir, role in cases:
                    s = _raw(sync, address, curve_dir, role)
                    try:
                        event = await asyncio.get_running_loop().run_in_executor(None, _handshake, s, address)
                        assert event in FAILED, (address, role, event)
                    finally:
                        s.close()
                w = _raw(sync, workers.address, keys, "worker")
                try:
                    w.connect(workers.address)
                    w.send(P.encode(P.Heartbeat(replica=0, stats={})))
                    got = await asyncio.wait_for(workers.recv(), 30)
                    assert got.role == "worker" and isinstance(got.message, P.Heartbeat)
                finally:
                    w.close()
            finally:
                sync.term()
        finally:
            for d in dealers:
                d.close()
            clients.close(), workers.close()
            auth.stop()
            ctx.term()

    asyncio.run(main())


def test_a_deployment_refuses_what_its_keys_do_not_allow(deployment, tmp_path):
    """Against a real deployment (keys made at start, found by this user's clients by port): a local process
    without its keys can neither generate, nor stop it, nor join as a worker; one holding the client key
    generates but may not stop it, read its stats or reset its cache; the deployment serves throughout."""
    client = deployment
    health = client.run(client.health())
    assert find_keys(client.address) is not None and client.curve_dir is not None
    ctx = zmq.Context()
    try:
        for address, msg in ((client.address, P.Shutdown(drain_s=0.0, req_id="x")),
                             (client.address, P.Generate(req_id="g", prompt="hi")),
                             (health["worker_address"].replace("0.0.0.0", "127.0.0.1"),
                              P.Hello(worker="rogue", replica=-1, rank=0, pid=os.getpid(), host="h"))):
            s = _raw(ctx, address, None, "")
            try:
                assert _handshake(s, address, P.encode(msg)) in FAILED
            finally:
                s.close()
        address = health["worker_address"].replace("0.0.0.0", "127.0.0.1")
        s = _raw(ctx, address, client.curve_dir, "client")
        try:
            assert _handshake(s, address) in FAILED    # a client's key cannot join as a worker
        finally:
            s.close()
    finally:
        ctx.term()
    user = mii_async.client(client.address, curve_dir=_client_only(client.curve_dir, tmp_path / "user"))
    try:
        [r] = user.generate(["Hello"], max_new_tokens=3)
        assert r.generated_text
        for call in (lambda: user.terminate_server(0.0), user.stats, user.reset_prefix_cache):
            with pytest.raises(mii_async.PermissionDeniedError, match="operator"):
                call()
        assert user.run(user.health())["state"] == "ready"
    finally:
        user.close()
    after = client.run(client.health())
    assert after["state"] == "ready" and after["refused_control"] >= health["refused_control"] + 3
    assert client.run(client.stats())["num_blocks"] > 0          # the operator (this user) may


def test_another_users_client_finds_no_keys_and_is_refused(deployment, tmp_path):
    """A client run with another runtime directory (as another user would be) finds no keys for the address
    and cannot generate; the same user's client finds them by port."""
    script = ("import mii_async, sys\n"
              "c = mii_async.client(sys.argv[1], timeout_s=3.0)\n"
              "try:\n"
              "    c.generate(['hi'], max_new_tokens=2)\n"
              "except mii_async.UnavailableError:\n"
              "    print('refused')\n"
              "else:\n"
              "    print('served')\n")
    env = {**os.environ, "MII_ASYNC_RUNTIME_DIR": str(tmp_path / "other-user"), "XDG_RUNTIME_DIR": ""}
    out = subprocess.run([sys.executable, "-c", script, deployment.address], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "refused", out.stderr
    same = subprocess.run([sys.executable, "-c", script, deployment.address], capture_output=True, text=True,
                          timeout=120)
    assert same.stdout.strip() == "served", same.stderr


def test_keys_are_private_and_removed_with_the_deployment(default_model_dir):
    """A deployment's own keys directory is mode 700 with secrets mode 600, and is gone (with its port
    links) once the deployment has stopped."""
    c = mii_async.serve(str(default_model_dir), kv_cache_memory=0.05)
    keys = c.curve_dir
    try:
        assert os.stat(keys).st_mode & 0o777 == 0o700
        for name in os.listdir(keys):
            if name.endswith("_secret"):
                assert os.stat(os.path.join(keys, name)).st_mode & 0o777 == 0o600
        assert find_keys(c.address) is not None
    finally:
        c.terminate_server_sync(drain_s=0)
    assert not os.path.exists(keys) and find_keys(c.address) is None


@pytest.fixture(scope="module")
def own_deployment(default_model_dir):
    """A deployment of this module's own: the garbage test adds failed replicas to its health."""
    from tests.mesh_helpers import deployment_pids, wait_gone

    c = mii_async.serve(str(default_model_dir), kv_cache_memory=0.05)
    pids = [c._process.pid] + deployment_pids(c.run(c.health()))
    yield c
    c.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"


def test_a_worker_sending_garbage_fails_its_replica_only(own_deployment):
    """A worker (holding the worker key) that sends a frame that does not decode, or counters that are not
    numbers, is failed and counted; the router and the real replica serve on."""
    client = own_deployment
    before = client.run(client.health())
    address = before["worker_address"].replace("0.0.0.0", "127.0.0.1")
    ctx = zmq.Context()
    try:
        for n, frame in enumerate((b"\xc1 not msgpack",
                                   P.encode(P.Heartbeat(replica=0, stats={"running": "lots"})))):
            name = f"{socket.gethostname()}:{os.getpid()}:garbage-{n}"
            s = _raw(ctx, address, client.curve_dir, "worker")
            try:
                s.setsockopt(zmq.IDENTITY, name.encode())
                s.connect(address)
                s.send(P.encode(P.Hello(worker=name, replica=-1, rank=0, pid=os.getpid(),
                                        host=socket.gethostname())))
                assert s.poll(30_000)
                assign = P.decode(s.recv())
                assert isinstance(assign, P.Assign)
                s.send(frame)
                while True:                                  # told to stop (heartbeat echoes may come first)
                    assert s.poll(30_000), "the garbage-sending worker was not told to stop"
                    if isinstance(P.decode(s.recv()), P.Shutdown):
                        break
            finally:
                s.close()

            async def failed(replica=assign.replica):
                h = await client.health()
                return all(r["replica"] != replica or r["state"] != "starting" for r in h["replicas"])
            client.run(until(failed, 30, "the garbage worker's replica to be failed"))
    finally:
        ctx.term()
    after = client.run(client.health())
    assert after["bad_worker_messages"] >= before["bad_worker_messages"] + 2
    assert any(r["state"] == "ready" for r in after["replicas"])
    [r] = client.generate(["Hello"], max_new_tokens=2)
    assert r.generated_text is not None
