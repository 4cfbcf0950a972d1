"""Run a function on N ranks in fresh processes, with a timeout and the failing rank's traceback.

`launch_ranks(fn, world_size, *args)` starts `world_size` processes, initializes `torch.distributed` in each (gloo on
the CPU, NCCL when there is a GPU per rank) and returns what `fn(*args)` returned on each rank, in rank order. The ranks
see the environment torchrun sets (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), so rank
code that starts with `init_process_group()` runs unchanged under `torchrun --nproc-per-node=N` on more GPUs or nodes.
We add no transport: torch.distributed is the engine.

Rendezvous. The launcher hosts the ranks' TCPStore itself, as torchrun's agent does: it binds the store to port 0 (the
kernel picks a free port and the store holds it from that moment), hands that port to the ranks as MASTER_PORT and
sets TORCHELASTIC_USE_AGENT_STORE=True, with which every rank's `init_process_group` (env://) connects to the store as
a client instead of rank 0 starting one. There is no moment between choosing the port and binding it, so no other
process can take the port (a rank 0 would then fail to bind it), and no concurrent launch can hand out the same port
(its ranks would then join this launch's rendezvous: the gloo mesh fails, "connectFullMesh failed ... Connection closed
by peer", or hangs). The store lives until every rank has been joined.

Failure handling. Each rank sends its result (or its traceback) to the parent through its own pipe; the parent
waits on those pipes and on the processes' exit sentinels together. The first rank to raise, or to die without
reporting (a signal, `os._exit`), stops every rank at once and raises `RankError` with that rank's number and
traceback or exit status. A result counts once its rank has exited with status 0: a rank that reports its result
and then dies (a SIGABRT in `destroy_process_group`, say) fails the run with a `RankError` that says so. When the
timeout expires, every rank is killed and `RankTimeout` names the ranks still running (reported or not), with the
Python stack of each one's threads where it hung: each rank registers `faulthandler` on SIGUSR1, writing to a file of
its own, and the launcher sends SIGUSR1 and waits a moment before killing. Every process is
joined before `launch_ranks` returns or raises.

Process trees. Each rank starts its own session (`os.setsid`), so the processes it starts (a shell command, DataLoader
workers) are in its process group; once the run is over (returned, failed or timed out), the launcher kills every
process group, so no child of a rank outlives `launch_ranks`.

Start method. Ranks are forked from a `forkserver`: a clean process started once per parent, which imports torch
once. A plain `spawn` re-imports torch in every rank, seconds per launch, where a fork from the forkserver costs
tens of milliseconds (docs/distributed.md, "Starting the ranks"). Plain `fork` of the caller is as cheap but unsafe:
a child forked after the parent used OpenMP hangs in its first multi-threaded op (torch 2.13 on the CPU), and a
child forked after CUDA initialization cannot use CUDA. The forkserver is neither: it never ran OpenMP or touched CUDA,
whatever the caller did, so CUDA-initialized callers are fine too. On machines without CUDA the server also imports
torch._dynamo and the module of `fn` (a test module, say, with everything it imports), which saves each rank those
imports. Where the platform has no forkserver (Windows) ranks are spawned. The server lives as long as the caller:
multiprocessing keeps it in the module multiprocessing.forkserver, which this module imports, so that a caller that
unloads the modules imported since some point (pytester's in-process runs do, after each run) keeps the server too,
instead of starting one more server, torch imported anew, at its next launch.
"""

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from lmsys.distributed import ddp, fsdp

if "forkserver" in multiprocessing.get_all_start_methods():
    import multiprocessing.forkserver  # noqa: F401 - holds the server: see the module's docstring

# NVLink multicast (NVLS) stays off: on the lent GPU machines it can take a shared server down.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_KILL_GRACE_S = 5.0
_FAILURE_GRACE_S = 1.0
# How long a hung rank is given to write its stacks after SIGUSR1, at most.
_DUMP_GRACE_S = 2.0


class RankError(RuntimeError):
    """A rank raised or died; `rank` is its number, `details` its traceback or exit status."""

    def __init__(self, rank: int, world_size: int, details: str):
        super().__init__(f"rank {rank} of {world_size} failed:\n{details}")
        self.rank = rank
        self.details = details


class RankTimeout(RankError):
    """The timeout expired; `ranks` were still running (they have been killed). `stacks` maps each of them to the
    Python stacks of its threads when it was stopped (faulthandler's dump), which the message includes; the message
    also says which of them (`reported`) had sent their result and were stuck exiting."""

    def __init__(self, ranks: list[int], world_size: int, timeout: float, stacks: dict[int, str] | None = None,
                 reported: list[int] = ()):
        details = f"ranks {ranks} of {world_size} still running after the {timeout:g} s timeout; all were killed"
        stacks = stacks or {}
        for rank in ranks:
            state = " (it had reported its result and was exiting)" if rank in reported else ""
            details += f"\n\nrank {rank} was here{state}:\n{stacks.get(rank) or '(it wrote no stack)'}"
        RuntimeError.__init__(self, details)
        self.rank, self.details, self.ranks, self.stacks = ranks[0], details, ranks, stacks


