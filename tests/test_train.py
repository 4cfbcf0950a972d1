"""The training step: loss, random batches, and forward + backward + AdamW in fp32, bf16 autocast and compiled."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from lmsys import profiling
from lmsys.model import SIZES, TransformerLM
from lmsys.optim import AdamW
from lmsys.reference_model import ReferenceLM
from lmsys.train import cross_entropy, linear_cross_entropy, make_train_step, random_batch

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


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _relative_error(mine: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return float((mine.double() - reference).norm() / reference.norm())


def _unfused_head_loss(hidden, weight, targets):
    """The LM head then the cross-entropy, as the plain step computes them."""
    return cross_entropy(F.linear(hidden, weight), targets)


@pytest.mark.parametrize("rows, chunk_size", [(1, 1), (21, 4), (21, 7), (37, 1024), (64, 16)])
def test_linear_cross_entropy_matches_fp64(seed, rows, chunk_size):
    """Loss and both gradients against the float64 logits and F.cross_entropy, for chunks that do and do not divide
    the rows."""
    hidden, weight = torch.randn(rows, 24, dtype=torch.float64) * 2, torch.randn(97, 24, dtype=torch.float64)
    targets = torch.randint(97, (rows,))
    h, w = _leaves(hidden, weight)
    loss = linear_cross_entropy(h, w, targets, chunk_size=chunk_size)
    loss.backward()
    rh, rw = _leaves(hidden, weight)
    expected = F.cross_entropy(rh @ rw.T, targets)
    expected.backward()
    assert loss.dtype == h.grad.dtype == w.grad.dtype == torch.float64
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(h.grad, rh.grad)
    torch.testing.assert_close(w.grad, rw.grad)


def test_linear_cross_entropy_scales_the_incoming_gradient_and_keeps_batch_dims(seed):
    hidden, weight = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    targets = torch.randint(11, (3, 5))
    h, w = _leaves(hidden, weight)
    (linear_cross_entropy(h, w, targets, chunk_size=4) * -2.5).backward()
    rh, rw = _leaves(hidden, weight)
    (F.cross_entropy((rh @ rw.T).reshape(-1, 11), targets.reshape(-1)) * -2.5).backward()
    assert h.grad.shape == (3, 5, 8)
    torch.testing.assert_close(h.grad, rh.grad)
    torch.testing.assert_close(w.grad, rw.grad)


@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_linear_cross_entropy_under_bf16_autocast_matches_the_unfused_head(seed, chunk_size):
    """Under autocast the matmuls run in bf16 as F.linear's do: the loss and the fp32 gradients agree with the
    unfused head + cross_entropy to bf16 rounding, and both with float64 to bf16 accuracy."""
    hidden, weight, targets = torch.randn(2, 19, 32), torch.randn(301, 32) * 0.5, torch.randint(301, (2, 19))
    h, w = _leaves(hidden, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, targets, chunk_size=chunk_size)
    loss.backward()
    uh, uw = _leaves(hidden, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unfused = _unfused_head_loss(uh, uw, targets)
    unfused.backward()
    rh, rw = _leaves(hidden.double(), weight.double())
    exact = F.cross_entropy((rh @ rw.T).reshape(-1, 301), targets.reshape(-1))
    exact.backward()
    assert loss.dtype == h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, unfused, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), exact, rtol=2e-2, atol=0.0)
    # Elementwise, a chunk's bf16 partial sum of a near-zero weight gradient differs from the whole sum's rounding
    # by more than any tolerance of its own size: compare the gradients as vectors.
    for mine, unfused_grad, reference in ((h.grad, uh.grad, rh.grad), (w.grad, uw.grad, rw.grad)):
        assert _relative_error(mine, unfused_grad) <= 1e-2
        assert _relative_error(mine, reference) <= 2e-2


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_linear_cross_entropy_gives_a_bf16_weight_the_rounding_of_its_fp32_gradient(seed, autocast):
    """A bf16 weight computes as the fp32 weight of the same values does (in fp32, or in bf16 under autocast): the
    same loss and hidden gradient to the bit, and as its gradient the bf16 rounding of the fp32 one."""
    hidden, targets = torch.randn(2, 19, 32), torch.randint(301, (2, 19))
    weight = (torch.randn(301, 32) * 0.5).to(torch.bfloat16)
    h, w = _leaves(hidden, weight)
    fh, fw = _leaves(hidden, weight.float())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(h, w, targets, chunk_size=5)
        expected = linear_cross_entropy(fh, fw, targets, chunk_size=5)
    loss.backward()
    expected.backward()
    assert loss.dtype == h.grad.dtype == torch.float32 and w.grad.dtype == torch.bfloat16
    assert torch.equal(loss, expected) and torch.equal(h.grad, fh.grad)
    assert torch.equal(w.grad, fw.grad.to(torch.bfloat16))
    rh, rw = _leaves(hidden.double(), weight.double())
    F.cross_entropy((rh @ rw.T).reshape(-1, 301), targets.reshape(-1)).backward()
    assert _relative_error(w.grad, rw.grad) <= (2e-2 if autocast else 1e-2)


def test_linear_cross_entropy_computes_only_the_gradients_asked_for(seed):
    hidden, weight, targets = torch.randn(9, 8), torch.randn(13, 8), torch.randint(13, (9,))
    expected = F.cross_entropy(hidden @ weight.T, targets)
    w = weight.clone().requires_grad_()
    linear_cross_entropy(hidden, w, targets, chunk_size=4).backward()
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, targets, chunk_size=4).backward()
    assert w.grad is not None and h.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, targets, chunk_size=4), expected)


@pytest.mark.parametrize(
    "shapes, chunk_size, message",
    [
        (((2, 3, 8), (10, 8), (2, 4)), 4, "plus a feature dimension"),
        (((2, 3, 8), (10, 7), (2, 3)), 4, "must be \\(vocab, 8\\)"),
        (((2, 3, 8), (10, 8), (2, 3)), 0, "chunk_size must be a positive integer"),
    ],
)
def test_linear_cross_entropy_bad_input_raises(shapes, chunk_size, message):
    hidden, weight, target_shape = torch.zeros(shapes[0]), torch.zeros(shapes[1]), shapes[2]
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(hidden, weight, torch.zeros(target_shape, dtype=torch.long), chunk_size=chunk_size)


@pytest.mark.parametrize("autocast", [False, True], ids=["float64", "bf16-autocast"])
def test_fused_head_loss_gives_every_parameter_the_unfused_gradient(seed, autocast):
    """Through the whole tiny model: the loss of model.features + linear_cross_entropy and every parameter's
    gradient against the model's logits + F.cross_entropy (float64), or + the plain step's cross_entropy (bf16
    autocast, same rounding up to the order of the sums)."""
    fused = TransformerLM(TINY)
    unfused = TransformerLM(TINY)
    unfused.load_state_dict(fused.state_dict())
    if not autocast:
        fused, unfused = fused.double(), unfused.double()
    inputs, targets = random_batch(3, 21, TINY.vocab_size, "cpu")  # 63 tokens, not a multiple of the chunk
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(fused.features(inputs), fused.lm_head.weight, targets, chunk_size=16)
        logits = unfused(inputs)
        expected = (cross_entropy(logits, targets) if autocast
                    else F.cross_entropy(logits.reshape(-1, TINY.vocab_size), targets.reshape(-1)))
    loss.backward()
    expected.backward()
    tolerance = dict(rtol=1e-5, atol=1e-5) if autocast else {}
    torch.testing.assert_close(loss, expected.to(loss.dtype), **tolerance)
    for (name, mine), reference in zip(fused.named_parameters(), unfused.parameters(), strict=True):
        assert mine.grad.dtype == mine.dtype, name
        if autocast:
            error = _relative_error(mine.grad, reference.grad)
            assert error <= 2e-2, f"{name}: relative error {error:.3g}"
        else:
            torch.testing.assert_close(mine.grad, reference.grad, msg=name)


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
        (dict(fused_loss=True), AdamW),
        (dict(compile=True, fused_loss=True), AdamW),
        (dict(compile=True, compile_blocks=True), AdamW),
        (dict(compile=True, compile_blocks=True, fused_loss=True), AdamW),
    ],
    ids=["compile_loss", "compile_optimizer", "fused_loss", "compiled_fused_loss", "compile_blocks",
         "compile_blocks_fused_loss"],
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
        (dict(max_autotune=True), "max_autotune=True tunes inductor's kernels: it needs compile=True and "
         "compile_backend='inductor', not compile=False"),
        (dict(compile=True, compile_backend="aot_eager", max_autotune=True),
         "max_autotune=True .* not compile=True and compile_backend='aot_eager'"),
        (dict(compile_blocks=True), "compile_blocks=True compiles each block .* not compile=False, compile_loss=False"),
        (dict(compile=True, compile_loss=True, compile_blocks=True),
         "compile_blocks=True .* not compile=True, compile_loss=True"),
    ],
)
def test_step_options_that_cannot_work_are_refused(options, message):
    model = TransformerLM(TINY)
    with pytest.raises(ValueError, match=message):
        make_train_step(model, AdamW(model.parameters()), **options)


@pytest.mark.parametrize("model_class", [TransformerLM, ReferenceLM])
def test_compile_blocks_compiles_one_graph_for_all_the_blocks(model_class):
    torch.compiler.reset()
    counters.clear()
    config = dataclasses.replace(TINY, num_layers=3)
    model = model_class(config)
    step = make_train_step(model, AdamW(model.parameters()), compile=True, compile_blocks=True,
                           compile_backend="aot_eager")
    step(*random_batch(2, 16, config.vocab_size, "cpu"))
    assert counters["stats"]["unique_graphs"] == 1
    assert all(block._compiled_call_impl is not None for block in model.layers)


def test_compile_blocks_refuses_a_model_without_blocks():
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    with pytest.raises(ValueError, match="a model with an nn.ModuleList of blocks in `layers`, .* a Sequential"):
        make_train_step(model, AdamW(model.parameters()), compile=True, compile_blocks=True)


def _compile_modes(monkeypatch, device, **options):
    """The keyword arguments of each torch.compile call that make_train_step makes (none of them compiles)."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    with torch.device(device):
        model = TransformerLM(TINY)
    make_train_step(model, AdamW(model.parameters()), compile=True, **options)
    return calls


