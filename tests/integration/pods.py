"""Kubernetes "pods" on this host, for tests of the pod commands in ``deploy/kuberay``.

A pod runs one script in a process group of its own (never a session of its own), with an
environment of its own. Ray starts its worker processes (the replicas, and vLLM's processes under
them) in process groups of their own, so a pod also marks its environment
(``TANDEM_TEST_POD=<id>``), which every process it starts inherits: killing the pod kills its group
and every marked process, as the end of a container kills everything in it, and a pod is gone
when no marked process is left.

A pod given a ``Network`` runs in a network namespace of its own, with an address of its own on a
bridge of this host (as a pod has its own IP and ports), and a private ``/tmp/ray`` (as a pod has
its own /tmp): two pods then bind the same ports, the manifests' own, as they do in a cluster. That
needs root (CI is); the namespaces and the bridge go when the ``Network`` closes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

from tests.waiting import wait_for

MARK = "TANDEM_TEST_POD"
REPO = Path(__file__).resolve().parents[2]


class Network:
    """A bridge on this host and a network namespace per pod on it: ``add(name)`` gives the pod's
    namespace and address (``10.231.N.2`` and up; the bridge is ``.1``, this host's side, so the
    test reaches every pod). Names carry this process's pid: concurrent runs do not meet."""

    def __init__(self):
        tag = os.getpid() % 100_000
        self.subnet = f"10.231.{tag % 200 + 20}"
        self.bridge = f"tpb{tag}"
        self.namespaces: list[str] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> tuple[str, str]:
        """A new namespace for pod ``name``: (namespace, its address)."""
        n = len(self.namespaces) + 2
        ns, host_end, pod_end = f"tp{os.getpid()}-{n}", f"tph{os.getpid() % 100_000}-{n}", "eth0"
        address = f"{self.subnet}.{n}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", f"tpp{os.getpid() % 100_000}-{n}")
        _ip("link", "set", f"tpp{os.getpid() % 100_000}-{n}", "netns", ns)
        _ip("netns", "exec", ns, "ip", "link", "set", f"tpp{os.getpid() % 100_000}-{n}", "name", pod_end)
        _ip("link", "set", host_end, "master", self.bridge, "up")
        for args in (("addr", "add", f"{address}/24", "dev", pod_end), ("link", "set", pod_end, "up"),
                     ("link", "set", "lo", "up"), ("route", "add", "default", "via", f"{self.subnet}.1")):
            _ip("netns", "exec", ns, "ip", *args)  # (a default route: Ray finds its address by it)
        return ns, address

    def close(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr.strip()}"


class Pod:
    def __init__(self, name: str, script: Path, env: dict[str, str], log_dir: Path, netns: str | None = None):
        self.name = name
        self.script = script
        self.id = f"{name}-{uuid.uuid4().hex[:12]}"
        self.env = {**env, MARK: self.id}
        self.log = log_dir / f"{name}.log"
        self.netns = netns
        self.proc: subprocess.Popen | None = None

    def start(self) -> Pod:
        command = [str(self.script)]
        if self.netns is not None:  # its own network and /tmp/ray; each step execs the next (one pid)
            Path("/tmp/ray").mkdir(exist_ok=True)
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       'mount -t tmpfs tmpfs /tmp/ray && exec ip netns exec "$0" "$1"', self.netns, str(self.script)]
        self.proc = subprocess.Popen(command, env=self.env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, cwd=REPO, process_group=0)
        return self

    @property
    def running(self) -> bool:
        """The pod's command (its PID 1) has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        """Every live process of the pod: its process group and every process that carries its
        mark (zombies have no environment left and are not counted)."""
        mark = f"{MARK}={self.id}".encode()
        pgid = self.proc.pid if self.proc is not None else None
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                in_group = pgid is not None and os.getpgid(pid) == pgid
                marked = mark in (entry / "environ").read_bytes().split(b"\0")
            except (OSError, ProcessLookupError):
                continue  # gone meanwhile, or not ours to read
            if marked or (in_group and _alive(entry)):
                found.append(pid)
        return found

    def kill(self, timeout: float = 60) -> None:
        """SIGKILL to the pod's process group and to every process of it, until none is left."""
        def gone() -> bool:
            if self.proc is not None and self.proc.poll() is None:
                _signal_group(self.proc.pid, signal.SIGKILL)
            for pid in self.pids():
                _signal(pid, signal.SIGKILL)
            return not self.pids()

        wait_for(gone, f"every process of pod {self.name} to be gone", timeout=timeout, interval=0.2)
        if self.proc is not None:
            self.proc.wait(timeout)

    def terminate(self, timeout: float) -> int:
        """SIGTERM to the pod's command alone, as the kubelet stops a container; its exit status
        (AssertionError if it has not exited within ``timeout`` s)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pod {self.name} still running {timeout:.0f} s after SIGTERM:\n"
                                 f"{self.log_tail()}") from None

    def log_tail(self, n: int = 40) -> str:
        if not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").splitlines()[-n:]
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(line[:400] for line in lines)


def _alive(proc_dir: Path) -> bool:
    try:
        return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
