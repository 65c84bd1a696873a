"""DVCLive as the writer of a stage's metrics files (metrics.json and the per-step plots dvc.yaml declares)."""

from __future__ import annotations

import json

from dvclive import Live
from dvclive.plots import NumpyEncoder

from coarse2fine.files import atomic_path


class FileOnlyLive(Live):
    """DVCLive as a writer of files under its `dir`, and nothing else.

    dvc.yaml declares those files as metrics and plots, so Live's repo integration has nothing to add, and
    it has side effects: in a git repo without DVC it runs `dvc init` there, and inside `dvc exp run` it
    `git add`s files of its dir. `_init_dvc` (dvclive 3.49, pinned) is the one place that integration starts;
    test_tracking.py checks that nothing outside metrics_dir is touched.
    """

    def __init__(self, metrics_dir: str) -> None:
        # save_dvc_exp=False, dvcyaml=None, report=None: no experiments behind the user's back (that is `dvc exp
        # run`'s job), no edits of dvc.yaml, no report files. resume=False: the files start empty; a resumed run
        # rewrites its history (Tracker.resume_history), since DVC deletes a stage's outputs before it runs it.
        super().__init__(dir=metrics_dir, resume=False, report=None, save_dvc_exp=False, dvcyaml=None)

    def _init_dvc(self) -> None:
        pass

    def make_summary(self) -> None:
        """Live's own summary, written atomically: a kill in the middle of Live's in-place rewrite would leave a
        metrics.json that `dvc metrics show` cannot parse."""
        if self._step is not None:
            self.summary["step"] = self.step
        with atomic_path(self.metrics_file) as temporary:
            temporary.write_text(json.dumps(self.summary, indent=4, cls=NumpyEncoder) + "\n", encoding="utf-8")