@pytest.mark.parametrize("fused_loss", [False, True])
@pytest.mark.parametrize("max_autotune, mode", [(False, None), (True, "max-autotune-no-cudagraphs")])
def test_max_autotune_compiles_with_the_max_autotune_mode_without_cuda_graphs(monkeypatch, max_autotune, mode,
                                                                              fused_loss):
    calls = _compile_modes(monkeypatch, "cpu", max_autotune=max_autotune, fused_loss=fused_loss)
    assert calls == [dict(backend="inductor", mode=mode)]


@pytest.mark.gpu
@pytest.mark.parametrize("max_autotune, mode", [(False, "reduce-overhead"), (True, "max-autotune")])
def test_cuda_graphs_pick_the_compile_mode_with_inductors_cuda_graphs(gpu, monkeypatch, max_autotune, mode):
    """Inductor records the CUDA graphs itself (there is no capture around it): with max_autotune, the mode
    "max-autotune" keeps them."""
    assert _compile_modes(monkeypatch, gpu, cuda_graphs=True, max_autotune=max_autotune) == [
        dict(backend="inductor", mode=mode)]


def test_fused_loss_is_refused_for_a_model_without_features():
    model = ReferenceLM(TINY)
    with pytest.raises(ValueError, match="fused_loss=True needs a model with features"):
        make_train_step(model, AdamW(model.parameters()), fused_loss=True)


