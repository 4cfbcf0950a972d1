"""pytest-benchmark's file storage, with saves made atomic and never-overwriting (baselines.save_new).

pytest-benchmark writes a result by opening NNNN_name.json and writing into it, so an interrupted save leaves a
truncated file that the next --benchmark-compare would read. Everything else (numbering of loads, globs, loading,
the JSON itself) stays pytest-benchmark's; only `save` and `location` are replaced.
"""

from pathlib import Path

from pytest_benchmark.storage.file import FileStorage
from pytest_benchmark.utils import safe_dumps

from lmsys.perf import baselines


class BaselineStorage(FileStorage):
    """A FileStorage whose saves go through baselines.save_new into <storage>/<machine id>/."""

    @property
    def location(self) -> str:
        """The storage path relative to the working directory when it is below it, else absolute."""
        try:
            return str(self.path.relative_to(Path.cwd()))
        except ValueError:
            return str(self.path)

    def save(self, output_json: dict, save: str) -> None:
        """Writes a new baseline file for this machine; existing files stay as they are."""
        text = safe_dumps(output_json, ensure_ascii=True, indent=4)
        path = baselines.save_new(self.path / self.default_machine_id, save, text)
        self.logger.info(f"Saved benchmark data in: {path}")