def default_backend(world_size: int) -> str:
    """NCCL when CUDA is available with at least `world_size` GPUs, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def init_process_group(backend: str | None = None) -> torch.device:
    """Initialize the default process group from torchrun's environment variables and return this rank's device.

    Call it at the top of rank code: under `launch_ranks` the group already exists and this only returns the device;
    under torchrun it initializes the group. `backend=None` picks NCCL when this rank has a GPU (LOCAL_RANK below the
    GPU count), else gloo. With NCCL, `torch.cuda.set_device(LOCAL_RANK)` is called and the device is
    `cuda:LOCAL_RANK`; with gloo it is the CPU.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if name not in os.environ]
        if missing:
            raise RuntimeError(f"init_process_group needs the environment torchrun sets; missing: {missing}")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and local_rank < torch.cuda.device_count() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            # device_id binds the group to this GPU: NCCL sets up eagerly and barriers need not guess the device.
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group(backend)
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def launch_ranks(
    fn: Callable,
    world_size: int,
    *args,
    backend: str | None = None,
    timeout: float = 300.0,
    **kwargs,
) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks with torch.distributed initialized; return each rank's result.

    `fn` must be importable by name (a module-level function) and its return value picklable. `backend=None` uses
    `default_backend(world_size)`. Raises `RankError` (the first rank that failed, with its traceback) or
    `RankTimeout` (after `timeout` seconds for the whole run, every rank killed). The ranks rendezvous through a
    TCPStore that the launcher hosts (MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True: see the module's docstring).
    They run with NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 unless already set,
    and, unless OMP_NUM_THREADS is set, with the CPU cores shared out between them (torchrun sets one thread each).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    backend = default_backend(world_size) if backend is None else backend
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend 'nccl' needs a GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")
    context = _context(fn)
    deadline = time.monotonic() + timeout
    return _run(context, fn, args, kwargs, world_size, backend, deadline, timeout)


def _context(fn: Callable) -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    preload = ["__main__", "torch", "torch.distributed"]
    # A module imported into the server could initialize CUDA (torch.cuda.is_available() at import does) and
    # poison every rank forked from it, so more is preloaded only where there is no CUDA at all: torch._dynamo
    # (torch.optim imports it when the first optimizer is built, over a second per rank: docs/distributed.md) and
    # fn's module.
    if not torch.cuda.is_available():
        preload += ["torch._dynamo"] + ([fn.__module__] if fn.__module__ != "__main__" else [])
    context.set_forkserver_preload(preload)  # takes effect only when the server starts (the first launch)
    return context


def _run(context, fn, args, kwargs, world_size, backend, deadline, timeout) -> list:
    # The ranks' store, on a port the kernel picks and the store holds until the ranks are gone: see the docstring.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environment = dict(os.environ)  # forkserver children would otherwise see the server's environment
    processes, connections = [], []
    stack_dir = tempfile.mkdtemp(prefix="lmsys-ranks-")
    stack_files = [os.path.join(stack_dir, f"rank{rank}.stacks") for rank in range(world_size)]
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main,
                args=(fn, args, kwargs, rank, world_size, store.port, backend, environment, sender, stack_files[rank]),
                name=f"rank{rank}",
                daemon=False,  # rank code may start processes of its own (DataLoader workers); _stop joins ranks
            )
            process.start()
            sender.close()
            processes.append(process)
            connections.append(receiver)
        return _collect(processes, connections, world_size, deadline, timeout, stack_files)
    finally:
        _stop(processes)
        for connection in connections:
            connection.close()
        shutil.rmtree(stack_dir, ignore_errors=True)
        del store  # the launcher holds the only reference: this stops the store's server


