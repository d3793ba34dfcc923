"""The training-speed paths against the plain ones, on a tiny random Qwen2 on CPU: the fused LM-head
logprobs (hand-written backward), entropy without gradients when it is not in the loss, and decoder layers
under torch.compile (aot_eager here: dynamo's graphs and AOTAutograd's backward, without the C++ compile
of inductor, which the GPU runs use).

Tolerances: fp32 differs only by summation order (1e-5 on logprobs; gradients 1e-4 relative, 1e-6
absolute). Under bf16 autocast both paths run the same bf16 matmuls and fp32 softmax math, so the
logprobs agree to fp32 rounding; the head-weight gradient is summed over chunks in fp32 by the fused
path and in bf16 by autograd's, so gradients agree to ~1e-2 relative (measured 2e-3).
"""

import copy

import pytest
import torch

from testing.tiny import make_tiny_model
from trainer.batch import TrainBatch
from trainer.compiling import CompiledOrEager, compile_model
from trainer.parallel.fsdp import decoder_layers
from trainer.model import load_policy
from trainer.packing import use_packed_attention
from trainer.rollout.base import Rollout
from trainer.workers import logprobs
from trainer.workers.logprobs import (
    LogprobHead,
    add_weight_grad,
    chunk_logits_grad,
    chunk_stats,
    response_logprobs,
)

VOCAB = 100
FUSED, PLAIN = LogprobHead(chunk_size=5), LogprobHead(chunk_size=5, fused=False)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden=32, layers=2, heads=4, kv_heads=2, seed=5
    )
    return load_policy(str(path))


def make_batch(rows=6, seed=0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for index in range(rows):
        prompt, response = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((2, 7), (1, 10)))
        rollouts.append(
            Rollout(
                prompt_ids=torch.randint(3, VOCAB, (prompt,), generator=gen).tolist(),
                response_ids=torch.randint(3, VOCAB, (response,), generator=gen).tolist(),
                logprobs=[0.0] * response,
                loss_mask=[1] * response,
                finish_reason="length",
                prompt_index=index,
            )
        )
    return TrainBatch.from_rollouts(rollouts, pad_id=0)


