"""pytest-benchmark's file storage, with saves made atomic and never-overwriting (baselines.save_new), and results of
failed tests left out of a saved baseline.

pytest-benchmark writes a result by opening NNNN_name.json and writing into it, so an interrupted save leaves a
truncated file that the next --benchmark-compare would read. Everything else (the JSON itself, its hooks) stays
pytest-benchmark's; `save` is replaced, and the folder is only created by a save.
"""

from collections.abc import Callable
from pathlib import Path

from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import safe_dumps

from lmsys.perf import baselines


class BaselineStorage(FileStorage):
    """A FileStorage whose saves go through baselines.save_new into <storage>/<machine id>/.

    `leave_out(fullname)` says which benchmarks a save must not include (those whose test failed). After the save,
    `saved` is the file written (None when nothing was), `left_out` the benchmarks not in it, and `error` why the
    save failed, if it did.
    """

    def __init__(self, path: Path, logger, machine_id: str, leave_out: Callable[[str], bool]):
        # Not FileStorage.__init__, which creates the folder: a run that saves nothing must leave no folder behind.
        self.path = Path(path).resolve()
        self.default_machine_id = machine_id
        self.logger = logger
        self._cache = {}
        self.leave_out = leave_out
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
        are. Writes nothing when every benchmark is left out."""
        kept = [bench for bench in output_json["benchmarks"] if not self.leave_out(bench["fullname"])]
        self.left_out = [bench["fullname"] for bench in output_json["benchmarks"] if self.leave_out(bench["fullname"])]
        if not kept:
            return
        text = safe_dumps({**output_json, "benchmarks": kept}, ensure_ascii=True, indent=4)
        try:
            self.saved = baselines.save_new(self.path / self.default_machine_id, save, text)
        except (OSError, ValueError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.logger.info(f"Saved benchmark data in: {self.saved}")