def _collect(processes, connections, world_size, deadline, timeout, stack_files) -> list:
    results: dict[int, object] = {}
    failures: list[tuple[int, int, str]] = []  # (kind: 0 died, 1 raised, 2 raised in a collective; rank; details)
    waiting = dict(enumerate(connections))  # ranks that have not reported yet
    exiting: set[int] = set()  # ranks that reported their result and have not exited yet
    while waiting or exiting:
        ready = multiprocessing.connection.wait(
            list(waiting.values()) + [processes[rank].sentinel for rank in sorted(set(waiting) | exiting)],
            timeout=max(deadline - time.monotonic(), 0),
        )
        if not ready and time.monotonic() >= deadline:
            break
        for rank in sorted(exiting):
            # A rank's result counts only once its process has exited cleanly: teardown (destroy_process_group,
            # the interpreter's exit) can still abort it.
            if processes[rank].sentinel in ready:
                exiting.discard(rank)
                processes[rank].join(_KILL_GRACE_S)
                if processes[rank].exitcode != 0:
                    failures.append((0, rank, _exit_status(processes[rank].exitcode, reported=True)))
                    if len(failures) == 1:
                        deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        for rank in sorted(waiting):
            connection = waiting[rank]
            # A rank that sent its result and exited has both its pipe and its sentinel ready: read the pipe first.
            if connection.poll():
                try:
                    status, payload = pickle.loads(connection.recv_bytes())
                except EOFError:
                    status, payload = "died", None
            elif processes[rank].sentinel in ready:
                status, payload = "died", None
            else:
                continue
            del waiting[rank]
            if status == "ok":
                results[rank] = pickle.loads(payload)
                exiting.add(rank)
            elif status == "error":
                details, in_collective = payload
                failures.append((2 if in_collective else 1, rank, details))
            else:
                processes[rank].join(_KILL_GRACE_S)
                failures.append((0, rank, _exit_status(processes[rank].exitcode)))
            if len(failures) == 1 and status != "ok":
                # The peers of a failed rank fail next in their collectives: wait a moment for them, then report
                # the root cause (a death, else an error raised outside torch.distributed) and not its echo.
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    if failures:
        _, rank, details = min(failures)
        others = sorted(r for _, r, _ in failures if r != rank)
        raise RankError(rank, world_size, details + (f"\n(ranks {others} failed as well)" if others else ""))
    if waiting or exiting:
        hung = sorted(set(waiting) | exiting)
        stacks = _dump_stacks([processes[rank] for rank in hung], [stack_files[rank] for rank in hung])
        raise RankTimeout(hung, world_size, timeout, stacks, reported=sorted(exiting))
    return [results[rank] for rank in range(world_size)]


def _dump_stacks(processes, stack_files) -> dict[int, str]:
    """Ask each process (rank) for its Python stacks (SIGUSR1, which faulthandler answers from inside the signal
    handler, wherever the rank is stuck) and return what each wrote, by rank, once the files stop growing or after
    _DUMP_GRACE_S."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)
    stacks, end = {}, time.monotonic() + _DUMP_GRACE_S
    while time.monotonic() < end:
        time.sleep(0.1)
        now = {int(process.name.removeprefix("rank")): _read(path) for process, path in zip(processes, stack_files)}
        if all(now.values()) and now == stacks:
            break
        stacks = now
    return stacks


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except FileNotFoundError:
        return ""


def _signal_group(process, signum) -> None:
    """Send `signum` to the process group of the rank `process` (the rank and every process it started); to the
    rank alone if it has no group of its own yet (it was stopped before its first line)."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        if process.is_alive():
            os.kill(process.pid, signum)


def _stop(processes) -> None:
    """Terminate the ranks still running, kill those that ignore it, and join every one (no zombies); then kill what
    is left of each rank's process group (the processes it started)."""
    for process in processes:
        if process.is_alive():
            _signal_group(process, signal.SIGTERM)
    for process in processes:
        process.join(_KILL_GRACE_S)
        if process.is_alive():
            _signal_group(process, signal.SIGKILL)
            process.join()
    for process in processes:
        if process.pid is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _exit_status(exitcode: int | None, reported: bool = False) -> str:
    """How a rank ended: `reported` says it had sent its result before it ended that way."""
    if exitcode is not None and exitcode < 0:
        how = f"died from signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
    else:
        how = f"exited with code {exitcode}"
    return f"reported its result, then {how} while exiting" if reported else f"{how} without reporting a result"


def _rank_main(fn, args, kwargs, rank, world_size, port, backend, environment, sender, stack_file) -> None:
    """Body of a rank process: its own session (the launcher kills its process group), its stacks on SIGUSR1 into
    `stack_file` until it exits, environment, torch.distributed's process group, `fn`, then (status, payload) down the
    pipe."""
    os.setsid()
    stacks = open(stack_file, "w")  # noqa: SIM115 - faulthandler writes to it until the rank exits
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the launcher hosts the store on MASTER_PORT: ranks are its clients
    )
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)
    if "OMP_NUM_THREADS" not in environment:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_process_group(backend)
        result = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(result)
        except Exception as error:
            raise TypeError(f"the return value of {fn.__qualname__} on rank {rank} cannot be pickled") from error
        _send(sender, "ok", payload)
    except BaseException as error:
        # An error raised inside torch.distributed is most often the echo of a peer's failure.
        last_file = traceback.extract_tb(error.__traceback__)[-1].filename
        in_collective = os.path.join("torch", "distributed") in last_file
        _send(sender, "error", (traceback.format_exc(), in_collective))
    finally:
        if dist.is_initialized():
            # A collective pending when the group goes can abort the rank.
            ddp.wait_for_pending_work()
            fsdp.wait_for_pending_work()
            dist.destroy_process_group()
        sender.close()
        # faulthandler stays registered, its file open, until the process is gone: a rank stuck in its exit (a
        # finalizer, a child it joins) still answers SIGUSR1 with its stacks.


def _send(sender, status: str, payload) -> None:
    sender.send_bytes(pickle.dumps((status, payload)))


__all__ = ["NO_MULTICAST_ENV", "RankError", "RankTimeout", "default_backend", "init_process_group", "launch_ranks"]
