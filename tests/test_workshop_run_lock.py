"""One writer per run folder (workshop.run.run_lock). That a run holds its folder
whenever it writes, and that a run killed with kill -9 lets go of it for its own
--resume, is tested with the runs of test_workshop_training.py."""

import re

import pytest
from conftest import names_in, smoke_config

from workshop.run import run_lock, training


def test_a_folder_is_held_only_while_the_block_runs_and_left_as_it_was(tmp_path):
    run_lock.refuse_if_held(tmp_path)  # free: it makes nothing to say so
    with run_lock.hold_run_folder(tmp_path):
        with pytest.raises(run_lock.FolderInUseError):
            with run_lock.hold_run_folder(tmp_path):
                pass
    assert names_in(tmp_path) == []
    with run_lock.hold_run_folder(tmp_path):  # free again
        pass


@pytest.mark.parametrize("resume", [False, True], ids=["new run", "resumed run"])
def test_a_run_into_a_held_folder_is_refused_in_one_line_naming_it(resume, tmp_path):
    """Refused before anything else is checked or written."""
    in_use = re.escape(f"{tmp_path} is in use: another process is writing a run")
    with run_lock.hold_run_folder(tmp_path):
        with pytest.raises(run_lock.FolderInUseError, match=in_use) as error:
            training.train_model(
                smoke_config(), tmp_path / "x", tmp_path, resume=resume
            )
    assert "\n" not in str(error.value) and names_in(tmp_path) == []
