"""Per-GPU config pins of the Triton attention kernels (lmsys.attention.tuned), on the CPU.

The kernels run under the Triton interpreter (tests/conftest.py), where each has one config and no benchmarker: here
each autotuner gets three candidate configs the interpreter runs, a stand-in for its timing (`FakeBench`: no kernel
runs, a time per config) and a fake GPU name, so that flash_triton's pruning hook looks up a table as on a GPU.
"""

import json
import os
import runpy
from pathlib import Path

import pytest
import torch
import triton

from lmsys.attention import flash_triton, launcher, tuned
from lmsys.attention.naive import naive_attention

GPU = "Test GPU 80GB"
GPU_NAME = tuned.gpu_name
SHAPE = (1, 2, 64, 16)  # n = 64: the pruning keeps one config of each tile height, all three below


def _fwd(block_m):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": 16, "USE_TMA": False}, num_warps=4, num_stages=1)


def _bwd(block_big):
    return triton.Config({"BLOCK_BIG": block_big, "BLOCK_M1": 16, "BLOCK_N2": 16}, num_warps=4, num_stages=1)


# kernel name -> (the autotuner, its candidate configs by tile height, the tile's name)
KERNELS = {
    "_flash_fwd_kernel": (flash_triton._flash_fwd_kernel, {h: _fwd(h) for h in (16, 32, 64)}, "BLOCK_M"),
    "_flash_bwd_kernel": (flash_triton._flash_bwd_kernel, {h: _bwd(h) for h in (16, 32, 64)}, "BLOCK_BIG"),
}


class FakeBench:
    """The autotuner's `_bench`: records each config it is asked to time and returns its time from `times` (tile height
    -> ms), running nothing."""

    def __init__(self, rows, times):
        self.rows, self.times, self.timed = rows, times, []

    def __call__(self, *args, config, **meta):
        self.timed.append(config)
        return [self.times[config.kwargs[self.rows]]] * 3


@pytest.fixture
def kernels(monkeypatch, tmp_path):
    """Both autotuners with three candidates each, fresh caches and fake timings (the autotuner alone picks height 32);
    tables read from tmp_path; the launch checks' memory of earlier tests' grids forgotten (the tile height here
    differs between tests at the same launch key). Yields kernel name -> FakeBench."""
    benches = {}
    for name, (kernel, configs, rows) in KERNELS.items():
        monkeypatch.setattr(kernel, "configs", list(configs.values()))
        monkeypatch.setattr(kernel, "cache", {})
        benches[name] = FakeBench(rows, {16: 3.0, 32: 1.0, 64: 2.0})
        monkeypatch.setattr(kernel, "_bench", benches[name])
    monkeypatch.setattr(launcher, "_checked", {})
    monkeypatch.setattr(tuned, "FOLDER", tmp_path)
    monkeypatch.setattr(tuned, "gpu_name", lambda named_args: GPU)
    monkeypatch.delenv(tuned.ENV, raising=False)
    tuned.load.cache_clear()
    tuned._stale.cache_clear()
    yield benches
    tuned.load.cache_clear()
    tuned._stale.cache_clear()


def _run(name, causal=True):
    """The forward (or forward and backward) whose launch autotunes `name`, checked against float64 naive attention.
    It runs CPU tensors under the Triton interpreter: on a machine with CUDA, where the kernels are compiled and CPU
    tensors refused, the test skips."""
    if not flash_triton._INTERPRET:
        pytest.skip("runs the kernels on CPU tensors under the Triton interpreter (a machine without CUDA)")
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(SHAPE, generator=gen) for _ in range(4))
    o, lse = flash_triton.forward(q, k, v, causal)
    ref = naive_attention(*(x.double() for x in (q, k, v)), causal)
    torch.testing.assert_close(o.double(), ref, atol=1e-4, rtol=1e-4)
    if name == "_flash_bwd_kernel":
        dq, dk, dv = flash_triton.backward(q, k, v, o, lse, do, causal)
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        expected = torch.autograd.grad(naive_attention(*leaves, causal), leaves, do.double())
        for got, want in zip((dq, dk, dv), expected, strict=True):
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def _key(name, causal=True):
    """The key record of the test shape's launch of `name` (fp32)."""
    dtypes = ["torch.float32"] * (5 if name == "_flash_fwd_kernel" else 9)
    if name == "_flash_bwd_kernel" and causal:
        dtypes.append("torch.int8")  # the rows' marks (flash_triton.GUARD_MASKED)
    return {"N_BUCKET": SHAPE[2], "HEAD_DIM": SHAPE[3], "HEAD_DIM1": 0, "CAUSAL": causal, "dtypes": dtypes}


