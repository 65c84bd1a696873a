"""The stage server (coarse2fine.stage_server): a launched stage handed to the session's server (conftest's
`stage_server`) behaves as in the launcher's own process: its arguments, directory, environment, streams, exit
code and the caller's code; the launcher's signals reach it and the launcher's death ends it. Without a server
at the address, the launcher says so in one line and runs the stage itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coarse2fine.stage_server import SERVER_ENV, running as running_stage_server
from conftest import PROJECT_ROOT

STAGE = """import json, os, sys, time
from pathlib import Path
requirements = sys.modules.get("mlflow.utils.requirements_utils")  # its map of installed packages, built once
preloaded = ("torch" in sys.modules and "mlflow.store.tracking.sqlalchemy_store" in sys.modules
             and getattr(requirements, "_MODULES_TO_PACKAGES", None) is not None)
import coarse2fine, torch
seen = (json.dumps({"pid": os.getpid(), "rank": os.environ.get("RANK"), "preloaded": preloaded, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "code": coarse2fine.__file__, "greeting": os.environ.get("GREETING"),
                  "copy_marker": os.environ.get("COARSE2FINE_STAGE_SERVER_COPY"), "threads": torch.get_num_threads()}))
print(seen)
Path(f"seen{os.environ.get('RANK', '')}.json").write_text(seen)  # ranks share stdout: their lines can interleave
Path(f"pid{os.environ.get('RANK', '')}").write_text(str(os.getpid()))
ranks = range(int(os.environ.get("WORLD_SIZE", "0")))  # none set in a world of one run as the launcher's process
while sys.argv[-1] != "wait" and not all(Path(f"pid{rank}").exists() for rank in ranks):
    time.sleep(0.05)  # every rank has printed before one exits: torchrun stops the others at the first failure
