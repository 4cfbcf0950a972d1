"""The rank launcher: results in rank order, torchrun's environment, and failures that never hang the caller."""

import concurrent.futures
import multiprocessing.util
import os
import signal
import socket
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from lmsys.distributed import launch as launch_module
from lmsys.distributed.launch import RankError, RankTimeout, init_process_group, launch_ranks

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _report(offset: int, *, scale: int) -> dict:
    device = init_process_group()  # already initialized by launch: returns the device only
    total = torch.tensor([dist.get_rank() + offset], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": str(device),
        "sum": scale * total.item(),
        "env": {name: os.environ.get(name) for name in TORCHRUN_ENV + tuple(launch_module.NO_MULTICAST_ENV)},
    }


def test_returns_each_rank_result_in_rank_order_with_torchrun_environment():
    results = launch_ranks(_report, 3, 10, scale=2, backend="gloo", timeout=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, result in enumerate(results):
        assert (result["world_size"], result["backend"], result["device"]) == (3, "gloo", "cpu")
        assert result["sum"] == 2 * (0 + 1 + 2 + 3 * 10)
        env = result["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("3", "3")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == results[0]["env"]["MASTER_PORT"]
        assert {name: env[name] for name in launch_module.NO_MULTICAST_ENV} == launch_module.NO_MULTICAST_ENV


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one failed on purpose")
    time.sleep(120)  # rank 0 would outlive any test: launch must stop it


def test_raising_rank_fails_fast_with_its_traceback():
    # A launcher that waited for rank 0 would end in RankTimeout after 60 s; RankError means it stopped rank 0 first.
    with pytest.raises(RankError) as info:
        launch_ranks(_rank_one_raises, 2, timeout=60)
    assert type(info.value) is RankError and info.value.rank == 1
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed")
    assert "ValueError: rank one failed on purpose" in message and "in _rank_one_raises" in message


def _rank_one_hangs(pid_file: str) -> int:
    if dist.get_rank() == 1:
        with open(pid_file, "w") as file:
            file.write(str(os.getpid()))
        time.sleep(120)
    return dist.get_rank()


def _rank() -> int:
    return dist.get_rank()


@pytest.fixture
def warm_launcher():
    """A first launch in a process starts the forkserver (torch imported anew), which can take longer than the short
    timeouts of the hang tests: one launch first, so that their timeout falls on the hang and not on the start."""
    assert launch_ranks(_rank, 2) == [0, 1]


def test_hanging_rank_is_killed_after_the_timeout(tmp_path, warm_launcher):
    pid_file = tmp_path / "pid"
    with pytest.raises(RankTimeout) as info:
        launch_ranks(_rank_one_hangs, 2, str(pid_file), timeout=3)
    assert info.value.ranks == [1]
    assert "ranks [1] of 2 still running after the 3 s timeout" in str(info.value)
    assert not _exists(int(pid_file.read_text()))


def _exists(pid: int) -> bool:
    """Whether `pid` is still a process; its parent (the forkserver) reaps it asynchronously, so allow a moment."""
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/status") as status:
                if "zombie" not in status.read():
                    return True
        except FileNotFoundError:
            return False
        time.sleep(0.1)
    return True


def _rank_one_dies(how: str) -> None:
    if dist.get_rank() == 1:
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.barrier()  # blocks until rank 1 arrives, which it never does


@pytest.mark.parametrize("how,expected", [("signal", "died from signal SIGKILL"), ("exit", "exited with code 3")])
def test_rank_that_dies_without_reporting_is_named_with_its_exit_status(how, expected):
    with pytest.raises(RankError, match=f"rank 1 of 2 failed:\n{expected}"):
        launch_ranks(_rank_one_dies, 2, how, timeout=60)


def _rank_one_dies_after_returning(how: str) -> int:
    """Rank 1 returns its result, then dies as its process exits: multiprocessing runs its exit finalizers after the
    launcher's rank body has sent the result and destroyed the process group."""
    if dist.get_rank() == 1:
        die = os.abort if how == "signal" else lambda: os._exit(3)
        multiprocessing.util.Finalize(None, die, exitpriority=100)
    return dist.get_rank()


@pytest.mark.parametrize("how,expected", [("signal", "died from signal SIGABRT"), ("exit", "exited with code 3")])
def test_rank_that_dies_after_reporting_its_result_fails_the_run(how, expected):
    with pytest.raises(RankError, match=f"rank 1 of 2 failed:\nreported its result, then {expected}") as info:
        launch_ranks(_rank_one_dies_after_returning, 2, how, timeout=60)
    assert type(info.value) is RankError and info.value.rank == 1


def _rank_one_hangs_after_returning() -> int:
    if dist.get_rank() == 1:
        multiprocessing.util.Finalize(None, _a_function_that_hangs_for_the_test, exitpriority=100)
    return dist.get_rank()


def _unpicklable():
    return lambda: None


def test_unpicklable_result_is_an_error_naming_the_function():
    with pytest.raises(RankError, match="the return value of _unpicklable on rank 0 cannot be pickled"):
        launch_ranks(_unpicklable, 1, timeout=60)


def _listener_pid_of_master_port(candidates: list[int]) -> int | None:
    """Which of `candidates` (process ids) holds the socket listening on MASTER_PORT, read from /proc."""
    port, inodes = int(os.environ["MASTER_PORT"]), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as file:
            for line in file.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    for pid in candidates:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").removesuffix("]") in inodes:
                    return pid
            except FileNotFoundError:
                pass
    return None


def _rendezvous(launcher_pid: int) -> dict:
    return {"port": int(os.environ["MASTER_PORT"]), "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
            "listener": _listener_pid_of_master_port([launcher_pid, os.getpid()])}


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the listening sockets from Linux's /proc")
def test_the_ranks_rendezvous_on_a_store_the_launcher_holds():
    # A port that rank 0 binds after the launcher chose it can be taken in between, by another launch's rank 0 even,
    # whose ranks then join this launch's rendezvous; a port the launcher's own store holds from the start cannot.
    results = launch_ranks(_rendezvous, 2, os.getpid(), timeout=60)
    assert results == [{"port": results[0]["port"], "agent_store": "True", "listener": os.getpid()}] * 2
    # The store is gone once the launch is: nothing listens on its port any more.
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", results[0]["port"]))
        probe.listen()


def _all_reduce_token(token: int) -> tuple[int, str]:
    total = torch.tensor([token])
    dist.all_reduce(total)
    return total.item(), os.environ["MASTER_PORT"]


def test_concurrent_launches_rendezvous_with_their_own_ranks_only():
    # Two launchers at once, as two pytest-xdist workers are: a rank that joined the other launch's rendezvous would
    # fail or hang its gloo mesh, or add the other launch's token to the sum.
    def launches(first_token: int) -> list:
        return [launch_ranks(_all_reduce_token, 2, token, timeout=60) for token in range(first_token, first_token + 5)]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [run for runs in pool.map(launches, [100, 200]) for run in runs]
    for run, token in zip(runs, [*range(100, 105), *range(200, 205)]):
        assert [total for total, _ in run] == [2 * token] * 2
        assert run[0][1] == run[1][1]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=0), "world_size must be a positive integer"),
        (dict(world_size=2, timeout=0), "timeout must be positive"),
        (dict(world_size=torch.cuda.device_count() + 1, backend="nccl"), "backend 'nccl' needs a GPU per rank"),
    ],
)
def test_bad_arguments_are_refused_before_starting_ranks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch_ranks(_report, **kwargs)