def _table(name, config, key=None, fingerprint=None):
    kernel = KERNELS[name][0]
    pins = [{"key": key or _key(name), "config": tuned.config_record(config)}]
    return {"schema": tuned.SCHEMA, "device": GPU,
            "kernels": {name: {"fingerprint": fingerprint or tuned.fingerprint(kernel), "pins": pins}}}


def _save(tmp_path, table):
    (tmp_path / tuned.device_file_name(GPU)).write_text(json.dumps(table))


def _timed_heights(bench):
    return [c.kwargs[bench.rows] for c in bench.timed]


@pytest.mark.parametrize("name", KERNELS)
def test_a_pin_is_the_only_config_timed(kernels, tmp_path, name):
    """With a table pinning height 64 at this key, the autotuner times that config alone and runs it (its own pick
    would be 32), and keeps it under the key that `tuned.call_key` made: the layout of triton's key."""
    kernel, configs, rows = KERNELS[name]
    _save(tmp_path, _table(name, configs[64]))
    _run(name)
    assert _timed_heights(kernels[name]) == [64]
    assert kernel.best_config == configs[64]
    assert [tuned.key_record(kernel, key) for key in kernel.cache] == [_key(name)]


@pytest.mark.parametrize("name", KERNELS)
def test_without_a_table_the_autotuner_times_every_candidate(kernels, name):
    _run(name)
    assert _timed_heights(kernels[name]) == [16, 32, 64]
    assert KERNELS[name][0].best_config == KERNELS[name][1][32]


def test_a_pin_for_another_fingerprint_warns_and_autotunes(kernels, tmp_path):
    _save(tmp_path, _table("_flash_fwd_kernel", KERNELS["_flash_fwd_kernel"][1][64], fingerprint="0" * 16))
    with pytest.warns(UserWarning, match="another version of its source or configs"):
        _run("_flash_fwd_kernel")
    assert _timed_heights(kernels["_flash_fwd_kernel"]) == [16, 32, 64]


def test_the_fingerprint_follows_the_candidate_configs(kernels, monkeypatch):
    """A pin made for another list of candidates is ignored: the list is part of the fingerprint."""
    kernel, configs, _ = KERNELS["_flash_fwd_kernel"]
    before = tuned.fingerprint(kernel)
    monkeypatch.setattr(kernel, "configs", [configs[16], configs[64], configs[32]])
    assert tuned.fingerprint(kernel) != before


def test_the_fingerprint_covers_the_functions_the_kernel_calls():
    sources = dict(tuned._sources(flash_triton._flash_fwd_kernel.base_fn))
    assert {"lmsys.attention.flash_triton._fwd_inner", "lmsys.attention.flash_triton._load_rows",
            "lmsys.attention.launch_order.program_position", "lmsys.attention.flash_triton:MASKED"} <= set(sources)
    assert sources["lmsys.attention.flash_triton._fwd_inner"].lstrip().startswith("@triton.jit\ndef _fwd_inner(")


def test_pins_off_by_the_environment(kernels, tmp_path, monkeypatch):
    _save(tmp_path, _table("_flash_fwd_kernel", KERNELS["_flash_fwd_kernel"][1][64]))
    monkeypatch.setenv(tuned.ENV, "0")
    _run("_flash_fwd_kernel")
    assert _timed_heights(kernels["_flash_fwd_kernel"]) == [16, 32, 64]


