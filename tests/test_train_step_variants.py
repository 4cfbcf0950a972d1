"""A smoke test of scripts/train_step_variants.py on the CPU (the GPU run is the lead's): it runs its variants on a
tiny model and writes one CSV row per size and variant."""

import csv
import pathlib
import runpy

import pytest

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "train_step_variants.py"


def test_writes_a_row_per_variant(tmp_path, capsys, seed):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "variants.csv"
    # Two variants on one model: one compilation, reused by the second.
    main([str(out), "--sizes", "tiny", "--variants", "ours-torch-adamw", "ours", "--warmup", "1",
          "--steps", "2", "--batch", "1", "--context", "16", "--compile-backend", "aot_eager", "--top", "3"])
    rows = list(csv.DictReader(out.open()))
    assert [(r["size"], r["variant"]) for r in rows] == [("tiny", "ours-torch-adamw"), ("tiny", "ours")]
    assert all(float(r["median_ms"]) > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "| tiny | ours | " in printed
    assert printed.count("one step's top 3 operators") == 2


def test_rejects_an_unknown_variant(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.csv"), "--variants", "fastest"])
