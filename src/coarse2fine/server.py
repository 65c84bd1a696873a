"""`python -m coarse2fine.server` (`make server`): an MLflow tracking server for a team, PostgreSQL its backend store.

    make server                                   # PostgreSQL in .mlflow-server/postgres, artifacts beside it
    make server SERVER_ARGS="--db postgresql://user:pass@dbhost/mlflow --artifacts s3://bucket/mlflow"

Then every stage, queued experiment and colleague writes through HTTP: `export MLFLOW_TRACKING_URI=http://HOST:5000`.
A SQLite file belongs on one machine's local disk, never on NFS or Lustre (SQLite's locks are not reliable there and
MLflow's docs say so); a server with a database is what a team on shared storage uses. Without `--db` the server
starts a PostgreSQL cluster of its own (Debian's `postgresql` package: initdb on first use, pg_ctl), listening on
127.0.0.1 only, with a password generated once and kept in the cluster's folder (mode 0600). Artifacts are proxied
(`--artifacts-destination`): clients need no access to the folder or bucket, only to the server. The server listens
on 127.0.0.1 unless `--host` says otherwise; then give it `--auth` (MLflow's basic authentication: users and
permissions in HOME/auth.db, an `admin` user whose password is generated once into HOME/admin_password, mode 0600;
clients set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD) and TLS through a reverse proxy.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from coarse2fine import cli
from coarse2fine.errors import UserError

DEFAULT_HOME = Path(".mlflow-server")
DATABASE, ROLE = "mlflow", "coarse2fine"
ADMIN = "admin"
# Every user may read and write every experiment (the pipeline's runs share one); who is a user is the admin's call.
# MLflow's default is READ, with which a colleague's stages could not write to the experiment the first one made.
AUTH_CONFIG = """[mlflow]
default_permission = EDIT
database_uri = sqlite:///{database}
admin_username = {admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
"""
POSTGRES_USER = "postgres"  # Debian's package makes it; initdb and postgres refuse to run as root
STARTUP_SECONDS = 120


def postgres_program(name: str) -> str:
    """initdb, pg_ctl, ...: on PATH, or Debian's versioned folder (the newest), which is not on PATH."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise UserError(f"PostgreSQL's {name} not found: install the server (apt-get install postgresql), or give "
                        "--db postgresql://... of a database you have")
    return found


