"""The training step: loss, random batches, and forward + backward + AdamW in fp32, bf16 autocast and compiled."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from lmsys import profiling
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.train import cross_entropy, make_train_step, random_batch

TINY = SIZES["tiny"]


@pytest.mark.parametrize("shape,vocab", [((5,), 3), ((3, 17), 101), ((2, 4, 9), 1000)])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_cross_entropy_matches_fp64(seed, shape, vocab, offset):
    # A large common offset overflows a naive exp(); the loss must not change.
    logits = torch.randn(*shape, vocab) * 4 + offset
    targets = torch.randint(vocab, shape)
    expected = F.cross_entropy(logits.double().reshape(-1, vocab) - offset, targets.reshape(-1))
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5 if offset == 0 else 2e-3)


def test_cross_entropy_of_bf16_logits_is_fp32_with_fp32_gradients(seed):
    logits = torch.randn(4, 7, 50, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(50, (4, 7))
    loss = cross_entropy(logits, targets)
    loss.backward()
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.detach().double().reshape(-1, 50), targets.reshape(-1))
    # fp32 arithmetic against a float64 reference: fp32 tolerances (float64's default failed now and then).
    torch.testing.assert_close(loss.double(), expected, rtol=2e-6, atol=1e-6)
    assert logits.grad.dtype == torch.bfloat16


def test_cross_entropy_shape_mismatch_raises():
    with pytest.raises(ValueError, match="vocabulary dimension"):
        cross_entropy(torch.zeros(2, 3, 10), torch.zeros(2, 4, dtype=torch.long))


def test_random_batch_targets_are_inputs_shifted_by_one():
    inputs, targets = random_batch(3, 11, 7, "cpu", generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (3, 11)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.min()) >= 0 and int(targets.max()) < 7
    again, _ = random_batch(3, 11, 7, "cpu", generator=torch.Generator().manual_seed(0))
    assert torch.equal(inputs, again)


def test_random_batch_rejects_empty_sizes():
    with pytest.raises(ValueError, match="must be positive"):
        random_batch(0, 8, 10, "cpu")


def test_tiny_model_overfits_one_batch(seed):
    model = TransformerLM(TINY)
    step = make_train_step(model, AdamW(model.parameters(), lr=1e-2, weight_decay=0.0))
    inputs, targets = random_batch(2, 16, TINY.vocab_size, "cpu")
    losses = [step(inputs, targets).item()]
    while losses[-1] > 0.1 * losses[0] and len(losses) < 300:
        losses.append(step(inputs, targets).item())
    assert losses[-1] <= 0.1 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f} after {len(losses)} steps"


def test_step_updates_every_parameter_and_clears_gradients(seed):
    model = TransformerLM(TINY)
    before = [p.detach().clone() for p in model.parameters()]
    step = make_train_step(model, AdamW(model.parameters()))
    loss = step(*random_batch(2, 16, TINY.vocab_size, "cpu"))
    assert loss.shape == () and not loss.requires_grad
    for old, (name, new) in zip(before, model.named_parameters(), strict=True):
        assert new.grad is None, name
        assert not torch.equal(old, new), f"{name} was not updated"


def test_bf16_autocast_step_runs_and_its_loss_is_close_to_fp32(seed):
    reference = TransformerLM(TINY)
    model = TransformerLM(TINY)
    model.load_state_dict(reference.state_dict())
    batch = random_batch(2, 32, TINY.vocab_size, "cpu")
    fp32_step = make_train_step(reference, AdamW(reference.parameters()))
    bf16_step = make_train_step(model, AdamW(model.parameters()), autocast_dtype=torch.bfloat16)
    for _ in range(3):
        fp32_loss, bf16_loss = fp32_step(*batch), bf16_step(*batch)
        assert bf16_loss.dtype == torch.float32
        torch.testing.assert_close(bf16_loss, fp32_loss, rtol=1e-2, atol=0.0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter's limits; on a GPU bf16 runs")
def test_bf16_autocast_step_with_flash_triton_on_the_interpreter_raises(seed):
    """The interpreter cannot multiply bf16: the step must fail, not train on wrong attention outputs."""
    model = TransformerLM(dataclasses.replace(TINY, attention="flash_triton"))
    step = make_train_step(model, AdamW(model.parameters()), autocast_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 is not supported by triton under the Triton interpreter"):
        step(*random_batch(2, 16, TINY.vocab_size, "cpu"))


def test_float16_autocast_is_refused():
    model = TransformerLM(TINY)
    with pytest.raises(ValueError, match="autocast_dtype"):
        make_train_step(model, AdamW(model.parameters()), autocast_dtype=torch.float16)


@pytest.mark.slow
def test_compiled_step_matches_eager_with_ranges_off_and_on(seed):
    config = dataclasses.replace(TINY, num_layers=1)
    eager, compiled = TransformerLM(config), TransformerLM(config)
    compiled.load_state_dict(eager.state_dict())
    batch = random_batch(2, 16, config.vocab_size, "cpu")
    # With eps=1e-8 Adam's first update g / (|g| + eps) turns rounding differences of near-zero gradients into
    # differences of up to lr; a larger eps keeps the update a smooth function of the gradient.
    eager_step = make_train_step(eager, AdamW(eager.parameters(), eps=1e-4))
    compiled_step = make_train_step(compiled, AdamW(compiled.parameters(), eps=1e-4), compile=True)
    torch.testing.assert_close(compiled_step(*batch), eager_step(*batch), rtol=1e-4, atol=1e-5)
    # Ranges inside the compiled model are skipped, not traced; the step outside it still records its own.
    with profiling.enabled():
        torch.testing.assert_close(compiled_step(*batch), eager_step(*batch), rtol=1e-4, atol=1e-5)
    for mine, reference in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)


def _twin_steps(config, optimizer_class, **options):
    """An eager step and a step with `options` on two copies of one model, each with its own optimizer."""
    eager, other = TransformerLM(config), TransformerLM(config)
    other.load_state_dict(eager.state_dict())
    # eps=1e-4: see test_compiled_step_matches_eager_with_ranges_off_and_on.
    eager_step = make_train_step(eager, optimizer_class(eager.parameters(), eps=1e-4))
    other_step = make_train_step(other, optimizer_class(other.parameters(), eps=1e-4), **options)
    return (eager, eager_step), (other, other_step)


@pytest.mark.parametrize(
    "options, optimizer_class",
    [
        (dict(compile=True, compile_loss=True), AdamW),
        (dict(compile_optimizer=True), functools.partial(torch.optim.AdamW, foreach=True)),
    ],
    ids=["compile_loss", "compile_optimizer"],
)
def test_step_options_match_the_plain_step(seed, options, optimizer_class):
    """The model and loss compiled together, or torch's optimizer step compiled, train as the eager step does
    (aot_eager: the same graphs as inductor's, without its CPU compile time)."""
    torch.compiler.reset()
    config = dataclasses.replace(TINY, num_layers=1)
    (eager, eager_step), (other, other_step) = _twin_steps(
        config, optimizer_class, compile_backend="aot_eager", **options
    )
    batch = random_batch(2, 16, config.vocab_size, "cpu")
    for _ in range(2):
        torch.testing.assert_close(other_step(*batch), eager_step(*batch), rtol=1e-4, atol=1e-5)
    for mine, reference in zip(other.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(compile_loss=True), "compile_loss=True compiles the loss with the model: it needs compile=True"),
        (dict(compile_optimizer=True), "compile_optimizer=True is for torch's optimizers"),
        (dict(cuda_graphs=True), "cuda_graphs=True records the compiled model's kernels as CUDA graphs: it needs"),
        (dict(compile=True, cuda_graphs=True), "cuda_graphs=True needs the model on a CUDA device, not cpu"),
    ],
)
def test_step_options_that_cannot_work_are_refused(options, message):
    model = TransformerLM(TINY)
    with pytest.raises(ValueError, match=message):
        make_train_step(model, AdamW(model.parameters()), **options)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash_triton"])