def test_init_process_group_outside_launch_names_the_missing_variables(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="missing: \\['MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE'\\]"):
        init_process_group()


def _rank_one_starts_a_child_then_fails(pid_file: str) -> None:
    if dist.get_rank() == 1:
        child = subprocess.Popen(["sleep", "1000"])
        with open(pid_file, "w") as file:
            file.write(str(child.pid))
        raise ValueError("rank one failed with a child running")
    time.sleep(120)


def test_a_failed_rank_takes_the_processes_it_started_with_it(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(RankError, match="rank one failed with a child running"):
        launch_ranks(_rank_one_starts_a_child_then_fails, 2, str(pid_file), timeout=60)
    pid = int(pid_file.read_text())
    # A killed process can take a while to be scheduled and exit on a loaded machine: allow it several seconds.
    assert not all(_exists(pid) for _ in range(3)), f"the child {pid} of rank 1 outlived the run"


def _a_function_that_hangs_for_the_test() -> None:
    time.sleep(120)


def _rank_one_hangs_in_a_known_function() -> int:
    if dist.get_rank() == 1:
        _a_function_that_hangs_for_the_test()
    return dist.get_rank()


@pytest.mark.parametrize(("function", "where"), [
    (_rank_one_hangs_in_a_known_function, "rank 1 was here:"),
    (_rank_one_hangs_after_returning, "rank 1 was here (it had reported its result and was exiting):"),
], ids=["while-working", "after-reporting-its-result"])
def test_a_timeout_reports_where_each_hung_rank_was(function, where, warm_launcher):
    with pytest.raises(RankTimeout) as info:
        launch_ranks(function, 2, timeout=3)
    assert info.value.ranks == [1]
    assert where in str(info.value)
    assert "_a_function_that_hangs_for_the_test" in info.value.stacks[1]
    assert "_a_function_that_hangs_for_the_test" in str(info.value)
