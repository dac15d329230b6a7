"""attnkit/run/locking.py: one command at a time per run directory; a second one is refused naming the holder."""
import os

import pytest

from attnkit import AttnkitError
from attnkit.run.locking import OWNER_FILE, lock_owner, run_lock


def test_second_command_is_refused_naming_the_holder(tmp_path, lock_held):
    run = tmp_path / "run"
    with lock_held(run, "attnkit extract") as pid:
        assert lock_owner(run) == {"pid": pid, "command": "attnkit extract"}
        with pytest.raises(AttnkitError) as e:
            with run_lock(run, "attnkit cluster"):
                pass
        assert str(e.value) == (f"{run} is in use by `attnkit extract` (pid {pid}); "
                                "wait for it to finish or choose another directory")
    # a killed holder leaves its lock to the OS: the next command gets the directory
    with run_lock(run, "attnkit cluster"):
        assert lock_owner(run)["pid"] == os.getpid()
    assert not (run / OWNER_FILE).exists()


def test_second_cli_command_exits_with_one_line(tmp_path, feats, lock_held):
    from click.testing import CliRunner

    from attnkit.cli.main import main

    run = tmp_path / "run"
    feats.save(run)
    with lock_held(run, "attnkit extract") as pid:
        r = CliRunner().invoke(main, ["cluster", str(run), "-q"])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: {run} is in use by `attnkit extract` (pid {pid}); "
                                "wait for it to finish or choose another directory")
    assert not (run / "clusters.json").exists()
