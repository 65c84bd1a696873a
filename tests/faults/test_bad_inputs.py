"""Bad inputs of the later stages, at the level of the code that reads them: a token-label store cut short or
garbled is one line naming it and what to do, and so is a disk too small for a new store. Through the stages' real
commands, with the other bad inputs (teacher weights, another architecture's model file, an empty params.yaml,
token_labels.top_k above the class count): test_user_mistakes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import PROJECT_ROOT
from coarse2fine.errors import UserError
from coarse2fine.labels.store import CLASSES_FILE, HEADER_FILE, LOG_PROBS_FILE, TokenLabelStore, write_store


def damage_truncate(directory):
    path = directory / CLASSES_FILE
    path.write_bytes(path.read_bytes()[:-40])


def damage_header_garbled(directory):
    (directory / HEADER_FILE).write_text('{"records": 7, "top_k"')


def damage_header_without_a_key(directory):
    header = json.loads((directory / HEADER_FILE).read_text())
    del header["grid"]
    (directory / HEADER_FILE).write_text(json.dumps(header))


def damage_array_missing(directory):
    (directory / LOG_PROBS_FILE).unlink()


@pytest.mark.parametrize(
    ("damage", "what"),
    [(damage_truncate, "ValueError"), (damage_header_garbled, "JSONDecodeError"),
     (damage_header_without_a_key, "KeyError: 'grid'"), (damage_array_missing, "FileNotFoundError")],
)
def test_a_damaged_token_label_store_is_one_line_naming_it(tmp_path, damage, what):
    write_store(tmp_path, np.zeros((7, 2, 2, 2)), np.zeros((7, 2, 2, 2)), num_classes=10)
    TokenLabelStore(tmp_path, records=7, num_classes=10)  # whole, it opens
    damage(tmp_path)
    with pytest.raises(UserError) as raised:
        TokenLabelStore(tmp_path, records=7, num_classes=10)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path}: not a readable token-label store ({what}")
    assert message.endswith("rerun the token_labels stage (`dvc repro` does, as the store's hash changed)")
    assert "\n" not in message


ALLOCATE_UNDER_A_FILE_SIZE_LIMIT = """
import resource, sys
from coarse2fine.errors import UserError
from coarse2fine.labels.store import allocate_arrays
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    allocate_arrays(sys.argv[1], records=1000, top_k=5, grid=4, num_classes=10)
except UserError as error:
    print(error)
"""


def test_a_disk_that_cannot_hold_the_token_label_store_is_one_line_before_any_label_is_made(tmp_path):
    """The arrays' blocks are reserved when they are created (80 kB each here, over a 4 kB file-size limit, as a
    full disk would refuse them): one line, no file left, instead of a SIGBUS at the first chunk written."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src")}
    result = subprocess.run(
        [sys.executable, "-c", ALLOCATE_UNDER_A_FILE_SIZE_LIMIT, str(tmp_path)], env=env, capture_output=True,
        text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"{tmp_path / LOG_PROBS_FILE}: file too large while writing it (it is removed): free space, or raise the "
        f"file-size limit, and rerun"
    )
    assert list(tmp_path.iterdir()) == []
