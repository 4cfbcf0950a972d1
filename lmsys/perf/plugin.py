"""pytest hooks and options of the regression gate (registered through the `pytest11` entry point)."""