@pytest.mark.parametrize("pinned", [
    pytest.param(_fwd(128), id="pruned"),  # taller than the problem: the pruning drops it
    pytest.param(triton.Config({"BLOCK_M": 64, "BLOCK_N": 16, "USE_TMA": False}, num_warps=4, num_stages=1,
                               maxnreg=128), id="not-a-candidate"),
])
def test_a_pin_that_is_not_a_candidate_is_ignored(kernels, tmp_path, pinned):
    _save(tmp_path, _table("_flash_fwd_kernel", pinned))
    _run("_flash_fwd_kernel")
    assert _timed_heights(kernels["_flash_fwd_kernel"]) == [16, 32, 64]


def test_a_pin_at_another_key_is_ignored(kernels, tmp_path):
    _save(tmp_path, _table("_flash_fwd_kernel", KERNELS["_flash_fwd_kernel"][1][64], key=_key("_flash_fwd_kernel")))
    _run("_flash_fwd_kernel", causal=False)
    assert _timed_heights(kernels["_flash_fwd_kernel"]) == [16, 32, 64]


def test_pins_apply_only_on_a_gpu(kernels, tmp_path, monkeypatch):
    """CPU tensors (the interpreter) never look up a table, whatever the GPU's table says."""
    monkeypatch.setattr(tuned, "gpu_name", GPU_NAME)
    _save(tmp_path, _table("_flash_fwd_kernel", KERNELS["_flash_fwd_kernel"][1][64]))
    _run("_flash_fwd_kernel")
    assert _timed_heights(kernels["_flash_fwd_kernel"]) == [16, 32, 64]
    assert tuned.gpu_name({"N_Q": 1}) is None


@pytest.mark.parametrize("text, problem", [
    ("{not json", "malformed"),
    (json.dumps({"schema": 99, "kernels": {}}), "expected schema 1, found 99"),
    (json.dumps({"schema": 1, "kernels": {"_flash_fwd_kernel": {"fingerprint": "x", "pins": [
        {"key": {"dtypes": []}, "config": {"kwargs": {}, "num_warps": 4}}]}}}), "exactly the fields"),
    (json.dumps({"schema": 1, "kernels": {"_flash_fwd_kernel": {"pins": []}}}), "'fingerprint' string"),
], ids=["json", "schema", "config", "fingerprint"])
def test_an_unreadable_table_warns_naming_the_file_and_autotunes(kernels, tmp_path, text, problem):
    path = tmp_path / tuned.device_file_name(GPU)
    path.write_text(text)
    with pytest.warns(UserWarning, match=problem) as caught:
        _run("_flash_fwd_kernel")
    assert str(path) in str(caught[0].message)
    assert _timed_heights(kernels["_flash_fwd_kernel"]) == [16, 32, 64]


@pytest.mark.parametrize("name", KERNELS)
def test_export_round_trips(kernels, tmp_path, monkeypatch, name):
    """The autotuner's choices, written as a table (pins off, as an export runs), are what a fresh autotuner then runs
    alone, whatever its timings say."""
    kernel, configs, rows = KERNELS[name]
    monkeypatch.setenv(tuned.ENV, "0")
    _run(name)
    assert kernel.best_config == configs[32]
    path = tuned.table_path(GPU)
    tuned.write(path, tuned.merged(None, GPU, {name: tuned.kernel_entry(kernel)}))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    monkeypatch.setenv(tuned.ENV, "1")
    monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(kernel, "_bench", FakeBench(rows, {16: 1.0, 32: 3.0, 64: 2.0}))
    monkeypatch.setattr(launcher, "_checked", {})
    _run(name)
    assert _timed_heights(kernel._bench) == [32]
    assert kernel.best_config == configs[32]


def test_merge_keeps_other_pins_of_the_same_fingerprint_and_replaces_another():
    def entry(fingerprint, *heights):
        return {"fingerprint": fingerprint, "pins": [
            {"key": {"N_BUCKET": h, "dtypes": []}, "config": tuned.config_record(_fwd(h))} for h in heights]}

    table = tuned.merged(None, GPU, {"a": entry("f1", 16, 32), "b": entry("g", 16)})
    table = tuned.merged(table, GPU, {"a": entry("f1", 32, 64)})
    assert table["kernels"]["a"] == entry("f1", 16, 32, 64)
    assert table["kernels"]["b"] == entry("g", 16)
    table = tuned.merged(table, GPU, {"a": entry("f2", 64)})
    assert table["kernels"]["a"] == entry("f2", 64)
    tuned._parse(table)