def test_cuda_graph_step_matches_the_compiled_step_on_gpu(gpu, seed, attention):
    """Recorded and replayed as CUDA graphs, the bf16 step trains as the plain compiled step does (same losses and
    weights over several steps, the recording steps included); earlier losses survive later replays; the host runs
    ahead of the device."""
    torch.compiler.reset()
    config = dataclasses.replace(SIZES["small"], num_layers=2, context_length=128, attention=attention)
    with torch.device(gpu):
        plain, graphed = TransformerLM(config), TransformerLM(config)
    graphed.load_state_dict(plain.state_dict())
    options = dict(autocast_dtype=torch.bfloat16, compile=True)
    plain_step = make_train_step(plain, AdamW(plain.parameters()), **options)
    graphed_step = make_train_step(graphed, AdamW(graphed.parameters()), cuda_graphs=True, **options)
    batch = random_batch(2, 128, config.vocab_size, gpu)
    plain_losses = [plain_step(*batch) for _ in range(5)]
    graphed_losses = [graphed_step(*batch) for _ in range(5)]
    torch.testing.assert_close(torch.stack(graphed_losses), torch.stack(plain_losses), rtol=2e-2, atol=2e-2)
    assert graphed_losses[-1] < graphed_losses[0]
    for mine, reference in zip(graphed.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine, reference, rtol=2e-2, atol=2e-3)
    torch.cuda.synchronize(gpu)
    torch.cuda._sleep(2_000_000_000)
    graphed_step(*batch)
    assert not torch.cuda.current_stream(gpu).query(), "the graphed step waited for the device's queue"
    torch.cuda.synchronize(gpu)
    torch.compiler.reset()
