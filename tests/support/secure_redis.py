"""Throwaway redis-servers for the security tests: TLS-only (with a CA made on the spot) and
ACL users loaded from the deploy's own ACL file. Never the shared :6379."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from tests.support.redis_server import free_port
from tests.support.scratch import scratch_dir

_OPENSSL_TIMEOUT_S = 30


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError("the openssl CLI is not installed (Debian package: openssl)")
    subprocess.run([binary, *args], cwd=cwd, check=True, capture_output=True,
                   timeout=_OPENSSL_TIMEOUT_S)


def make_ca(directory: Path, name: str = "ca") -> tuple[Path, Path]:
    """A self-signed P-256 CA: (certificate, key)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key.name, "-out", cert.name, "-days", "2",
             "-subj", f"/CN=agentbatch test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
    return cert, key


def make_server_cert(directory: Path, ca_cert: Path, ca_key: Path, *,
                     name: str = "server", sans: str = "IP:127.0.0.1,DNS:localhost",
                     usage: str = "serverAuth") -> tuple[Path, Path]:
    """A certificate for ``sans`` signed by the CA (``usage`` clientAuth for a client's):
    (certificate, key)."""
    cert, key, csr = (directory / f"{name}.pem", directory / f"{name}.key",
                      directory / f"{name}.csr")
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={sans}\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\n"
                   f"extendedKeyUsage={usage}\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", key.name, "-out", csr.name, "-subj", f"/CN={name}", cwd=directory)
    _openssl("x509", "-req", "-in", csr.name, "-CA", str(ca_cert), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", cert.name, "-days", "2", "-extfile", ext.name,
             cwd=directory)
    return cert, key


class _Server:
    """A redis-server process in its own temp dir, stopped by ``cleanup``."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian package: redis-server)")
        self.binary = binary
        self.port = free_port()
        self.dir = scratch_dir("redis-sec-")
        self.proc: subprocess.Popen[bytes] | None = None

    def _base_args(self) -> list[str]:
        return [self.binary, "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--appendonly", "no", "--maxmemory-policy", "noeviction",
                "--logfile", str(self.dir / "redis.log")]

    def _start(self, args: list[str], ping_url: str, **client_opts: object) -> None:
        self.proc = subprocess.Popen(args)
        deadline = time.monotonic() + 15
        while True:
            try:
                redis.from_url(ping_url, socket_connect_timeout=0.5, **client_opts).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    log = self.log()
                    self.cleanup()  # no process or temp dir left behind
                    raise RuntimeError(f"redis-server did not start; log: {log}") from None
                time.sleep(0.05)

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def cleanup(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class TlsRedisServer(_Server):
    """redis-server speaking TLS only (``--port 0``), its certificate signed by a fresh CA.

    A second CA (``other_ca``) signed nothing here: trusting it must not be enough. With
    ``auth_clients`` the server also demands a client certificate (``client_cert``,
    ``client_key``, signed by ``ca``)."""

    def __init__(self, *, auth_clients: bool = False) -> None:
        super().__init__()
        self.auth_clients = auth_clients
        self.ca, ca_key = make_ca(self.dir, "ca")
        self.cert, self.key = make_server_cert(self.dir, self.ca, ca_key)
        self.client_cert, self.client_key = make_server_cert(
            self.dir, self.ca, ca_key, name="client", sans="DNS:agentbatch-client",
            usage="clientAuth")
        self.other_ca, _ = make_ca(self.dir, "other-ca")

    def url(self, *, ca: Path | None = None, host: str = "127.0.0.1", query: str = "") -> str:
        """``rediss://host:port/0``, with ``?ssl_ca_certs=CA`` when ``ca`` is given."""
        params = [f"ssl_ca_certs={quote(str(ca))}"] if ca else []
        params += [query] if query else []
        return f"rediss://{host}:{self.port}/0" + (f"?{'&'.join(params)}" if params else "")

    def start(self) -> TlsRedisServer:
        # also on 127.0.0.2, a loopback address the certificate does not name
        args = [*self._base_args(), "--bind", "127.0.0.1", "127.0.0.2",
                "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.ca),
                "--tls-auth-clients", "yes" if self.auth_clients else "no"]
        self._start(args, self.url(ca=self.ca), ssl_cert_reqs="required",
                    **({"ssl_certfile": str(self.client_cert),
                        "ssl_keyfile": str(self.client_key)} if self.auth_clients else {}))
        return self


def render_acl(template: Path, out: Path, passwords: dict[str, str]) -> None:
    """Render the ACL template with the deploy's own script (deploy/render-redis-acl.sh),
    exactly as compose/ and k8s/ do; ``passwords`` maps a role (admin, worker...) to its
    password, and a role left out is left out of the file."""
    script = template.parent / "render-redis-acl.sh"
    env = {"PATH": "/usr/bin:/bin"}
    for role, password in passwords.items():
        env["REDIS_PASSWORD" if role == "admin" else f"REDIS_{role.upper()}_PASSWORD"] = password
    subprocess.run(["sh", str(script), str(template), str(out)], env=env, check=True,
                   capture_output=True, text=True, timeout=_OPENSSL_TIMEOUT_S)


class AclRedisServer(_Server):
    """redis-server whose users come from an ACL file (``--aclfile``), rendered from the
    deploy's template; ``passwords`` maps a role (admin, submitter, ...) to its password."""

    USERS = {"admin": "default", "submitter": "agentbatch-submitter",
             "worker": "agentbatch-worker", "flower": "agentbatch-flower",
             "keda": "agentbatch-keda"}

    def __init__(self, acl_template: Path, passwords: dict[str, str]) -> None:
        super().__init__()
        self.passwords = dict(passwords)
        self.acl_path = self.dir / "users.acl"
        render_acl(acl_template, self.acl_path, self.passwords)

    def url(self, role: str, password: str | None = None) -> str:
        """``redis://USER:PASSWORD@127.0.0.1:PORT/0`` for a role of ``USERS``."""
        user = self.USERS[role]
        secret = self.passwords[role] if password is None else password
        return f"redis://{quote(user, safe='')}:{quote(secret, safe='')}@127.0.0.1:{self.port}/0"

    def start(self) -> AclRedisServer:
        args = [*self._base_args(), "--port", str(self.port), "--aclfile", str(self.acl_path)]
        self._start(args, self.url("admin"))
        return self