if sys.argv[-1] == "wait":  # with a child, as a data loader's worker: forked, no death signal of its own
    import multiprocessing
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    Path(f"child{os.environ.get('RANK', '')}").write_text(str(child.pid))
    time.sleep(600)
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def launch(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, wrapper: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`python -m coarse2fine.launch stage.py` in tmp_path (run by `wrapper`, if given), importing a copy of the
    project's code (tmp_path/src)."""
    for stale in [*tmp_path.glob("pid*"), *tmp_path.glob("child*"), *tmp_path.glob("seen*")]:  # an earlier launch's
        stale.unlink()
    if not (tmp_path / "src").exists():
        shutil.copytree(PROJECT_ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
        (tmp_path / "stage.py").write_text(STAGE)
        (tmp_path / "params.yaml").write_text("seed: 0\n")
        (tmp_path / "two.yaml").write_text("launch: {nproc_per_node: 2}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src"), "GREETING": "hello", "OMP_NUM_THREADS": "2", **(env or {})}
    return subprocess.Popen(
        [*wrapper, sys.executable, "-m", "coarse2fine.launch", "stage.py", *args], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def stage_pid(tmp_path: Path, launcher: subprocess.Popen, rank: str = "", name: str = "pid") -> int:
    pid_file = tmp_path / f"{name}{rank}"
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1]
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    pid_file.unlink()
    return pid


def wait_until_gone(pid: int) -> None:
    """Until `pid` is dead: gone, or a zombie (an orphan waits for whichever init adopted it to reap it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        time.sleep(0.05)
    raise AssertionError(f"the stage's process {pid} outlived its launcher")


def test_a_stage_in_the_server_runs_as_in_the_launcher_with_the_callers_code_and_environment(tmp_path, stage_server):
    launcher = launch(tmp_path, "--params", "params.yaml", "x y")
    stdout, stderr = launcher.communicate(timeout=120)
    seen = json.loads(stdout.splitlines()[-1])
    assert seen["pid"] != launcher.pid  # the server's copy ran it
    assert launcher.returncode == 3 and stderr == "to stderr\n"
    assert (seen["argv"], seen["cwd"], seen["path0"]) == (["stage.py", "--params", "params.yaml", "x y"],
                                                          str(tmp_path), str(tmp_path))
    assert seen["code"] == str(tmp_path / "src" / "coarse2fine" / "__init__.py")  # not the server's own
    assert (seen["preloaded"], seen["greeting"], seen["copy_marker"], seen["threads"]) == (True, "hello", None, 2)


def test_the_launchers_death_ends_the_stage_and_its_signals_reach_it(tmp_path, stage_server):
    killed = launch(tmp_path, "wait")
    pid, child = stage_pid(tmp_path, killed), stage_pid(tmp_path, killed, name="child")
    assert pid != killed.pid
    killed.kill()
    wait_until_gone(pid)
    wait_until_gone(child)

    terminated = launch(tmp_path, "wait")
    pid = stage_pid(tmp_path, terminated)
    terminated.terminate()
    assert terminated.wait(timeout=60) == -signal.SIGTERM  # the stage died of it, and the launcher as it did
    wait_until_gone(pid)


def test_without_a_server_at_the_address_the_launcher_says_so_and_runs_the_stage(tmp_path):
    launcher = launch(tmp_path, env={SERVER_ENV: str(tmp_path / "nothing")})
    stdout, stderr = launcher.communicate(timeout=120)
    assert json.loads(stdout.splitlines()[-1])["pid"] == launcher.pid and launcher.returncode == 3
    assert stderr.splitlines()[0].startswith(f"coarse2fine: no stage server answers at {tmp_path / 'nothing'}")
    assert stderr.splitlines()[0].endswith(": running the stage in this process")



def ranks_seen(tmp_path: Path, launcher: subprocess.Popen) -> list[tuple]:
    """(rank, torch imported before the script ran, argv) of each rank of a two-rank launch of STAGE."""
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 1 and "exitcode  : 3" in stderr  # torchrun's report of the workers' exit code
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    return [(s["rank"], s["preloaded"], s["argv"]) for s in seen]


@pytest.mark.slow
def test_torchruns_workers_are_forks_of_the_server_too_and_die_with_the_launcher(tmp_path, stage_server):
    assert ranks_seen(tmp_path, launch(tmp_path, "--params", "two.yaml")) == [
        (rank, True, ["stage.py", "--params", "two.yaml"]) for rank in ("0", "1")
    ]

    killed = launch(tmp_path, "--params", "two.yaml", "wait")
    processes = [stage_pid(tmp_path, killed, rank, name) for rank in ("0", "1") for name in ("pid", "child")]
    killed.kill()
    for pid in processes:
        wait_until_gone(pid)


@pytest.mark.slow
@pytest.mark.own_processes
def test_the_command_form_runs_its_command_under_a_server_of_its_own(tmp_path):
    assert ranks_seen(tmp_path, launch(tmp_path, "--params", "two.yaml")) == [  # without one: fresh workers
        (rank, False, ["stage.py", "--params", "two.yaml"]) for rank in ("0", "1")
    ]
    wrapper = (sys.executable, "-m", "coarse2fine.stage_server")
    assert ranks_seen(tmp_path, launch(tmp_path, "--params", "two.yaml", wrapper=wrapper)) == [
        (rank, True, ["stage.py", "--params", "two.yaml"]) for rank in ("0", "1")
    ]


@pytest.mark.slow
def test_the_server_finds_what_the_callers_pythonpath_finds_and_starts_without_what_is_not_installed(
    tmp_path, monkeypatch
):
    """As on the H200 of 2026-11-27, where the dependencies came through PYTHONPATH (`pip install --target`,
    docs/gpu.md) and MLflow was not installed: the server used to replace PYTHONPATH by the project's src (its
    preload of nvidia.dali failed), then stopped at its preload of mlflow; either way every GPU smoke test stopped at
    the suite's fixture. Now it sees the caller's path and leaves an absent package to the stage that imports it."""
    site, marker = tmp_path / "site", tmp_path / "started"
    site.mkdir()
    (site / "sitecustomize.py").write_text(  # imported at start-up from the first folder of the path that has one
        textwrap.dedent("""\
            import importlib.abc, os, pathlib, sys
            pathlib.Path(os.environ["SERVER_MARKER"]).write_text(str(os.getpid()))

            class NotInstalled(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if name.partition(".")[0] == "mlflow":
                        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

            sys.meta_path.insert(0, NotInstalled())
        """)
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("SERVER_MARKER", str(marker))
    with running_stage_server():  # raises if the server did not start
        assert marker.is_file(), "the server did not see the caller's PYTHONPATH"


@pytest.mark.slow
def test_a_stage_launched_while_the_server_still_imports_waits_for_it_and_runs_there(tmp_path):
    """The server listens before it imports (the session's own is used that way): a launcher that connects during
    the imports queues at the socket, and its stage runs in a copy with everything imported, not in the launcher."""
    with running_stage_server(preloaded=False) as address:
        launcher = launch(tmp_path, "--params", "params.yaml", env={SERVER_ENV: str(address)})
        stdout, stderr = launcher.communicate(timeout=120)
    seen = json.loads(stdout.splitlines()[-1])
    assert launcher.returncode == 3 and stderr == "to stderr\n", stderr  # no "no stage server answers"
    assert seen["pid"] != launcher.pid and seen["preloaded"] is True