@pytest.mark.slow
def test_bf16_fused_loss_step_matches_the_plain_bf16_step(seed):
    """Under bf16 autocast, compiled (aot_eager), the fused-loss step trains as the plain step does."""
    torch.compiler.reset()
    config = dataclasses.replace(TINY, num_layers=1)
    plain, fused = TransformerLM(config), TransformerLM(config)
    fused.load_state_dict(plain.state_dict())
    options = dict(autocast_dtype=torch.bfloat16, compile=True, compile_backend="aot_eager")
    # eps=1e-4: see test_compiled_step_matches_eager_with_ranges_off_and_on.
    plain_step = make_train_step(plain, AdamW(plain.parameters(), eps=1e-4), **options)
    fused_step = make_train_step(fused, AdamW(fused.parameters(), eps=1e-4), fused_loss=True, **options)
    batch = random_batch(2, 16, config.vocab_size, "cpu")
    for _ in range(3):
        torch.testing.assert_close(fused_step(*batch), plain_step(*batch), rtol=1e-3, atol=1e-3)
    for mine, reference in zip(fused.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-2, atol=2e-3)


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


def _bf16_weight_twins(config, device, fused, **options):
    """The bf16 autocast step and the same step with bf16_weights=True, on two copies of one model."""
    plain, low = TransformerLM(config).to(device), TransformerLM(config).to(device)
    low.load_state_dict(plain.state_dict())
    options = dict(autocast_dtype=torch.bfloat16, **options)
    plain_step = make_train_step(plain, AdamW(plain.parameters(), fused=fused), **options)
    optimizer = AdamW(low.parameters(), fused=fused)
    low_step = make_train_step(low, optimizer, bf16_weights=True, **options)
    return (plain, plain_step), (low, low_step, optimizer)


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize(
    "fused, options",
    [(False, {}), (True, {}), (True, dict(compile=True, compile_backend="aot_eager"))],
    ids=["foreach", "fused", "fused-compiled"],
)
def test_bf16_weights_step_is_the_autocast_step(seed, fused, options):
    """bf16 Linear weights with fp32 masters in the optimizer train as bf16 autocast on fp32 weights does, to the
    bit: the same losses, masters equal to the fp32 weights, each bf16 weight their rounding; the other parameters
    stay fp32."""
    if fused and torch.cuda.is_available():
        pytest.skip("the fused kernel runs on the CPU only under the interpreter, without CUDA")
    torch.compiler.reset()
    config = dataclasses.replace(TINY, num_layers=1, vocab_size=512)  # a small vocabulary: the interpreter is slow
    (plain, plain_step), (low, low_step, optimizer) = _bf16_weight_twins(config, "cpu", fused, **options)
    linear = {name for name, module in low.named_modules() if isinstance(module, torch.nn.Linear)}
    assert {name.rsplit(".", 1)[0] for name, p in low.named_parameters() if p.dtype == torch.bfloat16} == linear
    batch = random_batch(2, 16, config.vocab_size, "cpu")
    for _ in range(3):
        torch.testing.assert_close(low_step(*batch), plain_step(*batch), rtol=0, atol=0)
    for (name, mine), reference in zip(low.named_parameters(), plain.parameters(), strict=True):
        master = optimizer.state[mine].get("master", mine)
        torch.testing.assert_close(master, reference, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        assert torch.equal(mine.detach(), reference.detach().to(mine.dtype)), name


def _gradients_of_the_last_backward(model):
    """A dict that each backward fills with copies of the model's gradients by name (before the step clears them)."""
    grads = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: grads.__setitem__(name, p.grad.clone()))
    return grads


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize(
    "fused, options",
    [(False, {}), pytest.param(True, dict(compile=True, compile_backend="aot_eager"), marks=pytest.mark.slow)],
    ids=["foreach", "fused-compiled"],
)
def test_bf16_weights_with_fused_loss_is_the_fused_loss_step(seed, fused, options):
    """bf16 Linear weights with the fused LM head + cross-entropy against the fused-loss step on fp32 weights: the
    first step's loss to the bit, every gradient to the bit in the parameter's dtype (the head's is the bf16
    rounding of the fp32 sum over the chunks); over three steps, as close to the plain autocast step as the fused
    loss alone is."""
    if fused and torch.cuda.is_available():
        pytest.skip("the fused kernel runs on the CPU only under the interpreter, without CUDA")
    torch.compiler.reset()
    config = dataclasses.replace(TINY, num_layers=1, vocab_size=512)  # a small vocabulary: the interpreter is slow
    plain, fused_model, both = TransformerLM(config), TransformerLM(config), TransformerLM(config)
    fused_model.load_state_dict(plain.state_dict())
    both.load_state_dict(plain.state_dict())
    options = dict(autocast_dtype=torch.bfloat16, **options)
    # eps=1e-4: see test_compiled_step_matches_eager_with_ranges_off_and_on.
    plain_step = make_train_step(plain, AdamW(plain.parameters(), eps=1e-4, fused=fused), **options)
    fused_step = make_train_step(fused_model, AdamW(fused_model.parameters(), eps=1e-4, fused=fused),
                                 fused_loss=True, **options)
    optimizer = AdamW(both.parameters(), eps=1e-4, fused=fused)
    both_step = make_train_step(both, optimizer, fused_loss=True, bf16_weights=True, **options)
    assert both.lm_head.weight.dtype == torch.bfloat16 and "master" in optimizer.state[both.lm_head.weight]
    fused_grads, both_grads = _gradients_of_the_last_backward(fused_model), _gradients_of_the_last_backward(both)
    batch = random_batch(17, 64, config.vocab_size, "cpu")  # 1088 tokens: two chunks of linear_cross_entropy
    losses = [(plain_step(*batch), fused_step(*batch), both_step(*batch))]
    assert torch.equal(losses[0][2], losses[0][1])
    for name, p in both.named_parameters():
        assert both_grads[name].dtype == p.dtype, name
        assert torch.equal(both_grads[name], fused_grads[name].to(p.dtype)), name
    assert not torch.equal(fused_grads["lm_head.weight"], both_grads["lm_head.weight"].float())
    losses += [(plain_step(*batch), fused_step(*batch), both_step(*batch)) for _ in range(2)]
    plain_losses, fused_losses, both_losses = (torch.stack(column) for column in zip(*losses, strict=True))
    torch.testing.assert_close(fused_losses, plain_losses, rtol=2e-5, atol=0.0)
    torch.testing.assert_close(both_losses, plain_losses, rtol=2e-5, atol=0.0)
    for (name, mine), fused_p, reference in zip(both.named_parameters(), fused_model.parameters(), plain.parameters(),
                                                strict=True):
        master = optimizer.state[mine].get("master", mine)
        assert torch.equal(mine.detach(), master.detach().to(mine.dtype)), name
        error, fused_error = _relative_error(master.detach(), reference.detach()), \
            _relative_error(fused_p.detach(), reference.detach())
        # Under 1e-5 (the norm gains) both are rounding noise of the updates; the weight matrices sit near 1e-4.
        assert error <= max(1.5 * fused_error, 1e-5), f"{name}: {error:.3g} against the fused loss's {fused_error:.3g}"


