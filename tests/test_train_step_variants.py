"""A smoke test of scripts/train_step_variants.py on the CPU (the GPU run is the lead's): it runs its variants on a
tiny model and writes one CSV row per size and variant. The first test compiles with aot_eager (dynamo and AOT
autograd, as inductor would); the others check the script's bookkeeping and compile with dynamo alone ("eager")."""

import csv
import pathlib
import runpy
import types

import pytest
import torch

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "train_step_variants.py"


def test_writes_a_row_per_variant(tmp_path, capsys, seed):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "variants.csv"
    # Two variants on one model: one compilation, reused by the second.
    main([str(out), "--sizes", "tiny", "--variants", "ours-torch-adamw", "ours", "--warmup", "1",
          "--steps", "2", "--batch", "1", "--context", "16", "--compile-backend", "aot_eager", "--top", "3"])
    rows = list(csv.DictReader(out.open()))
    assert [(r["size"], r["variant"]) for r in rows] == [("tiny", "ours-torch-adamw"), ("tiny", "ours")]
    assert all(float(r["median_ms"]) > 0 and float(r["loop_ms"]) > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "| tiny | ours | " in printed
    assert printed.count("one step's top 3 operators") == 2


def test_interleaved_rounds_and_ours_beside_plain(tmp_path, capsys, seed):
    """--rounds: the plain model and ours held together, timed in turns; each of ours printed beside plain PyTorch."""
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "variants.csv"
    main([str(out), "--sizes", "tiny", "--variants", "reference", "ours", "ours-unplanned", "--warmup", "1",
          "--steps", "1", "--rounds", "2", "--batch", "1", "--context", "16", "--compile-backend", "eager"])
    rows = list(csv.DictReader(out.open()))
    assert [r["variant"] for r in rows] == ["reference", "ours", "ours-unplanned"]
    assert all(float(r["median_ms"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["loop_ms"]) > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "in each of 2 interleaved rounds" in printed
    assert "| tiny | ours | reference |" in printed and "| tiny | ours-unplanned | reference |" in printed


def test_fused_loss_and_bf16_weights_variants_run_beside_ours(tmp_path, capsys, seed):
    main = runpy.run_path(str(SCRIPT))["main"]
    out = tmp_path / "variants.csv"
    # The two options together wire both through the script; tests/test_train.py checks each option's step.
    variants = ["reference", "ours", "ours-bf16-weights-fused-loss"]
    main([str(out), "--sizes", "tiny", "--variants", *variants, "--warmup", "1",
          "--steps", "2", "--batch", "1", "--context", "16", "--compile-backend", "aot_eager"])
    rows = list(csv.DictReader(out.open()))
    assert [r["variant"] for r in rows] == variants
    assert all(float(r["median_ms"]) > 0 and not r["error"] for r in rows)
    printed = capsys.readouterr().out
    for name in variants[1:]:
        assert f"| tiny | {name} | reference |" in printed


def test_loop_time_is_per_step_of_steps_issued_back_to_back(monkeypatch):
    """loop_ms times the `steps` steps as one call of the gate's clock and divides by them."""
    loop_ms = runpy.run_path(str(SCRIPT))["loop_ms"]
    calls = []

    class Clock:
        def time_call(self, call):
            call()
            return 0.5  # seconds, for the whole call

    monkeypatch.setitem(loop_ms.__globals__, "sweep", types.SimpleNamespace(backend=Clock))
    assert loop_ms(calls.append, (7,), 5) == 100.0
    assert calls == [7] * 5


def test_each_cuda_graph_variant_gets_a_model_of_its_own(tmp_path):
    """Two CUDA-graph variants of one model class and attention are two groups (their graphs' memory pools go with
    their models); the variants without graphs share one."""
    main, groups = runpy.run_path(str(SCRIPT))["main"], []
    main.__globals__["run_group"] = lambda size, names, *rest, **kwargs: groups.append(names)
    main([str(tmp_path / "x.csv"), "--sizes", "tiny", "--variants", "ours", "ours-fused-loss", "ours-cuda-graphs",
          "ours-fused-loss-cuda-graphs"])
    assert groups == [["ours", "ours-fused-loss"], ["ours-cuda-graphs"], ["ours-fused-loss-cuda-graphs"]]


def test_rejects_an_unknown_variant(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.csv"), "--variants", "fastest"])


def test_out_of_memory_is_a_row_and_the_sweep_goes_on(tmp_path, capsys, seed):
    main = runpy.run_path(str(SCRIPT))["main"]
    real = main.__globals__["make_train_step"]

    def make_train_step(model, optimizer, **options):
        if isinstance(optimizer, main.__globals__["AdamW"]):  # the `ours` variant
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 76.00 MiB.")
        return real(model, optimizer, **options)

    main.__globals__["make_train_step"] = make_train_step
    out = tmp_path / "variants.csv"
    main([str(out), "--sizes", "tiny", "--variants", "ours", "ours-torch-adamw", "--warmup", "1", "--steps", "1",
          "--batch", "1", "--context", "16", "--compile-backend", "eager"])
    rows = list(csv.DictReader(out.open()))
    assert [(r["variant"], r["error"]) for r in rows] == [("ours", "out of memory"), ("ours-torch-adamw", "")]
    assert float(rows[1]["median_ms"]) > 0
    assert "| tiny | ours | out of memory |" in capsys.readouterr().out


def test_a_failing_variant_is_a_row_and_fails_the_run(tmp_path):
    main = runpy.run_path(str(SCRIPT))["main"]

    def make_train_step(model, optimizer, **options):
        raise RuntimeError("inductor fell over\nsecond line")

    main.__globals__["make_train_step"] = make_train_step
    out = tmp_path / "variants.csv"
    with pytest.raises(SystemExit, match="1 variant\\(s\\) failed: tiny ours"):
        main([str(out), "--sizes", "tiny", "--variants", "ours", "--warmup", "1", "--steps", "1", "--batch", "1",
              "--context", "16", "--compile-backend", "eager"])
    assert [r["error"] for r in csv.DictReader(out.open())] == ["RuntimeError: inductor fell over"]


def test_bf16_weight_variants_get_models_of_their_own(tmp_path):
    """A variant that converts its model's Linear weights to bf16 does not share the model of the fp32 variants."""
    main, groups = runpy.run_path(str(SCRIPT))["main"], []
    main.__globals__["run_group"] = lambda size, names, *rest, **kwargs: groups.append(names)
    main([str(tmp_path / "x.csv"), "--sizes", "tiny", "--variants", "ours", "ours-bf16-weights", "ours-fused-loss",
          "ours-bf16-weights-cuda-graphs", "ours-bf16-weights-fused-loss", "ours-bf16-weights-fused-loss-cuda-graphs"])
    assert groups == [["ours", "ours-fused-loss"], ["ours-bf16-weights"], ["ours-bf16-weights-cuda-graphs"],
                      ["ours-bf16-weights-fused-loss"], ["ours-bf16-weights-fused-loss-cuda-graphs"]]


def test_max_autotune_variants_are_printed_beside_the_max_autotune_reference():
    """A variant compiled with max-autotune is compared with the plain step compiled the same way, the others with
    the plain step of their CUDA-graph setting."""
    module = runpy.run_path(str(SCRIPT))
    names = ["reference-cuda-graphs", "reference-max-autotune-cuda-graphs", "ours-bf16-weights-cuda-graphs",
             "ours-bf16-weights-max-autotune-cuda-graphs", "ours-bf16-weights-fused-loss-max-autotune-cuda-graphs"]
    assert all(module["VARIANTS"][name].options.get("cuda_graphs") for name in names)
    rows = [dict(size="2.7B", variant=name, median_ms=100.0 + index, loop_ms=99.0 + index, tokens_per_s=1000,
                 mfu=0.4, error="") for index, name in enumerate(names)]
    printed = module["beside_reference"](rows)
    assert "| 2.7B | ours-bf16-weights-cuda-graphs | reference-cuda-graphs | 100.00 | 102.00 |" in printed
    for name in names[3:]:
        assert f"| 2.7B | {name} | reference-max-autotune-cuda-graphs | 101.00 |" in printed


