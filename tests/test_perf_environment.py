"""The measured commit: from git, or from $LMSYS_GIT_COMMIT on a copy of the tree without .git (a GPU machine)."""

import json
import subprocess

import pytest
from perf_fakes import INNER_CONFTEST

from lmsys.perf import environment

pytest_plugins = ["pytester"]


def test_git_commit_prefers_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(environment.COMMIT_VARIABLE, raising=False)
    assert environment.git_commit(tmp_path) is None  # not a repository
    monkeypatch.setenv(environment.COMMIT_VARIABLE, "abc123")
    assert environment.git_commit(tmp_path) == "abc123"


@pytest.mark.parametrize("stale_git", [False, True], ids=["no-git", "stale-git"])
def test_a_baseline_saved_from_a_copied_tree_names_the_commit_handed_in(pytester, monkeypatch, stale_git):
    monkeypatch.setenv(environment.COMMIT_VARIABLE, "0123456789abcdef")
    if stale_git:  # a copy whose .git points at another commit than the one measured
        for command in (["init", "-q"], ["-c", "user.name=x", "-c", "user.email=x@x", "commit", "-q", "--allow-empty",
                                         "-m", "stale"]):
            subprocess.run(["git", *command], cwd=pytester.path, check=True)
    pytester.makeini("[pytest]\n")
    pytester.makeconftest(INNER_CONFTEST.format(name="Fake GPU 80GB"))
    pytester.makepyfile(test_a="def test_a(gpu_benchmark, fake):\n    gpu_benchmark(fake.work(1.0))\n")
    result = pytester.runpytest_inprocess(
        "--benchmark-max-time=0", "--benchmark-min-rounds=3", "--benchmark-save=x", "-p", "no:cacheprovider"
    )
    assert result.ret == 0, result.stdout.str()
    (path,) = (pytester.path / "baselines" / "Fake_GPU_80GB").glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["commit_info"]["id"] == "0123456789abcdef"
    # The stale .git's time and dirty flag describe its own commit, not the one measured.
    assert not {"time", "author_time", "dirty", "branch"} & set(doc["commit_info"]), doc["commit_info"]
    assert doc["machine_info"]["lmsys"]["git_commit"] == "0123456789abcdef"


def test_the_machine_start_is_the_boot_id_or_none(monkeypatch, tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("3f1c0e4a-0d1b-4c4e-9a55-6c2b1d0f7e21\n")
    monkeypatch.setattr(environment, "BOOT_ID", boot)
    assert environment.machine_start() == "3f1c0e4a-0d1b-4c4e-9a55-6c2b1d0f7e21"
    # A GPU is named by its UUID too: another GPU of the same boot is another start.
    assert (environment.machine_start({"kind": "cuda", "uuid": "GPU-1a2b"})
            == "3f1c0e4a-0d1b-4c4e-9a55-6c2b1d0f7e21/GPU-1a2b")
    assert environment.machine_start({"kind": "cpu"}) == "3f1c0e4a-0d1b-4c4e-9a55-6c2b1d0f7e21"
    monkeypatch.setattr(environment, "BOOT_ID", tmp_path / "missing")
    assert environment.machine_start() is None
