"""pytest-benchmark's file storage, with saves made atomic and never-overwriting (baselines.save_new), and results of
failed tests left out of a saved baseline.

pytest-benchmark writes a result by opening NNNN_name.json and writing into it, so an interrupted save leaves a
truncated file that the next --benchmark-compare would read. Everything else (the JSON itself, its hooks) stays
pytest-benchmark's; `save` is replaced, and the folder is only created by a save. Only the gate's benchmarks (those of
gpu_benchmark tests) are its business: a run's plain pytest-benchmark results go to pytest-benchmark's own storage,
as pytest-benchmark would have saved them.
"""

from collections.abc import Callable
from pathlib import Path

from typing import Any

from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import safe_dumps

from lmsys.perf import baselines


class BaselineStorage(FileStorage):
    """A FileStorage whose saves go through baselines.save_new into <storage>/<machine id>/.

    `leave_out(fullname)` says which benchmarks a save must not include (those whose test failed). After the save,
    `saved` is the file written (None when nothing was), `left_out` the benchmarks not in it, and `error` why the
    save failed, if it did.

    `gated(fullname)` says which benchmarks are the gate's; the others (plain pytest-benchmark tests of the same run)
    go to `plain`, pytest-benchmark's own storage, through its own save, with their raw data only when
    `plain_data` (pytest-benchmark's --benchmark-save-data) asks for it.
    """

    def __init__(self, path: Path, logger, machine_id: str, leave_out: Callable[[str], bool],
                 gated: Callable[[str], bool] = lambda fullname: True, plain: Any = None, plain_data: bool = False):
        # Not FileStorage.__init__, which creates the folder: a run that saves nothing must leave no folder behind.
        self.path = Path(path).resolve()
        self.default_machine_id = machine_id
        self.logger = logger
        self._cache = {}
        self.leave_out = leave_out
        self.gated = gated
        self.plain = plain
        self.plain_data = plain_data
        self.saved: Path | None = None
        self.left_out: list[str] = []
        self.error: str | None = None

    @property
    def location(self) -> str:
        """The storage path relative to the working directory when it is below it, else absolute."""
        try:
            return str(self.path.relative_to(Path.cwd()))
        except ValueError:
            return str(self.path)

    def save(self, output_json: dict, save: str) -> None:
        """Writes a new baseline file for this machine, without the left-out benchmarks; existing files stay as they
        are. Writes nothing when every benchmark is left out. The plain benchmarks go to pytest-benchmark's storage."""
        ours = [bench for bench in output_json["benchmarks"] if self.gated(bench["fullname"])]
        plain = [bench for bench in output_json["benchmarks"] if not self.gated(bench["fullname"])]
        if plain and self.plain is not None:
            self.plain.save({**output_json, "benchmarks": [self._plain_entry(bench) for bench in plain]}, save)
        kept = [bench for bench in ours if not self.leave_out(bench["fullname"])]
        self.left_out = [bench["fullname"] for bench in ours if self.leave_out(bench["fullname"])]
        if not kept:
            return
        text = safe_dumps({**output_json, "benchmarks": kept}, ensure_ascii=True, indent=4)
        try:
            self.saved = baselines.save_new(self.path / self.default_machine_id, save, text)
        except (OSError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.logger.info(f"Saved benchmark data in: {self.saved}")

    def _plain_entry(self, bench: dict) -> dict:
        """A plain benchmark's entry as pytest-benchmark saves it: its raw timings only with --benchmark-save-data
        (the gate's saves always keep them)."""
        if self.plain_data:
            return bench
        return {**bench, "stats": {key: value for key, value in bench["stats"].items() if key != "data"}}
