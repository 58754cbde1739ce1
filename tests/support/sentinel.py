"""A throwaway Sentinel group: a primary with AOF, one replica, three `redis-sentinel`s.

Every process gets a free port and lives in one temp dir; every wait has a deadline, and
``cleanup`` stops whatever is still running. It is the topology of docs/failover.md on one
machine, so a test can SIGKILL the primary and watch Sentinel promote the replica.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from tests.support.scratch import scratch_dir

SERVICE = "agentbatch"
T = TypeVar("T")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (Debian packages: redis-server, "
                           "redis-sentinel)")
    return path


def distinct_ports(n: int) -> list[int]:
    """``n`` different free ports (each socket held until all are picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(what: str, probe: Callable[[], T | None], timeout: float,
             log: Callable[[], str] = lambda: "") -> T:
    """``probe()``'s first truthy answer; TimeoutError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = probe()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            answer = None
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s\n{log()}")
        time.sleep(0.05)


class SentinelGroup:
    """``primary`` + ``replica`` (both appendonly, fsync every second) + three sentinels
    (quorum 2). ``down_after_ms`` is Sentinel's ``down-after-milliseconds``: how long the
    primary must be silent before the sentinels fail it over."""

    def __init__(self, *, down_after_ms: int = 1000, failover_timeout_ms: int = 10000) -> None:
        self.server = _binary("redis-server")
        self.sentinel = _binary("redis-sentinel")
        self.dir = scratch_dir("sentinel-")
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.primary_port, self.replica_port, *self.sentinel_ports = distinct_ports(5)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"sentinel://{hosts}/{SERVICE}?db=0"

    def direct_url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}/0"

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(self.dir.glob("*.log")))

    def _redis(self, name: str, port: int, *extra: str) -> None:
        data = self.dir / name
        data.mkdir()
        args = [self.server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                "--maxmemory-policy", "noeviction", "--repl-diskless-sync-delay", "0",
                "--logfile", str(self.dir / f"{name}.log"),
                *extra]
        self.procs[name] = subprocess.Popen(args)

    def start(self, timeout: float = 30) -> SentinelGroup:
        try:
            self._start(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _start(self, timeout: float) -> None:
        self._redis("primary", self.primary_port)
        self._redis("replica", self.replica_port,
                    "--replicaof", "127.0.0.1", str(self.primary_port))
        replica = redis.Redis(port=self.replica_port, socket_timeout=1, decode_responses=True)
        wait_for("the replica's link to the primary",
                 lambda: replica.info("replication").get("master_link_status") == "up",
                 timeout, self.log)
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {self.dir}",
                f"logfile {self.dir / f'sentinel-{port}.log'}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 2",
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
                f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {SERVICE} 1", ""]))
            self.procs[f"sentinel-{port}"] = subprocess.Popen([self.sentinel, str(conf)])
        for port in self.sentinel_ports:
            s = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
            wait_for(f"sentinel :{port} to know the replica and the other sentinels",
                     lambda s=s: (lambda m: int(m["num-slaves"]) == 1
                                  and int(m["num-other-sentinels"]) == 2)(
                         s.sentinel_master(SERVICE)),
                     timeout, self.log)

    def primary_port_now(self) -> int:
        """The port the sentinels currently name as the primary (any one that answers)."""
        for port in self.sentinel_ports:
            try:
                addr = redis.Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(
                    SERVICE)
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        raise RuntimeError(f"no sentinel answers for {SERVICE}\n{self.log()}")

    def kill_primary(self) -> float:
        """SIGKILL the primary (no shutdown, no last fsync); returns ``time.monotonic()``."""
        proc = self.procs["primary"]
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
        return killed

    def wait_promoted(self, timeout: float = 60) -> float:
        """Wait until every sentinel names the replica as primary and the replica says it is
        one; returns ``time.monotonic()`` then."""
        replica = redis.Redis(port=self.replica_port, socket_timeout=1, decode_responses=True)

        def promoted() -> bool:
            if replica.info("replication").get("role") != "master":
                return False
            for port in self.sentinel_ports:
                addr = redis.Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(
                    SERVICE)
                if not addr or int(addr[1]) != self.replica_port:
                    return False
            return True

        wait_for("Sentinel to promote the replica", promoted, timeout, self.log)
        return time.monotonic()

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
