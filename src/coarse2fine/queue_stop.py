"""Stop the DVC experiment queue's workers and wait until they have exited; `make sweep` runs it after a sweep.

`dvc queue stop` broadcasts a shutdown through kombu's filesystem broker, which creates a message's file before it
writes into it: a worker that takes the file in between reads an empty message and the shutdown is lost
(kombu.transport.filesystem's `_put` and `_get`; treeverse/dvc#10398, #10428). The idle worker's own monitor
broadcasts its shutdown the same way, so a worker can stay up, idle, after `dvc exp run --run-all` has returned.
Hence: broadcast again while a worker is left, then SIGTERM it (celery's warm shutdown: a running experiment
finishes first), and say so.

    python -m coarse2fine.queue_stop            # in the DVC repository's root
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from coarse2fine import cli
from coarse2fine.errors import UserError

# Where DVC's queue keeps its workers' pid files: dvc.repo.experiments.queue.celery (`wdir`, `_spawn_worker`'s
# name dvc-exp-worker-N) through dvc_task.proc.process.ManagedProcess (`pidfile_path`).
WORKER_PIDFILES = ".dvc/tmp/exps/celery/dvc-exp-worker-*.pid"
BROADCASTS = 3  # each broadcast is a new message file, so each loss is a new race of milliseconds
BROADCAST_WAIT_S = 20.0  # an idle worker polls its broker every second and takes a few more to shut down
TERMINATE_WAIT_S = 60.0


def queue_workers(root: Path) -> dict[int, Path]:
    """The repository's queue workers still running: pid -> its pid file. A pid file whose process has exited (a
    zombie included) or whose pid another program now holds is no worker."""
    workers = {}
    for pidfile in sorted(root.glob(WORKER_PIDFILES)):
        with contextlib.suppress(ValueError, OSError):
            pid = int(pidfile.read_text())
            exited = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            if not exited and b"queue-worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                workers[pid] = pidfile
    return workers


def stop_queue_workers(
    root: Path,
    broadcasts: int = BROADCASTS,
    broadcast_wait_s: float = BROADCAST_WAIT_S,
    terminate_wait_s: float = TERMINATE_WAIT_S,
    say: Callable[[str], None] = print,
) -> None:
    """`dvc queue stop` until no worker of `root`'s queue is left, up to `broadcasts` times, then SIGTERM to those
    left. A UserError names a worker still running after that, and its log."""
    if not (root / ".dvc").is_dir():
        raise UserError(f"no DVC repository at {root}: run this in the repository's root, or pass --repo")
    for attempt in range(1, broadcasts + 1):
        if not queue_workers(root):
            return
        if attempt > 1:
            say(f"queue workers {sorted(queue_workers(root))} missed `dvc queue stop` (a lost broker message, "
                f"treeverse/dvc#10428): broadcasting it again ({attempt} of {broadcasts})")
        stop = subprocess.run([sys.executable, "-m", "dvc", "queue", "stop"], cwd=root, stdout=subprocess.DEVNULL)
        if stop.returncode != 0:
            raise UserError(f"`dvc queue stop` failed in {root} (exit {stop.returncode}; its message is above)")
        if not wait_for_exit(root, broadcast_wait_s):
            return
    left = queue_workers(root)
    say(f"queue workers {sorted(left)} missed {broadcasts} `dvc queue stop` broadcasts: sending them SIGTERM")
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    left = wait_for_exit(root, terminate_wait_s)
    if left:
        logs = ", ".join(str(pidfile.with_suffix(".out").relative_to(root)) for pidfile in left.values())
        raise UserError(f"queue workers {sorted(left)} still run {terminate_wait_s:.0f} s after SIGTERM; their logs: "
                        f"{logs}; `kill -9 {' '.join(map(str, sorted(left)))}` ends them")


def wait_for_exit(root: Path, wait_s: float) -> dict[int, Path]:
    """The workers still running after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while (left := queue_workers(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m coarse2fine.queue_stop", description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path("."), help="the DVC repository's root (default: .)")
    args = parser.parse_args(argv)
    try:
        stop_queue_workers(args.repo.resolve())
    except UserError as error:
        cli.print_user_error(error)
        sys.exit(cli.USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