@contextlib.contextmanager
def local_postgres(home: Path, port: int) -> Iterator[str]:
    """A PostgreSQL cluster in `home` (made on first use) on 127.0.0.1:`port`, with a database for MLflow; yields its
    SQLAlchemy URI and stops the cluster on leaving. As root, its programs run as the postgres user, who owns `home`
    (so `home`'s parent folders must let that user through, as /tmp does)."""
    home = home.resolve()
    data, password_file = home / "data", home / "password"
    as_postgres = {"user": POSTGRES_USER} if os.geteuid() == 0 else {}
    if not (data / "PG_VERSION").is_file():
        home.mkdir(parents=True, exist_ok=True)
        secret(password_file)
        if as_postgres:
            shutil.chown(home, POSTGRES_USER)
            shutil.chown(password_file, POSTGRES_USER)
        _run([postgres_program("initdb"), "-D", str(data), "-U", ROLE, "--auth=scram-sha-256",
              f"--pwfile={password_file}", "--encoding=UTF8", "--no-locale"], "initdb", **as_postgres)
    password = secret(password_file)
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {home}"  # its socket in its own folder, not /run
    pg_ctl = postgres_program("pg_ctl")
    _run([pg_ctl, "-D", str(data), "-l", str(home / "postgres.log"), "-o", options, "-w", "start"],
         f"PostgreSQL on 127.0.0.1:{port} (its log: {home / 'postgres.log'})", **as_postgres)
    try:
        exists = subprocess.run(
            [postgres_program("psql"), "-h", "127.0.0.1", "-p", str(port), "-U", ROLE, "-d", "postgres", "-tAc",
             f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'"],
            env={**os.environ, "PGPASSWORD": password}, capture_output=True, text=True, check=True,
        ).stdout.strip()
        if not exists:
            _run([postgres_program("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", ROLE, DATABASE], "createdb",
                 env={**os.environ, "PGPASSWORD": password})
        yield f"postgresql://{ROLE}:{password}@127.0.0.1:{port}/{DATABASE}"
    finally:
        subprocess.run([pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], capture_output=True, **as_postgres)


def secret(path: Path) -> str:
    """The secret kept in `path`, generated (mode 0600) on first use."""
    if not path.is_file():
        path.touch(0o600)
        path.write_text(secrets.token_urlsafe(24))
    return path.read_text().strip()


def auth_environment(home: Path) -> dict[str, str]:
    """The environment of a server with MLflow's basic authentication, its users in `home`/auth.db: the config file,
    the admin's password (used when the user store is created) and the key that signs its forms, the same at every
    start (MLflow refuses to start without one)."""
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "auth.ini"
    config.write_text(AUTH_CONFIG.format(database=home / "auth.db", admin=ADMIN))
    return {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_AUTH_ADMIN_PASSWORD": secret(home / "admin_password"),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secret(home / "secret_key")}


@contextlib.contextmanager
def mlflow_server(backend_uri: str, artifacts: str, *, host: str = "127.0.0.1", port: int = 5000,
                  workers: int | None = None, log: Path | None = None,
                  auth: Path | None = None) -> Iterator[subprocess.Popen]:
    """`mlflow server` on host:port with `backend_uri` (passed in its environment, not on a command line `ps`
    shows) and proxied artifacts, with MLflow's default number of workers unless `workers`, with basic
    authentication (its users in the folder `auth`) if asked; returns once it answers /health, and stops it on
    leaving."""
    command = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port),
               "--artifacts-destination", artifacts, *(["--workers", str(workers)] if workers else []),
               *(["--app-name", "basic-auth"] if auth else [])]
    # No job runner (MLflow's GenAI jobs, which start a huey consumer per worker) and, offline, no telemetry.
    env = {"MLFLOW_DISABLE_TELEMETRY": "true", **os.environ, "MLFLOW_BACKEND_STORE_URI": backend_uri,
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(auth_environment(auth) if auth else {})}
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(open(log, "ab")) if log else subprocess.DEVNULL
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(stop, server)
        wait_until_healthy(f"http://{host}:{port}", server, log)
        yield server


def wait_until_healthy(url: str, server: subprocess.Popen, log: Path | None) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise UserError(f"mlflow server exited ({server.returncode}) before answering at {url}"
                            + (f": see {log}" if log else ""))
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise UserError(f"mlflow server did not answer at {url}/health within {STARTUP_SECONDS} s"
                    + (f": see {log}" if log else ""))


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its workers too), then SIGKILL after 30 s."""
    if server.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 15)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def _run(command: list[str], what: str, **kwargs) -> None:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise UserError(f"{what} failed: {detail[-1] if detail else f'exit {result.returncode}'}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coarse2fine.server", description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="the backend store's URI (postgresql://...); default: a PostgreSQL cluster of "
                                     "its own in HOME/postgres on 127.0.0.1:--pg-port")
    parser.add_argument("--home", type=Path, default=DEFAULT_HOME, help="default: .mlflow-server")
    parser.add_argument("--pg-port", type=int, default=5433, help="the own cluster's port (default: 5433)")
    parser.add_argument("--artifacts", help="where the server keeps artifacts: a folder or s3://bucket/prefix "
                                            "(default: HOME/artifacts)")
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (loopback only)")
    parser.add_argument("--port", type=int, default=5000, help="default: 5000")
    parser.add_argument("--auth", action="store_true",
                        help="MLflow's basic authentication: users in HOME/auth.db, the admin's password in "
                             "HOME/admin_password; clients set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
    args = parser.parse_args(argv)
    try:
        with contextlib.ExitStack() as stack:
            db = args.db or stack.enter_context(local_postgres(args.home / "postgres", args.pg_port))
            artifacts = args.artifacts or str((args.home / "artifacts").resolve())
            args.home.mkdir(parents=True, exist_ok=True)
            log = args.home / "server.log"
            auth = args.home if args.auth else None
            server = stack.enter_context(mlflow_server(db, artifacts, host=args.host, port=args.port, log=log,
                                                       auth=auth))
            where = "its own PostgreSQL in " + str(args.home / "postgres") if args.db is None else "the --db database"
            print(f"MLflow tracking server at http://{args.host}:{args.port} (backend: {where}; artifacts: "
                  f"{artifacts}; log: {log})\nexport MLFLOW_TRACKING_URI=http://{args.host}:{args.port}  # then "
                  "dvc repro, dvc exp run, make ui; Ctrl-C stops the server", flush=True)
            if auth:
                print(f"users: MLFLOW_TRACKING_USERNAME={ADMIN}, MLFLOW_TRACKING_PASSWORD in "
                      f"{auth / 'admin_password'}; add others in the UI or with mlflow.server.get_app_client",
                      flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                server.wait()
    except UserError as error:
        cli.print_user_error(error)
        sys.exit(cli.USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
