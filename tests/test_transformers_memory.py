"""Memory for long sequences (seqpar_kernels.integrations.transformers.memory): MLPs in
tiles of tokens (tile_mlp) and activations offloaded to host memory
(offload_activations), in one process.

The tiled MLP's loss and gradients equal the untiled ones (fp32: 1e-6 / 1e-5; bf16
under autocast: within twice the untiled error against fp64), and its peak is bounded
by one tile's intermediates plus what scales with the tokens alone (the output and the
input's gradient), a bound the untiled MLP exceeds. Offloaded activation checkpoints
give the same gradients and lower the allocator's peak by at least the checkpoints of
all layers but one. Peaks: the CPU allocator's own counters (peak_cpu_memory). And on
2 gloo ranks, a tensor-parallel MLP (DTensor parameters, activations inside it DTensors)
tiled and offloaded gives the whole MLP's gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from conftest import pool_for  # noqa: E402

from seqpar_kernels.testing import peak_cpu_memory  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB = 64, 256, 128


def _model(layers: int = 2, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         use_cache=False, max_position_embeddings=4096)  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


def _loss_and_grads(model, ids, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [parameter.grad.clone() for parameter in model.parameters()]


def _relative(mine: torch.Tensor, expected: torch.Tensor) -> float:
    return ((mine.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def test_tiled_mlp_gives_the_untiled_gradients():
    from seqpar_kernels.integrations.transformers import tile_mlp, untile_mlp

    ids = torch.randint(0, VOCAB, (2, 77), generator=torch.Generator().manual_seed(1))
    model = _model()
    tiled = copy.deepcopy(model)
    names = list(tiled.state_dict())
    assert tile_mlp(tiled, 16) == 2  # 154 tokens: 9 full tiles and one of 10
    assert list(tiled.state_dict()) == names  # checkpoints are unchanged
    expected_loss, expected = _loss_and_grads(model, ids)
    loss, grads = _loss_and_grads(tiled, ids)
    assert _relative(loss, expected_loss) <= 1e-6
    for (name, _), grad, reference in zip(model.named_parameters(), grads, expected):
        assert _relative(grad, reference) <= 1e-5, name
    # bf16 under autocast: the tiles recompute under the forward's autocast.
    exact = copy.deepcopy(model).double()
    _, exact_grads = _loss_and_grads(exact, ids)
    _, untiled_bf16 = _loss_and_grads(model, ids, autocast=True)
    _, tiled_bf16 = _loss_and_grads(tiled, ids, autocast=True)
    for (name, _), ours, plain, reference in zip(model.named_parameters(), tiled_bf16, untiled_bf16, exact_grads):
        assert _relative(ours, reference) <= 2 * _relative(plain, reference) + 1e-3, name
    assert untile_mlp(tiled) == 2
    assert _relative(_loss_and_grads(tiled, ids)[0], expected_loss) <= 1e-6


def test_tiled_mlp_peak_is_bounded_by_one_tile():
    from seqpar_kernels.integrations.transformers import tile_mlp

    tokens, tile = 2048, 32
    mlp = _model().model.layers[0].mlp
    tiled_layer = copy.deepcopy(_model())
    tile_mlp(tiled_layer, tile)
    tiled = tiled_layer.model.layers[0].mlp
    x = torch.randn(1, tokens, HIDDEN, requires_grad=True, generator=torch.Generator().manual_seed(2))

    def forward_backward(module):
        x.grad = None
        for parameter in module.parameters():
            parameter.grad = None
        module(x).sum().backward()

    parameter_bytes = sum(parameter.numel() * 4 for parameter in mlp.parameters())
    # What scales with the tokens but not with the intermediate size: the output and the
    # input's gradient; the parameters' gradients and their fp32 sums; then one tile's
    # intermediates (gate, up, their activation and product, and their gradients in the
    # backward: at most 8 of (tile, intermediate) in fp32).
    bound = 2 * tokens * HIDDEN * 4 + 2 * parameter_bytes + 8 * tile * INTERMEDIATE * 4
    _, tiled_peak = peak_cpu_memory(forward_backward, tiled)
    _, untiled_peak = peak_cpu_memory(forward_backward, mlp)
    assert tiled_peak <= bound, (tiled_peak, bound)
    assert untiled_peak > bound, (untiled_peak, bound)  # the bound is one the untiled MLP does not meet


def test_tile_mlp_refuses_mixtures_of_experts():
    from transformers import MixtralConfig, MixtralForCausalLM

    from seqpar_kernels.integrations.transformers import tile_mlp

    model = MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=2))  # fmt: skip
    with pytest.raises(ValueError, match="experts|no decoder layer"):
        tile_mlp(model)
    with pytest.raises(ValueError, match="tile_tokens"):
        tile_mlp(_model(), 0)


def test_offloaded_checkpoints_give_the_same_gradients_in_less_memory():
    from seqpar_kernels.integrations.transformers import offload_activations

    layers, tokens = 4, 512
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(3))
    model = _model(layers)
    model.gradient_checkpointing_enable()
    model.train()

    def step(offload):
        model.zero_grad(set_to_none=True)
        hooks = offload_activations(min_bytes=tokens * HIDDEN * 4 // 2) if offload else None
        if hooks is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            with hooks:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [parameter.grad.clone() for parameter in model.parameters()], hooks

    step(False)  # buffers made on first use
    (expected_loss, expected, _), plain_peak = peak_cpu_memory(step, False)
    (loss, grads, hooks), offloaded_peak = peak_cpu_memory(step, True)
    assert _relative(loss, expected_loss) == 0.0
    assert all(_relative(grad, reference) == 0.0 for grad, reference in zip(grads, expected))
    checkpoint = tokens * HIDDEN * 4
    assert hooks.offloaded_bytes >= layers * checkpoint
    # At the peak (a layer's recompute in the backward) the other layers' checkpoints
    # are in host memory.
    assert plain_peak - offloaded_peak >= (layers - 1) * checkpoint, (plain_peak, offloaded_peak)


def test_offload_keeps_parameters_and_their_views():
    """A linear layer saves its input and its weight transposed (a view of the
    parameter): only the input is offloaded, the weight stays (trained or frozen), and
    the gradients are the plain ones."""
    from seqpar_kernels.integrations.transformers import offload_activations

    torch.manual_seed(0)
    layer = torch.nn.Linear(HIDDEN, INTERMEDIATE)
    frozen = torch.nn.Linear(INTERMEDIATE, HIDDEN).requires_grad_(False)
    x = torch.randn(8, HIDDEN, requires_grad=True)
    expected = torch.autograd.grad(frozen(layer(x)).square().sum(), (x, layer.weight))
    with offload_activations(min_bytes=0) as hooks:
        out = frozen(layer(x * 1.0)).square().sum()  # x * 1.0: an activation, not a leaf
    grads = torch.autograd.grad(out, (x, layer.weight))
    # Offloaded: layer's input and the square's input (8 x HIDDEN each, fp32; frozen's input is not
    # saved, its weight needs no gradient); never a weight (64 KiB each, transposed views).
    assert hooks.offloaded_bytes == 4 * 8 * 2 * HIDDEN, hooks.offloaded_bytes
    assert all(torch.equal(ours, plain) for ours, plain in zip(grads, expected))


def run_tensor_parallel_mlp() -> dict:
    """On each of 2 ranks: a Llama MLP sharded as its tensor-parallel plan says (gate/up
    column-wise, down row-wise), tiled by 16 tokens, and untiled under
    offload_activations (min_bytes=0: every saved activation offloaded, the DTensors
    inside the sharded layers too), against the whole MLP: the input's and every
    parameter's gradient (relative max error)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from seqpar_kernels.integrations.transformers import offload_activations, tile_mlp

    whole = _model(layers=1).model.layers[0]
    x = torch.randn(2, 37, HIDDEN, generator=torch.Generator().manual_seed(4))  # 74 tokens: 4 tiles and one of 10
    x_whole = x.clone().requires_grad_(True)
    whole.mlp(x_whole).square().sum().backward()
    mesh = init_device_mesh("cpu", (2,))
    errors, offloaded = {}, {}
    for kind in ("tiled", "offloaded"):
        layer = copy.deepcopy(whole)
        layer.zero_grad(set_to_none=True)
        plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        parallelize_module(layer.mlp, mesh, plan)
        x_ours = x.clone().requires_grad_(True)
        if kind == "tiled":
            assert tile_mlp(layer, 16) == 1
            layer.mlp(x_ours).square().sum().backward()
        else:
            saved = []

            class Counting(offload_activations):  # counts the DTensors it offloads
                def _pack(self, tensor):
                    packed = super()._pack(tensor)
                    saved.append(isinstance(tensor, DTensor) and packed is not tensor)
                    return packed

            with Counting(min_bytes=0) as hooks:
                out = layer.mlp(x_ours)
            out.square().sum().backward()
            offloaded = {"bytes": hooks.offloaded_bytes, "dtensors offloaded": sum(saved)}
        errors[kind] = {"x": _relative(x_ours.grad, x_whole.grad)}
        for (name, parameter), reference in zip(layer.mlp.named_parameters(), whole.mlp.parameters()):
            errors[kind][name] = _relative(parameter.grad.full_tensor(), reference.grad)
    return {"errors": errors, "offloaded": offloaded}


def test_tiled_and_offloaded_tensor_parallel_mlp_gives_the_whole_gradients():
    for result in pool_for(2).run(run_tensor_parallel_mlp):
        assert result["offloaded"]["bytes"] > 0 and result["offloaded"]["dtensors offloaded"] > 0, result["offloaded"]
        for kind, errors in result["errors"].items():
            assert all(error <= 1e-5 for error in errors.values()), (kind, errors)