@pytest.mark.parametrize(
    "options, optimizer_class, message",
    [
        (dict(bf16_weights=True), AdamW, "bf16_weights=True .* needs autocast_dtype=torch.bfloat16"),
        (dict(bf16_weights=True, autocast_dtype=torch.bfloat16), torch.optim.AdamW,
         "keep their fp32 masters in lmsys.optim.AdamW, not in AdamW"),
    ],
)
def test_bf16_weights_that_cannot_work_are_refused_and_change_nothing(options, optimizer_class, message):
    model = TransformerLM(TINY)
    with pytest.raises(ValueError, match=message):
        make_train_step(model, optimizer_class(model.parameters()), **options)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("fused_loss", [False, True])
def test_bf16_weights_refuse_a_linear_weight_tied_to_an_embedding(fused_loss):
    """Also with the fused loss, which never calls the head: the embedding's lookup would still read the bf16
    weight, and its gradient would be bf16."""
    model = TransformerLM(TINY)
    model.lm_head.weight = model.embedding.weight
    with pytest.raises(ValueError, match="shared with a module that is not a Linear"):
        make_train_step(model, AdamW(model.parameters()), autocast_dtype=torch.bfloat16, bf16_weights=True,
                        fused_loss=fused_loss)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("fused_loss", [False, True])
