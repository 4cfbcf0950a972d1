"""lmsys: language-model systems code and a GPU performance regression suite."""

__version__ = "0.1.0"