def grads_of(model, batch, head, *, entropy_weight: float, entropy_grad=True, temperature=1.0):
    """(logprobs, entropy, parameter gradients) of sum(w * logprob) + entropy_weight * sum(w * entropy)."""
    model = copy.deepcopy(model)
    out = response_logprobs(
        model, batch, temperature=temperature, with_entropy=True, entropy_grad=entropy_grad, head=head
    )
    weights = torch.randn(out.logprobs.shape, generator=torch.Generator().manual_seed(9))
    loss = (out.logprobs * weights).sum()
    if entropy_grad:
        loss = loss + entropy_weight * (out.entropy * weights).sum()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.logprobs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_head_gives_the_plain_logprobs_entropy_and_gradients(base_model, temperature):
    batch = make_batch()
    fused = grads_of(base_model, batch, FUSED, entropy_weight=0.3, temperature=temperature)
    plain = grads_of(base_model, batch, PLAIN, entropy_weight=0.3, temperature=temperature)
    torch.testing.assert_close(fused[0], plain[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(fused[1], plain[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(fused[2], plain[2], atol=1e-6, rtol=1e-4)
    # the entropy term does move the gradient: a fused backward that dropped it would fail the check above
    without = grads_of(base_model, batch, PLAIN, entropy_weight=0.0, temperature=temperature)[2]
    assert (without - plain[2]).abs().max() > 1e-4


def test_entropy_without_gradient_is_logged_but_does_not_train(base_model):
    batch = make_batch(seed=1)
    for head in (FUSED, PLAIN):
        logprobs, entropy, grads = grads_of(base_model, batch, head, entropy_weight=0.3, entropy_grad=False)
        _, _, logprob_only = grads_of(base_model, batch, PLAIN, entropy_weight=0.0)
        torch.testing.assert_close(grads, logprob_only, atol=1e-6, rtol=1e-4)
        real = batch.attention_mask[:, batch.prompt_width :].bool()
        assert (entropy[real] > 0).all() and not entropy.requires_grad


def test_fused_head_under_bf16_autocast_matches_the_plain_path(base_model):
    batch = make_batch(seed=2)
    outs = []
    for head in (FUSED, PLAIN):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(grads_of(base_model, batch, head, entropy_weight=0.1))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=0)
    assert (outs[0][2] - outs[1][2]).norm() < 1e-2 * outs[1][2].norm()


def test_chunk_math_compiles_to_the_same_numbers():
    gen = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(7, 50, generator=gen), torch.randint(0, 50, (7,), generator=gen)
    grad_logprob, grad_entropy = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    stats = CompiledOrEager(chunk_stats, backend="aot_eager")
    logits_grad = CompiledOrEager(chunk_logits_grad, backend="aot_eager")
    eager = chunk_stats(logits, targets, 0.7)
    compiled = stats(logits, targets, 0.7)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
    args = (logits, targets, eager[2], eager[1], grad_logprob, grad_entropy, 0.7)
    torch.testing.assert_close(logits_grad(*args), chunk_logits_grad(*args))
    assert stats.enabled and logits_grad.enabled
    # the closed form is autograd's gradient of (logprob, entropy)
    z = logits.clone().requires_grad_(True)
    logprob, entropy, _ = chunk_stats(z, targets, 0.7)
    ((logprob * grad_logprob).sum() + (entropy * grad_entropy).sum()).backward()
    torch.testing.assert_close(chunk_logits_grad(*args), z.grad, atol=1e-6, rtol=1e-5)


def test_the_head_compiles_once_for_every_chunk_row_count():
    """A packed batch's last chunk is shorter: with the row count symbolic from the first call, it runs the
    graph already compiled (issue 24: that second compile landed in a measured step); the vocabulary, the
    reduced dimension, stays a constant."""
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append([x for x in example_inputs if isinstance(x, torch.SymInt)])
        return graph_module.forward

    torch._dynamo.reset()
    stats = CompiledOrEager(chunk_stats, backend=counting, dynamic=None, dynamic_rows=True)
    gen = torch.Generator().manual_seed(0)
    for rows in (8, 8, 5, 3):
        logits, targets = torch.randn(rows, 50, generator=gen), torch.randint(0, 50, (rows,), generator=gen)
        for a, b in zip(stats(logits, targets, 0.7), chunk_stats(logits, targets, 0.7)):
            torch.testing.assert_close(a, b)
    assert len(graphs) == 1, graphs
    assert len(graphs[0]) == 1  # one symbolic size, the rows: the vocabulary stays static
    static = CompiledOrEager(chunk_stats, backend=counting, dynamic=None)  # what it was: compiles twice
    torch._dynamo.reset()
    graphs.clear()
    for rows in (8, 5):
        static(torch.randn(rows, 50), torch.randint(0, 50, (rows,)), 0.7)
    assert len(graphs) == 2


def is_compiled(layer) -> bool:
    return "forward" in layer.__dict__  # compile_model sets a compiled forward on the instance


def broken_backend(graph_module, example_inputs):
    raise RuntimeError("this compiler cannot compile anything")


def test_a_function_whose_compilation_fails_runs_eagerly():
    stats = CompiledOrEager(chunk_stats, backend=broken_backend)
    logits, targets = torch.randn(3, 10), torch.tensor([1, 2, 3])
    for a, b in zip(stats(logits, targets, 1.0), chunk_stats(logits, targets, 1.0)):
        torch.testing.assert_close(a, b)
    assert not stats.enabled


def test_decoder_layers_whose_probe_fails_to_compile_stay_eager(base_model):
    model = copy.deepcopy(base_model)
    assert not compile_model(model, device=torch.device("cpu"), dtype=None, backend=broken_backend)
    assert not any(is_compiled(layer) for layer in decoder_layers(model))


def test_compiled_decoder_layers_give_the_eager_forward_and_backward(base_model):
    eager, compiled = copy.deepcopy(base_model), copy.deepcopy(base_model)
    for model in (eager, compiled):
        use_packed_attention(model)
    assert compile_model(compiled, device=torch.device("cpu"), dtype=None, backend="aot_eager")
    assert all(is_compiled(layer) for layer in decoder_layers(compiled))
    batch = make_batch(seed=3)
    results = [grads_of(model, batch, FUSED, entropy_weight=0.1) for model in (eager, compiled)]
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[1][2], results[0][2], atol=1e-6, rtol=1e-4)
    # the state dict keeps its names (checkpoints, the engine's weight sync)
    assert compiled.state_dict().keys() == eager.state_dict().keys()


def test_decoder_layers_compile_with_only_the_token_and_sequence_counts_symbolic(base_model):
    """A new micro-batch shape reuses the compiled layers (after the first real batch, which makes the
    sequence count and the longest sequence symbolic), and the feature sizes stay constants: with every
    size symbolic the SiLU-and-multiply kernel ran at 70% of its static speed on an H200."""
    shapes = []

    def counting(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(value, torch.Tensor):
                shapes.append(tuple(value.shape))
        shapes.append(None)  # one graph ends
        return graph_module.forward

    torch._dynamo.reset()
    model = copy.deepcopy(base_model)
    use_packed_attention(model)
    assert compile_model(model, device=torch.device("cpu"), dtype=None, backend=counting)
    for rows, seed in ((6, 1), (3, 2), (9, 3), (5, 4)):
        batch = make_batch(rows, seed)
        out = response_logprobs(model, batch, temperature=1.0, with_entropy=False, head=FUSED)
        out.logprobs.sum().backward()
        if rows == 6:
            graphs_after_first = shapes.count(None)
    assert shapes.count(None) == graphs_after_first  # token counts 2-4x apart, 3 to 9 sequences: no compile
    tensors = [shape for shape in shapes if shape]
    assert any(isinstance(size, torch.SymInt) for shape in tensors for size in shape)  # the token count
    # hidden states [1, N, 32], queries [N, 4, 8], rotary tables [1, N, 8], weights: feature sizes fixed
    assert all(isinstance(shape[-1], int) for shape in tensors if len(shape) >= 3)


def test_weight_grad_accumulates_as_the_fp32_sum_of_products():
    """CPU: product, cast, add (the path every device can take)."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(16, 40, generator=gen).bfloat16() for _ in range(3)]
    hidden = [torch.randn(16, 8, generator=gen).bfloat16() for _ in range(3)]
    total = torch.zeros(40, 8)
    for g, h in zip(grads, hidden):
        total = add_weight_grad(total, g, h)
    expected = sum(g.float().T @ h.float() for g, h in zip(grads, hidden))
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, expected, atol=0.05, rtol=0.02)


@pytest.mark.gpu
def test_weight_grad_accumulates_in_the_matmul_on_cuda():
    """CUDA: addmm(out_dtype=float32) accumulates the bf16 products in fp32, closer to the fp32 sum than
    the bf16 product rounded before its cast."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    grads = [torch.randn(1024, 4096, device="cuda", generator=gen).bfloat16() for _ in range(4)]
    hidden = [torch.randn(1024, 256, device="cuda", generator=gen).bfloat16() for _ in range(4)]
    total = torch.zeros(4096, 256, device="cuda")
    for g, h in zip(grads, hidden):
        total = add_weight_grad(total, g, h)
    assert logprobs._ADDMM_FP32[0], "torch has no addmm(out_dtype=float32) here: the slow path ran"
    expected = sum(g.float().T @ h.float() for g, h in zip(grads, hidden))
    rounded = sum((g.T @ h).float() for g, h in zip(grads, hidden))
    assert (total - expected).abs().max() <= (rounded - expected).abs().max()
    torch.testing.assert_close(total, expected, atol=0.05, rtol=0.01)


@pytest.mark.gpu
def test_inductor_compiled_layers_match_eager_and_compile_no_more_after_the_first_batch(base_model):
    """CUDA, inductor (what GPU runs compile with): micro-batches of other token and sequence counts give
    the eager logprobs and gradients under bf16 autocast and compile nothing after the first; the flash
    kernel is inside each layer's graph (no graph break: one compiled region a layer)."""
    eager, compiled = (copy.deepcopy(base_model).cuda() for _ in range(2))
    for model in (eager, compiled):
        use_packed_attention(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_model(compiled, device=torch.device("cuda"), dtype=None, autocast_dtype=torch.bfloat16)
    counters = torch._dynamo.utils.counters["stats"]

    def forward_backward(model, batch):
        with torch.autocast("cuda", torch.bfloat16):
            out = response_logprobs(model, batch, temperature=1.0, with_entropy=False, head=FUSED)
        out.logprobs.float().sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return out.logprobs.detach().float(), grads

    for rows, seed in ((6, 1), (3, 2), (9, 3)):
        batch = make_batch(rows, seed).to("cuda")
        (want, want_grads), (got, got_grads) = (forward_backward(m, batch) for m in (eager, compiled))
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
        assert torch.nn.functional.cosine_similarity(got_grads, want_grads, dim=0) > 0.999
        if rows == 6:
            graphs_after_first = counters["unique_graphs"]
    assert counters["unique_graphs"] == graphs_after_first
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