def test_export_refuses_to_overwrite_a_malformed_table(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{")
    with pytest.raises(SystemExit, match=f"{path} is not a valid attention config table"):
        tuned._read_existing(path)


def test_a_config_round_trips_through_its_record():
    config = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "USE_TMA": True}, num_warps=8, num_stages=2, maxnreg=128)
    back = tuned.config_from(json.loads(json.dumps(tuned.config_record(config))))
    assert back == config and back.num_ctas == config.num_ctas
    with pytest.raises(ValueError, match="pre_hook"):
        tuned.config_record(triton.Config({}, pre_hook=print))


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB", " A/B (x) "])
def test_tables_are_named_as_the_baseline_folders(name):
    from lmsys.perf.baselines import machine_id

    assert tuned.device_file_name(name) == machine_id(name, is_gpu=True) + ".json"


def test_the_default_shapes_are_the_perf_suites():
    """DEFAULT_SHAPES names the perf suite's default points of flash_triton: its constants hold the same shapes."""
    from perf_tests import test_attention as suite

    shapes = {(shape, causal) for shape, causal, _ in tuned.DEFAULT_SHAPES}
    assert set(suite.TRAINING_DEFAULT) <= shapes
    assert (suite.ANCHOR_SHAPES[0][0], suite.ANCHOR_SHAPES[0][1]) in shapes
    assert (suite.LAUNCH_SHAPE, True) in shapes


def _committed():
    return sorted(tuned.FOLDER.glob("*.json")) or [pytest.param(None, marks=pytest.mark.skip(reason="no table"))]


@pytest.mark.parametrize("path", _committed(), ids=lambda p: getattr(p, "name", "none"))
def test_committed_tables_parse_and_pin_candidate_configs(path, monkeypatch):
    """Each committed table reads, and pins only configs among its kernel's candidates on a GPU."""
    monkeypatch.setattr(flash_triton, "_INTERPRET", False)
    candidates = {"_flash_fwd_kernel": flash_triton._fwd_configs(), "_flash_bwd_kernel": flash_triton._bwd_configs()}
    for name, pins in tuned._parse(json.loads(path.read_text())).items():
        assert all(config in candidates[name] for config in pins.configs.values()), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU")
def test_the_tuning_sweep_turns_pins_off(tmp_path, monkeypatch):
    """scripts/attention_tuning_sweep.py compares the autotuner's own choices: it sets LMSYS_ATTENTION_PINS=0 (before
    it finds no GPU here)."""
    monkeypatch.delenv(tuned.ENV, raising=False)
    sweep = runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "attention_tuning_sweep.py"))
    assert sweep["main"]([str(tmp_path / "t.csv")]) == 2
    assert os.environ.get(tuned.ENV) == "0"


def test_the_command_prints_a_table(tmp_path, capsys):
    path = tmp_path / "t.json"
    tuned.write(path, tuned.merged(None, GPU, {"_flash_fwd_kernel": {"fingerprint": "f", "pins": [
        {"key": _key("_flash_fwd_kernel"), "config": tuned.config_record(_fwd(32))}]}}))
    assert tuned.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "N_BUCKET=64 HEAD_DIM=16 HEAD_DIM1=0 CAUSAL=True float32/float32" in out
    assert "BLOCK_M=32 BLOCK_N=16 USE_TMA=False num_warps=4 num_stages=1 num_ctas=1" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU")
