"""Open files at ImageNet's shard count: every reading process keeps at most records.MAX_OPEN_SHARDS shards open,
whatever the number of shards, so the loaders and the token labels' reader work under an open-file limit lower
than the shard count (ImageNet's 1,024 train shards under the common soft limit of 1,024); a limit too low for the
workers asked for is one line naming it and the key."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import Project, built_once, cpu_runtime, make_params
from coarse2fine.data import records
from coarse2fine.data.convert import convert

TRAIN_SHARDS, VAL_SHARDS = 300, 100
WORKERS = 2
# What a process with WORKERS DataLoader workers is allowed: far fewer files than the 400 shards.
LIMIT = records.MAX_OPEN_SHARDS + records.OPEN_FILES_BESIDE_SHARDS + records.OPEN_FILES_PER_WORKER * WORKERS


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every digit (1,437 train + 360 val images) in 300 + 100 shards of about 4 records."""
    def build(out: Path) -> None:
        params = make_params(
            seed=0,
            data={"source": "digits", "digits": {"size": 32, "val_fraction": 0.2}, "subset": 1.0,
                  "train_shards": TRAIN_SHARDS, "val_shards": VAL_SHARDS, "convert_workers": 1},
        )
        convert(params, cpu_runtime(), out)

    return built_once(tmp_path_factory, "digits_records_400_shards", build)


def run_limited(code: str, limit: int) -> subprocess.CompletedProcess:
    """`code` in a fresh Python whose open-file limit (soft and hard) is `limit`."""
    def lower_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], preexec_fn=lower_limit, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(["src", "tests"])}, timeout=600,
    )


LOADERS = """
    import os, sys
    from conftest import cpu_runtime, make_params, train_val_loaders
    params = make_params(loader={{"backend": "{backend}", "workers": {workers}}})
    counts = []
    for loader in train_val_loaders("{records}", params, cpu_runtime(), batch_size=16):
        loader.set_epoch(0)
        counts.append(sum(len(batch["label"]) for batch in loader))
    print(counts, len(os.listdir("/proc/self/fd")))
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_every_record_is_read_with_fewer_open_files_allowed_than_shards(many_shards: Path, backend: str) -> None:
    result = run_limited(LOADERS.format(backend=backend, workers=WORKERS, records=many_shards), LIMIT)
    assert result.returncode == 0, result.stderr[-3000:]
    train, val = (int(count) for count in result.stdout.split("]")[0].strip("[").split(","))
    assert train == 1437 // 16 * 16 and val == 360  # whole train batches (DROP), every val record


def test_a_shard_reader_keeps_at_most_max_open_shards_open_in_any_order(many_shards: Path) -> None:
    shards = records.shard_files(many_shards, "train")
    reader = records.ShardReader(shards)
    seen = [reader.read_position(position)["index"][0] for position in range(len(reader))]  # in order (token labels)
    assert reader.open_files() == records.MAX_OPEN_SHARDS < len(shards)
    assert sorted(seen) == list(range(len(reader)))
    for position in reversed(range(len(reader))):  # every shard again, least recently read first: each reopened
        assert reader.read_position(position)["index"][0] == seen[position]
    assert reader.open_files() == records.MAX_OPEN_SHARDS
    reader.close()
    assert reader.open_files() == 0


def test_a_forked_reader_closes_its_copies_of_the_parent_s_files(many_shards: Path) -> None:
    reader = records.ShardReader(records.shard_files(many_shards, "train"))
    reader.read(0, 0)
    reader.read(1, 0)
    pid = os.fork()
    if pid == 0:  # the child: reading opens its own file and closes the two it inherited
        reader.read(2, 0)
        os._exit(0 if reader.open_files() == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reader.open_files() == 2  # the parent's untouched
    reader.close()


@pytest.mark.slow
def test_a_limit_too_low_for_the_workers_is_one_line_naming_it_and_the_key(
    digits_records: Path, tmp_path: Path
) -> None:
    project = Project(tmp_path / "project")
    (project.path / "data").mkdir()
    (project.path / "data/records").symlink_to(digits_records)
    project.edit_params({"loader": {"backend": "torch", "workers": 8}, "pretrain": {"token_label": {"enabled": False}}})
    result = subprocess.run(
        f"ulimit -Sn {LIMIT} && {project.stage_command('pretrain')}", shell=True, cwd=project.path, env=project.env,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: loader.workers: 8 workers reading the records need up to {LIMIT + 4 * (8 - WORKERS)} open files "
        f"a process, but the open-file limit is {LIMIT} (ulimit -n); raise it (ulimit -n 1024) or lower loader.workers"
    ]
