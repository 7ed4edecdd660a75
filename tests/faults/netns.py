"""Hosts on one machine: network namespaces joined by veth pairs and a bridge.

Topology (names carry a random tag so concurrent runs never collide)::

    root namespace (the test process)
      kvbr<tag>  bridge, 10.A.B.1/24 ── the "store network"
        ├── veth ── ns <tag>-srv   eth0 10.A.B.2   redis-server, moto_server
        ├── veth ── ns <tag>-a     eth0 10.A.B.3   worker A
        └── veth ── ns <tag>-b     eth0 10.A.B.4   worker B
      veth ── ns <tag>-a  mgmt0  10.A.C.x/30   the test's HTTP to worker A
      veth ── ns <tag>-b  mgmt0  10.A.C.y/30   the test's HTTP to worker B

Workers reach the servers only over the store network; the test reaches workers over their
own management links, so cutting a worker's store link (its bridge port taken out of the
bridge: frames are silently dropped, the interface stays up, nothing is refused) leaves the
test able to talk to it, as an operator would through another network.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field


class NetnsUnavailable(Exception):
    """The sandbox forbids creating namespaces or links (no CAP_NET_ADMIN)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        message = proc.stderr.strip() or proc.stdout.strip()
        if "Operation not permitted" in message or "Permission denied" in message:
            raise NetnsUnavailable(f"ip {' '.join(args)}: {message}")
        raise RuntimeError(f"ip {' '.join(args)} failed: {message}")
    return proc


def _free_subnets(n: int) -> list[tuple[int, int]]:
    """n /24s under 10.0.0.0/8 that no route or address of this machine mentions."""
    used = ip("-4", "route").stdout + ip("-4", "addr").stdout
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    picked: list[tuple[int, int]] = []
    while len(picked) < n:
        a, b = rng.randrange(100, 250), rng.randrange(0, 256)
        if f"10.{a}.{b}." not in used and f"10.{a}.0.0" not in used and (a, b) not in picked:
            picked.append((a, b))
    return picked


@dataclass
class Host:
    name: str  # the namespace
    addr: str  # on the store network
    port_link: str  # its veth end on the bridge (root namespace)
    mgmt: str | None = None  # address the test reaches it at, if it has a management link


@dataclass
class Lab:
    tag: str = field(default_factory=lambda: f"{random.getrandbits(16):04x}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _links: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bridge = f"kvbr{self.tag}"
        (a, b), (_, c) = _free_subnets(2)
        self._net = f"10.{a}.{b}"
        self._mgmt = f"10.{a}.{c}"
        self._next_mgmt = 0

    def up(self) -> Lab:
        """Create the bridge. Raises NetnsUnavailable when the sandbox forbids it."""
        ip("netns", "add", f"{self.tag}-probe")  # the cheapest way to learn it is allowed
        ip("netns", "del", f"{self.tag}-probe")
        ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        ip("addr", "add", f"{self._net}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        return self

    def add_host(self, role: str, mgmt: bool = False) -> Host:
        ns = f"{self.tag}-{role}"
        n = len(self.hosts) + 2
        port_link = f"kv{self.tag}{role[:3]}"
        ip("netns", "add", ns)
        self.hosts[role] = host = Host(ns, f"{self._net}.{n}", port_link)
        ip("link", "add", port_link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._links.append(port_link)
        ip("link", "set", port_link, "master", self.bridge)
        ip("link", "set", port_link, "up")
        ip("-n", ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        if mgmt:
            base = 4 * self._next_mgmt
            self._next_mgmt += 1
            link = f"kv{self.tag}{role[:3]}m"
            ip("link", "add", link, "type", "veth", "peer", "name", "mgmt0", "netns", ns)
            self._links.append(link)
            ip("addr", "add", f"{self._mgmt}.{base + 1}/30", "dev", link)
            ip("link", "set", link, "up")
            ip("-n", ns, "addr", "add", f"{self._mgmt}.{base + 2}/30", "dev", "mgmt0")
            ip("-n", ns, "link", "set", "mgmt0", "up")
            host.mgmt = f"{self._mgmt}.{base + 2}"
        return host

    def cut(self, role: str) -> None:
        """Take the host's port out of the bridge: its frames go nowhere, silently."""
        ip("link", "set", self.hosts[role].port_link, "nomaster")

    def heal(self, role: str) -> None:
        ip("link", "set", self.hosts[role].port_link, "master", self.bridge)

    def close(self) -> None:
        """Kill what still runs in the namespaces (only processes this lab started can be
        there), then delete namespaces and links. Never raises: it runs in teardown."""
        for host in self.hosts.values():
            pids = ip("netns", "pids", host.name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        for host in self.hosts.values():
            while ip("netns", "pids", host.name, check=False).stdout.strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            ip("netns", "del", host.name, check=False)
        for link in reversed(self._links):
            ip("link", "del", link, check=False)  # most went with their namespace already
