"""Profiler ranges (off and free by default, named in traces when on), profiling helpers and the throughput meter."""

import json

import pytest
import torch

from lmsys import profiling
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.train import make_train_step, random_batch

TINY = SIZES["tiny"]
STEP_RANGES = {"forward", "backward", "optimizer_step", "lm_head", "ffn", "attention"}
LAYER_RANGES = {f"layer_{i}" for i in range(TINY.num_layers)}
ATTENTION_RANGES = {
    "attention/qkv_proj",
    "attention/rope",
    "attention/kernel",
    "attention/out_proj",
    # The naive kernel's own ranges.
    "attention/scores",  # the causal mask included (lmsys.attention.masking)
    "attention/softmax",
    "attention/value_matmul",
}


@pytest.fixture
def tiny_step(seed, device):
    """One training step of the tiny model and its batch, on the CUDA device when there is one (NVTX ranges too)."""
    with torch.device(device):
        model = TransformerLM(TINY)
    return make_train_step(model, AdamW(model.parameters())), random_batch(2, 16, TINY.vocab_size, device)


def test_ranges_are_off_by_default_and_share_one_null_context():
    assert not profiling.is_enabled()
    assert profiling.range("a") is profiling.range("b")


def test_enabled_turns_ranges_on_and_restores_the_setting_even_after_an_error():
    with pytest.raises(KeyError), profiling.enabled():
        assert profiling.is_enabled()
        assert profiling.range("a") is not profiling.range("b")
        with profiling.enabled(False):
            assert not profiling.is_enabled()
        assert profiling.is_enabled()
        raise KeyError("inside")
    assert not profiling.is_enabled()


def test_trace_of_one_training_step_contains_the_named_ranges(tiny_step):
    step, batch = tiny_step
    prof = profiling.profile(step, *batch)
    names = {event.name for event in prof.events()}
    missing = (STEP_RANGES | LAYER_RANGES | ATTENTION_RANGES) - names
    assert not missing, f"ranges missing from the trace: {sorted(missing)}"
    # The trace has the ranges; the operator table leaves them out (a range's time is all it holds).
    table = profiling.table(prof)
    assert "aten::" in table and not any(f"\n{name} " in table for name in STEP_RANGES)


def test_no_ranges_are_recorded_while_off(tiny_step):
    step, batch = tiny_step
    with torch.profiler.profile() as prof:
        step(*batch)
    assert not {event.name for event in prof.events()} & (STEP_RANGES | LAYER_RANGES | ATTENTION_RANGES)


def test_chrome_trace_is_written(tiny_step, tmp_path):
    step, batch = tiny_step
    path = tmp_path / "step.json"
    profiling.profile(step, *batch, warmup=0, trace_path=path)
    names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
    assert {"forward", "backward", "optimizer_step"} <= names


def test_profile_rejects_negative_warmup():
    with pytest.raises(ValueError, match="warmup"):
        profiling.profile(lambda: None, warmup=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_memory_snapshot_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"), profiling.memory_snapshot("unused.pickle"):
        pass


@pytest.mark.gpu
def test_memory_snapshot_is_dumped(gpu, tmp_path):
    path = tmp_path / "snapshot.pickle"
    with profiling.memory_snapshot(path):
        torch.ones(1024, 1024, device=gpu).sum()
    assert path.stat().st_size > 0


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throughput_counts_tokens_per_second():
    clock = FakeClock()
    meter = profiling.Throughput(clock=clock)
    meter.start()
    clock.now = 0.5
    meter.update(1000)
    clock.now = 2.0
    meter.update(3000)
    assert meter.tokens_per_second == pytest.approx(2000.0)


def test_throughput_needs_start_and_a_measurement():
    meter = profiling.Throughput(clock=FakeClock())
    with pytest.raises(RuntimeError, match="start"):
        meter.update(10)
    meter.start()
    with pytest.raises(RuntimeError, match="no time"):
        _ = meter.tokens_per_second
