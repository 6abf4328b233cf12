"""Several hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

Each host is a namespace with one veth end (``eth0`` inside) and an address that exists
only there; the other end of every pair is a port of a bridge in the root namespace,
which holds the network's last address, so the test process itself reaches every host.
Names carry a random tag, so runs side by side do not meet, and the /24 is one no route
of the root namespace covers yet (chosen under a lock file, as networks may be built side
by side). ``close`` kills the processes started in the hosts and removes the bridge, the
veth pairs and the namespaces, whatever state they are in.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import secrets
import shutil
import subprocess
import time

SUBNET_PREFIX = "10.77"  # 10.77.<n>.0/24, n chosen free per run
SUBNET_LOCK = "/run/lock/tandem-netns.lock"  # held from choosing a /24 until its route exists


@contextlib.contextmanager
def _subnet_lock():
    """Networks built side by side (tests in two pytest workers) choose their /24 one at a time."""
    os.makedirs(os.path.dirname(SUBNET_LOCK), exist_ok=True)
    with open(SUBNET_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (apt-get install -y iproute2)"
    probe, veth = f"tandem-probe-{secrets.token_hex(3)}", f"tnp{secrets.token_hex(3)}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        pair = _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p", check=False)
        if pair.returncode != 0:
            return f"cannot make a veth pair: {pair.stderr.strip()}"
        moved = _ip("link", "set", f"{veth}p", "netns", probe, check=False)
        if moved.returncode != 0:
            return f"cannot move a veth end into a namespace: {moved.stderr.strip()}"
        return None
    finally:
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", probe, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    taken = []
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unicast", "multicast", "anycast", "blackhole",
                                  "unreachable", "prohibit", "throw"):
            words = words[1:]
        try:
            taken.append(ipaddress.ip_network(words[0], strict=False))
        except (IndexError, ValueError):
            continue  # default, or not an address
    candidates = list(range(256))
    start = secrets.randbelow(256)
    for n in candidates[start:] + candidates[:start]:
        net = ipaddress.ip_network(f"{SUBNET_PREFIX}.{n}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"no free /24 under {SUBNET_PREFIX}.0.0/16")


class Network:
    """Hosts by name (``hosts[name]`` -> its address); ``popen(name, argv)`` runs a process there."""

    def __init__(self, names: list[str]):
        self.tag = secrets.token_hex(3)
        self.bridge = f"tnb{self.tag}"  # interface names: at most 15 characters
        self.namespaces: dict[str, str] = {}  # host -> namespace
        self.veths: dict[str, str] = {}  # host -> the veth end on the bridge
        self.hosts: dict[str, str] = {}  # host -> address
        self.procs: list[subprocess.Popen] = []
        self.infra: list[subprocess.Popen] = []  # stopped after self.procs
        try:
            with _subnet_lock():
                net = _free_subnet()
                addresses = list(net.hosts())
                self.gateway_address = str(addresses[-1])
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("addr", "add", f"{self.gateway_address}/{net.prefixlen}", "dev", self.bridge)
                _ip("link", "set", self.bridge, "up")  # its route exists from here
            for i, name in enumerate(names):
                ns, veth = f"tandem-{self.tag}-{name}", f"tn{self.tag}{i}"
                _ip("netns", "add", ns)
                self.namespaces[name] = ns
                _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                self.veths[name] = veth
                _ip("link", "set", f"{veth}p", "netns", ns)
                _ip("-n", ns, "link", "set", f"{veth}p", "name", "eth0")
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                self.hosts[name] = str(addresses[i])
                _ip("-n", ns, "addr", "add", f"{addresses[i]}/{net.prefixlen}", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def popen(self, name: str, argv: list[str], stop_last: bool = False, **kwargs) -> subprocess.Popen:
        """``ip netns exec`` execs the command, so the Popen's pid is the process itself.
        ``stop_last``: what the others need while they stop (Redis), stopped after them."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[name], *argv], **kwargs)
        (self.infra if stop_last else self.procs).append(proc)
        return proc

    def link_down(self, name: str) -> None:
        """Cut the host off: its own end of the pair goes down (as a pulled cable or a dead NIC)."""
        _ip("-n", self.namespaces[name], "link", "set", "eth0", "down")

    def link_up(self, name: str) -> None:
        _ip("-n", self.namespaces[name], "link", "set", "eth0", "up")

    def close(self) -> None:
        _stop(self.procs)
        _stop(self.infra)
        for veth in self.veths.values():
            _ip("link", "del", veth, check=False)  # its peer in the namespace goes with it
        _ip("link", "del", self.bridge, check=False)
        for ns in self.namespaces.values():
            _ip("netns", "del", ns, check=False)


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM to each, then SIGKILL to those still there after ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