def test_cuda_graph_bf16_weights_step_matches_the_autocast_step_on_gpu(gpu, seed, fused_loss):
    """Both compiled and replayed as CUDA graphs, bf16 weights against the autocast step on fp32 weights (both with
    the plain or both with the fused loss): the same losses and weights up to the compiler's rounding (inductor
    fuses differently around the casts it no longer makes); the bf16 weights keep their addresses, as the graphs
    need."""
    torch.compiler.reset()
    config = dataclasses.replace(SIZES["small"], num_layers=2, context_length=128, attention="sdpa")
    (plain, plain_step), (low, low_step, optimizer) = _bf16_weight_twins(config, gpu, None, compile=True,
                                                                          cuda_graphs=True, fused_loss=fused_loss)
    addresses = [p.data_ptr() for p in low.parameters()]
    batch = random_batch(2, 128, config.vocab_size, gpu)
    plain_losses = [plain_step(*batch) for _ in range(5)]
    low_losses = [low_step(*batch) for _ in range(5)]
    torch.testing.assert_close(torch.stack(low_losses), torch.stack(plain_losses), rtol=2e-2, atol=2e-2)
    assert low_losses[-1] < low_losses[0]
    assert [p.data_ptr() for p in low.parameters()] == addresses
    for mine, reference in zip(low.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(optimizer.state[mine].get("master", mine), reference, rtol=2e-2, atol=2e-3)
    torch.compiler.reset()
