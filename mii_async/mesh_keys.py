"""The mesh's CURVE keys: who holds which key, where a deployment keeps them, and how a client finds them.

Every ZeroMQ socket of a deployment is authenticated and encrypted with CURVE, on loopback too: any local
process (another user, a container sharing the network namespace) can reach a loopback port, so a port is no
credential. A keys directory holds four key pairs, `NAME.key` (public) and `NAME.key_secret` (mode 600):

- `server`: the router's. Every peer must know its public key; its secret never leaves the router's host.
- `client`: may generate, ping and ask for health on the clients' port. Hand its pair (with `server.key`) to
  the users of a deployment; more client public keys may be added as `authorized/*.key`.
- `operator`: everything a client may, and the control messages (Shutdown, stats, cache reset). The gateway
  and the user who started the deployment hold it.
- `worker`: the only key the workers' port accepts (a worker that joins from another host needs it).

A deployment started without `curve_dir` makes a directory of its own at start (`deployment_keys_dir`, under
the user's runtime directory, mode 700), hands its path to its own processes (never a key on a command line),
links it by port (`by-port/PORT`) so that `mii_async.client("tcp://127.0.0.1:PORT")` run by the same user
finds it, and removes both at exit. A directory given as `curve_dir` is completed (missing pairs are made,
present ones never replaced) and linked the same way.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from .errors import InvalidParameterError
from .user_state import private_dir, process_alive

log = logging.getLogger("mii_async.mesh_keys")
ROLES = ("client", "operator", "worker")
PAIRS = ("server", *ROLES)
RUNTIME_DIR_ENV = "MII_ASYNC_RUNTIME_DIR"   # where deployments keep their keys (default: see runtime_root)
ALLOWED_ROLES = {"clients": frozenset({"client", "operator"}), "workers": frozenset({"worker"})}  # ZAP domains


@dataclass(frozen=True)
class Credentials:
    """What a connecting socket presents: the router's public key, and one role's key pair."""
    role: str
    server_public: bytes
    public: bytes
    secret: bytes


def runtime_root() -> str:
    """The per-user directory holding the keys of the deployments this user runs: $MII_ASYNC_RUNTIME_DIR, else
    $XDG_RUNTIME_DIR/mii_async (a per-user tmpfs), else ~/.cache/mii_async/run."""
    root = os.environ.get(RUNTIME_DIR_ENV)
    if not root:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        root = os.path.join(xdg, "mii_async") if xdg and os.path.isdir(xdg) else \
            os.path.join(os.path.expanduser("~"), ".cache", "mii_async", "run")
    return root


def ensure_keys(keys_dir: str) -> str:
    """Makes the pairs missing from `keys_dir` (never replacing one that is there) and returns its path."""
    import zmq.auth

    private_dir(keys_dir, "curve_dir")
    for name in PAIRS:
        public, secret = (os.path.join(keys_dir, name + ext) for ext in (".key", ".key_secret"))
        if os.path.exists(public) and os.path.exists(secret):
            continue
        if name == "server" and (os.path.exists(public) or os.path.exists(secret)):
            raise InvalidParameterError("curve_dir", f"{keys_dir} holds half of the server's key pair; "
                                        "restore the other file or make new keys with `mii-async keys --force`")
        zmq.auth.create_certificates(keys_dir, name)
        os.chmod(secret, 0o600)
    return keys_dir


def make_keys(keys_dir: str, force: bool = False) -> None:
    """`mii-async keys DIR`: every pair, fresh. Keys already there are kept (InvalidParameterError naming
    `dir`) unless `force`: new ones would lock out every worker and client that holds the old."""
    there = [n + ext for n in PAIRS for ext in (".key", ".key_secret") if os.path.exists(os.path.join(keys_dir, n + ext))]
    if there and not force:
        raise InvalidParameterError("dir", f"{keys_dir} already holds keys ({', '.join(there)}); new ones would "
                                    "lock out the workers and clients that use them (--force replaces them)")
    for name in there:
        os.remove(os.path.join(keys_dir, name))
    ensure_keys(keys_dir)


def _load(keys_dir: str, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    path = os.path.join(keys_dir, name + (".key_secret" if secret else ".key"))
    if not os.path.isfile(path):
        raise InvalidParameterError("curve_dir", f"{path} is missing; make the keys with `mii-async keys "
                                    f"{keys_dir}`, or copy that file from the deployment's keys directory")
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidParameterError("curve_dir", f"{path} is not a key file: {exc}") from None


def server_pair(keys_dir: str) -> tuple[bytes, bytes]:
    public, secret = _load(keys_dir, "server", secret=True)
    assert secret is not None
    return public, secret


def credentials(keys_dir: str, role: str) -> Credentials:
    """The credentials of `role` from `keys_dir`; role "client" takes the operator's pair where this user can
    read it (the user who started the deployment is its operator)."""
    if role == "client" and os.access(os.path.join(keys_dir, "operator.key_secret"), os.R_OK):
        role = "operator"
    server_public, _ = _load(keys_dir, "server", secret=False)
    public, secret = _load(keys_dir, role, secret=True)
    if secret is None:
        raise InvalidParameterError("curve_dir", f"{keys_dir}/{role}.key_secret holds no secret key")
    return Credentials(role, server_public, public, secret)


def roles_by_key(keys_dir: str) -> dict[bytes, str]:
    """z85 public key → role, for the router's authenticator: the three roles' keys, and `authorized/*.key`
    as clients."""
    import zmq.auth

    roles: dict[bytes, str] = {}
    extra = os.path.join(keys_dir, "authorized")
    if os.path.isdir(extra):
        roles.update({k: "client" for k in zmq.auth.load_certificates(extra)})
    for role in ROLES:
        public, _ = _load(keys_dir, role, secret=False)
        roles[public] = role
    return roles


# -- a deployment's own keys, found by port --------------------------------------------------------------
def deployment_keys_dir() -> str:
    """A fresh keys directory for a deployment started now, named for this process; directories of
    deployments whose process is gone are removed on the way."""
    root = private_dir(runtime_root(), "curve_dir")
    _clean_stale(root)
    path = os.path.join(root, f"deployment-{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)
    return ensure_keys(path)


def publish(keys_dir: str, ports: list[int]) -> None:
    """Links `keys_dir` as the keys of the deployment listening on each of `ports`."""
    by_port = private_dir(os.path.join(private_dir(runtime_root(), "curve_dir"), "by-port"), "curve_dir")
    for port in ports:
        link = os.path.join(by_port, str(port))
        tmp = f"{link}.{os.getpid()}"
        try:
            os.symlink(os.path.abspath(keys_dir), tmp)
            os.replace(tmp, link)
        except OSError as exc:
            log.warning("could not link the mesh keys for port %d: %s", port, exc)


def unpublish(keys_dir: str, ports: list[int], remove: bool) -> None:
    """Undoes `publish` (links that another deployment has since taken over are left), and with `remove`
    deletes the directory (a deployment's own)."""
    by_port = os.path.join(runtime_root(), "by-port")
    for port in ports:
        link = os.path.join(by_port, str(port))
        try:
            if os.readlink(link) == os.path.abspath(keys_dir):
                os.remove(link)
        except OSError:
            pass
    if remove:
        shutil.rmtree(keys_dir, ignore_errors=True)


def find_keys(address: str) -> str | None:
    """The keys directory of the deployment this user runs at `address` on this host, or None."""
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not port or not host or not _is_this_host(host):
        return None
    link = os.path.join(runtime_root(), "by-port", str(port))
    return link if os.path.isfile(os.path.join(link, "server.key")) else None


def _is_this_host(host: str) -> bool:
    if host in ("localhost", "0.0.0.0", "::", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _clean_stale(root: str) -> None:
    """Removes the keys of deployments whose process is gone (killed with -9 before it could clean up), and
    links to them."""
    for name in os.listdir(root):
        if not name.startswith("deployment-"):
            continue
        try:
            pid = int(name.removeprefix("deployment-"))
        except ValueError:
            continue
        if pid != os.getpid() and not process_alive(pid):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    by_port = os.path.join(root, "by-port")
    if os.path.isdir(by_port):
        for name in os.listdir(by_port):
            link = os.path.join(by_port, name)
            if os.path.islink(link) and not os.path.exists(link):
                os.remove(link)
