"""A private, throw-away PostgreSQL server: what the tests and `nowait bench load --stores` run
the shared store against when no server is given.

It runs the binaries of the local installation (`pg_config --bindir`, or the Debian path of
PostgreSQL 15) on a fresh data directory, listening on 127.0.0.1 at a free port with password
authentication (scram-sha-256), so a wrong password is refused as on a real server. initdb
refuses to run as root: as root, the data directory belongs to the `postgres` system user and
the binaries run as that user (runuser).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

DEBIAN_BINDIRS = tuple(Path(f"/usr/lib/postgresql/{v}/bin") for v in (17, 16, 15, 14))
SERVICE_USER = "postgres"


class PostgresNotFound(RuntimeError):
    """No PostgreSQL server binaries on this machine."""


def find_bindir() -> Path:
    """Where initdb and pg_ctl are: NOWAIT_PG_BINDIR, then pg_config's answer, then Debian's paths."""
    candidates = [Path(os.environ["NOWAIT_PG_BINDIR"])] if os.environ.get("NOWAIT_PG_BINDIR") else []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        if out:
            candidates.append(Path(out))
    candidates.extend(DEBIAN_BINDIRS)
    for bindir in candidates:
        if (bindir / "initdb").exists() and (bindir / "pg_ctl").exists():
            return bindir
    raise PostgresNotFound("PostgreSQL's server binaries (initdb, pg_ctl) were not found: install PostgreSQL "
                           "(Debian: apt-get install postgresql) or set NOWAIT_PG_BINDIR")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ScratchPostgres:
    """Start with `with ScratchPostgres() as pg:`; `pg.url` is a postgresql:// URL with password."""

    user: str = "nowait"
    database: str = "nowait"
    durable: bool = False  # fsync on, as a production server (a benchmark's comparison with SQLite's)

    def __post_init__(self) -> None:
        self.bindir = find_bindir()
        self.password = secrets.token_hex(16)
        self.port = 0
        self._root: Path | None = None
        self._as_service_user = os.geteuid() == 0

    @property
    def url(self) -> str:
        return self.url_for(self.database)

    def url_for(self, database: str, password: str | None = None) -> str:
        return f"postgresql://{self.user}:{password or self.password}@127.0.0.1:{self.port}/{database}"

    @property
    def data_dir(self) -> Path:
        assert self._root is not None
        return self._root / "data"

    def _run(self, *argv: str) -> subprocess.CompletedProcess:
        command = [str(self.bindir / argv[0]), *argv[1:]]
        if self._as_service_user:
            command = ["runuser", "-u", SERVICE_USER, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stderr.strip() or result.stdout}")
        return result

    def _own(self, path: Path) -> None:
        if self._as_service_user:
            shutil.chown(path, user=SERVICE_USER, group=SERVICE_USER)

    def start(self) -> ScratchPostgres:
        self._root = Path(tempfile.mkdtemp(prefix="nowait-pg-"))
        self._root.chmod(0o755)
        self._own(self._root)
        password_file = self._root / "password"
        password_file.write_text(self.password + "\n")
        self._own(password_file)
        self._run("initdb", "-D", str(self.data_dir), "-U", self.user, "--auth=scram-sha-256",
                  f"--pwfile={password_file}", "--encoding=UTF8", "--no-sync")
        password_file.unlink()
        self.port = free_port()
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self._root / "server.log"), "-o", self._options(),
                  "-w", "-t", "60", "start")
        self._create_database()
        return self

    def _options(self) -> str:
        # fsync off by default: a test's data outlives no crash, and the tests run faster.
        return (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self._root} "
                f"-c fsync={'on' if self.durable else 'off'} -c max_connections=200")

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(self.url_for("postgres"), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.database}"')

    def create_database(self, name: str) -> str:
        """A further empty database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url_for("postgres"), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return self.url_for(name)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (it can be started again with `restart`)."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        """Stop and start again on the same port and data: clients lose their connections."""
        self.stop()
        options = self._options()
        deadline = time.monotonic() + 30
        while True:
            try:
                self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self._root / "server.log"), "-o", options,
                          "-w", "-t", "60", "start")
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def close(self) -> None:
        if self._root is None:
            return
        with contextlib.suppress(RuntimeError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self._root, ignore_errors=True)
        self._root = None

    def __enter__(self) -> ScratchPostgres:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()
