"""scripts/attention_backward_variants.py on a machine without a Hopper GPU: it says what it needs and exits with 2
(the timings are the GPU's to take), and refuses an output it would overwrite."""

import pathlib
import runpy

import pytest
import torch

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "attention_backward_variants.py"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0), reason="a Hopper GPU")
def test_needs_a_hopper_gpu(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    assert main([str(tmp_path / "variants.csv"), "--points", "leaderboard"]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err
    assert not (tmp_path / "variants.csv").exists()


def test_refuses_an_existing_output_and_an_unknown_variant(tmp_path, capsys):
    main = runpy.run_path(str(SCRIPT))["main"]
    existing = tmp_path / "variants.csv"
    existing.write_text("kept\n")
    with pytest.raises(SystemExit):
        main([str(existing)])
    assert "give a new file ending in .csv" in capsys.readouterr().err
    assert existing.read_text() == "kept\n"
    with pytest.raises(SystemExit):
        main([str(tmp_path / "new.csv"), "--variants", "nope"])
