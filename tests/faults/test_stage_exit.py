"""A stage's process ends without the interpreter's teardown (`cli.exit_now`, 1.4 s of every stage): nothing a
stage leaves to the end of the process is lost on the way, with either exit code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT

# A stage script in miniature: what it leaves for the end of its process (a thread still writing, an atexit
# handler, a daemonic child process as a loader's worker is, unflushed stdout) and an optional user mistake.
STAGE = """
import atexit, multiprocessing, sys, threading, time
from pathlib import Path
from coarse2fine import cli
from coarse2fine.errors import UserError

def main(params, args):
    out = Path(args.out)
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
    worker.start()
    (out / "worker").write_text(str(worker.pid))
    print("unflushed", end="")
    if args.mistake:
        raise UserError("a mistake")

parser = cli.stage_parser("a stage")
parser.add_argument("--out")
parser.add_argument("--mistake", action="store_true")
cli.run(main, parser, check_model_names=False)
print("after cli.run")
"""


@pytest.mark.parametrize("mistake", [False, True], ids=["success", "user mistake"])
def test_a_stage_ends_with_its_exit_code_and_nothing_left_to_the_end_is_lost(mistake, tmp_path):
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "stage.py").write_text(STAGE)
    ended = subprocess.run(
        [sys.executable, "stage.py", "--out", str(out), *(["--mistake"] if mistake else [])], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src")}, capture_output=True, text=True, timeout=120,
    )
    assert ended.returncode == (2 if mistake else 0), ended.stderr
    assert ended.stdout == "unflushed"  # flushed at the end, and cli.run never returned
    assert ended.stderr == ("error: a mistake\n" if mistake else "")
    assert (out / "thread").read_text() == "done" and (out / "atexit").read_text() == "ran"
    worker = int((out / "worker").read_text())
    with pytest.raises(ProcessLookupError):  # terminated by multiprocessing's atexit handler, then reaped
        os.kill(worker, 0)