def test_the_export_needs_a_gpu(capsys):
    assert tuned.main(["--export"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ choices per pass


def _cuda_query(shape=(4, 8, 1024, 64)):
    """A stand-in for a query tensor on GPU 0 (what measured_choice reads: its device and shape), made without CUDA."""
    return type("Query", (), {"device": torch.device("cuda", 0), "shape": shape})()


def _choices(part, *entries, fingerprint=None):
    return {"fingerprint": fingerprint or tuned.choice_fingerprint(part),
            "choices": [{"key": tuned.bucket(*key), "choice": choice} for key, choice in entries]}


@pytest.fixture
def gpu_table(kernels, monkeypatch):
    """Tables read from tmp_path for the fake GPU that GPU 0 is."""
    monkeypatch.setattr(tuned, "_device_name", lambda index: GPU)
    tuned.load_choices.cache_clear()
    tuned._stale_choices.cache_clear()
    yield
    tuned.load_choices.cache_clear()
    tuned._stale_choices.cache_clear()


@pytest.mark.parametrize("keys, per_sm, bucket_keys, bucket_per_sm", [
    (1024, 31.0, 1024, 16.0), (1000, 16.0, 1024, 16.0), (1025, 15.9, 2048, 8.0), (128, 0.01, 128, 0.125)])
def test_a_bucket_rounds_keys_up_and_programs_down(keys, per_sm, bucket_keys, bucket_per_sm):
    assert tuned.bucket(64, 1, keys, per_sm) == {"head_dim": 64, "causal": True, "keys": bucket_keys,
                                                 "per_sm": bucket_per_sm}


def test_the_measured_choice_is_looked_up_by_pass_and_bucket(tmp_path, gpu_table, monkeypatch):
    table = _table("_flash_fwd_kernel", _fwd(32))
    table["backward"] = _choices("backward", ((64, True, 1024, 31.0), "triton"),
                                 ((128, True, 4096, 15.5), "gluon-fused"))
    table["forward"] = _choices("forward", ((64, True, 1024, 31.0), "gluon-3wg"))
    _save(tmp_path, table)
    assert tuned.measured_choice("backward", _cuda_query(), True, 1024, 20.0) == "triton"  # the same bucket: 16-32
    assert tuned.measured_choice("forward", _cuda_query(), True, 1024, 20.0) == "gluon-3wg"
    assert tuned.measured_choice("backward", _cuda_query(), True, 4096, 12.0) is None  # d=64 at 4096: not measured
    assert tuned.measured_choice("backward", _cuda_query((1, 1, 4096, 128)), True, 3000, 9.0) == "gluon-fused"
    assert tuned.measured_choice("forward", _cuda_query((1, 1, 4096, 128)), True, 3000, 9.0) is None
    assert tuned.measured_choice("backward", _cuda_query(), False, 1024, 20.0) is None  # the other mask
    assert tuned.measured_choice("backward", type("Q", (), {"device": torch.device("cpu"),
                                                            "shape": (1, 1, 1024, 64)})(), True, 1024, 20.0) is None
    monkeypatch.setenv(tuned.ENV, "0")
    assert tuned.measured_choice("backward", _cuda_query(), True, 1024, 20.0) is None


@pytest.mark.parametrize("part", tuned.CHOICES)
def test_choices_of_other_sources_warn_and_are_ignored(tmp_path, gpu_table, part):
    table = _table("_flash_fwd_kernel", _fwd(32))
    table[part] = _choices(part, ((64, True, 1024, 31.0), "triton"), fingerprint="0" * 16)
    _save(tmp_path, table)
    with pytest.warns(UserWarning, match=f"{part} choices timed on another version of the {part} kernels"):
        assert tuned.measured_choice(part, _cuda_query(), True, 1024, 20.0) is None


@pytest.mark.parametrize("part", tuned.CHOICES)
@pytest.mark.parametrize("edit, problem", [
    (lambda b: b.pop("fingerprint"), "needs a 'fingerprint'"),
    (lambda b: b["choices"][0].update(choice="cudnn"), "a 'choice' among triton"),
    (lambda b: b["choices"][0]["key"].pop("per_sm"), "a 'key' of head_dim, causal, keys, per_sm"),
])
def test_a_malformed_choices_part_is_named(part, edit, problem):
    table = _table("_flash_fwd_kernel", _fwd(32))
    table[part] = _choices(part, ((64, True, 1024, 31.0), "triton"))
    edit(table[part])
    with pytest.raises(ValueError, match=problem):
        tuned._parse(table)


def test_a_choice_of_another_pass_is_refused():
    table = _table("_flash_fwd_kernel", _fwd(32))
    table["forward"] = _choices("forward", ((64, True, 1024, 31.0), "gluon-fused"))
    with pytest.raises(ValueError, match="a forward choice needs .* a 'choice' among triton, gluon, gluon-3wg"):
        tuned._parse(table)


def test_choices_merge_by_pass_and_bucket_and_are_printed(tmp_path, capsys):
    def entry(key, choice):
        return {"key": tuned.bucket(*key), "choice": choice, "ms": {choice: 1.0}}

    table = tuned.merged(None, GPU, {}, {"backward": [entry((64, True, 1024, 31), "triton"),
                                                      entry((128, False, 512, 2), "gluon")]})
    table = tuned.merged(table, GPU, {}, {"backward": [entry((64, True, 1024, 20), "gluon-fused")],  # same bucket
                                          "forward": [entry((128, True, 512, 2), "gluon")]})
    assert [(e["key"]["head_dim"], e["choice"]) for e in table["backward"]["choices"]] == [
        (128, "gluon"), (64, "gluon-fused")]
    assert [e["choice"] for e in table["forward"]["choices"]] == ["gluon"]
    kept = tuned.merged(table, GPU, {})  # nothing new: the choices stay
    assert (kept["backward"], kept["forward"]) == (table["backward"], table["forward"])
    stale = dict(table, backward=dict(table["backward"], fingerprint="0" * 16))
    assert tuned.merged(stale, GPU, {}, {"backward": [entry((64, False, 512, 1), "triton")]})["backward"][
        "choices"] == [entry((64, False, 512, 1), "triton")]  # choices of other sources are replaced, not merged into
    path = tmp_path / "t.json"
    tuned.write(path, table)
    assert tuned.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "backward" in out and "HEAD_DIM=64 CAUSAL=True KEYS<=1024 PROGRAMS_PER_SM>=16" in out
    assert "forward            HEAD_DIM=128 CAUSAL=True KEYS<=512 PROGRAMS_PER_SM>=2" in out


@pytest.mark.parametrize("part, module_name", [("forward", "flash_hopper"), ("backward", "flash_hopper_bwd")])
def test_a_pass_fingerprint_follows_its_kernels_and_settings_not_the_docstrings(part, module_name, monkeypatch):
    from lmsys import attention

    module = getattr(attention, module_name)
    tuned.choice_fingerprint.cache_clear()
    before = tuned.choice_fingerprint(part)
    monkeypatch.setattr(module, "__doc__", "another docstring")
    monkeypatch.setattr(module, "MEASURED", False)
    tuned.choice_fingerprint.cache_clear()
    assert tuned.choice_fingerprint(part) == before
    monkeypatch.setattr(module, "NUM_STAGES", 3)
    tuned.choice_fingerprint.cache_clear()
    assert tuned.choice_fingerprint(part) != before
    monkeypatch.undo()
    tuned.choice_fingerprint.cache_clear()
    assert tuned.choice_fingerprint(part) == before


def test_the_backward_fingerprint_covers_a_constexpr_a_kernel_s_callee_reads(monkeypatch):
    from lmsys.attention import flash_hopper_bwd

    tuned.choice_fingerprint.cache_clear()
    before = tuned.choice_fingerprint("backward")
    tuned._sources.cache_clear()
    monkeypatch.setitem(flash_hopper_bwd._dq_loop.fn.__globals__, "LOG2E", flash_hopper_bwd.gl.constexpr(2.0))
    tuned.choice_fingerprint.cache_clear()
    assert tuned.choice_fingerprint("backward") != before
    monkeypatch.undo()
    tuned._sources.cache_clear()
    tuned.choice_fingerprint.cache_clear()


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_the_export_budget_must_be_a_positive_number_of_seconds(value, capsys):
    with pytest.raises(SystemExit):
        tuned.main(["--export", "--budget-s", value])
    assert "--budget-s" in capsys.readouterr().err
