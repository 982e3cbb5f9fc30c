"""Which tiles a GPU gets (seqpar_kernels/kernels/attention_step_tiles.py) and what the ring
checks before it launches the step kernels (check_launchable).
"""

import itertools
import re

import pytest
import step_kernel_cases as cases
import torch
from step_kernel_cases import DEVICE

from seqpar_kernels.kernels import attention_step_tiles as step_tiles
from seqpar_kernels.parallel.attention_checks import check_launchable


def test_device_target_reads_the_shared_memory(monkeypatch):
    target_of = step_tiles._device_target.__wrapped__  # the uncached function: no real device is asked
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: cases.properties(9, 0, shared_memory_per_block_optin=232448)
    )
    assert target_of(0) == step_tiles.GpuTarget(90, 232448)
    # A torch without shared_memory_per_block_optin: the table, and the smallest
    # size on record for a capability the table does not know.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: cases.properties(12, 0))
    assert target_of(0) == step_tiles.GpuTarget(120, 101376)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: cases.properties(11, 0))
    assert target_of(0) == step_tiles.GpuTarget(110, 101376)


def test_tiles_follow_the_target_family():
    # The sm_90 tiles, replaced where the ahead-of-time compile found a spill or an
    # overflow (see _TILE_OVERRIDES): GQA dk/dv at d128 spills with (32, 128) on
    # every target but sm_90; fp32 dq at d256 overflows 99 KiB of shared memory.
    bf16, fp32 = torch.bfloat16, torch.float32
    target = step_tiles.GpuTarget.of_capability
    assert step_tiles._tiles("dkdv", bf16, 128, target(90)) == (16, 128, 8, 2)
    # sm_90 with tensor descriptors: wide tiles, 3 stages.
    assert step_tiles._tiles("forward", bf16, 128, target(90), tensor_descriptors=True) == (128, 128, 8, 3)
    assert step_tiles._tiles("dkdv", bf16, 128, target(90), intervals=True, tensor_descriptors=True) == (32, 64, 8, 3)
    for capability in (80, 86, 89, 120):
        assert step_tiles._tiles("dkdv", bf16, 128, target(capability)) == (32, 64, 8, 2), capability
    assert step_tiles._tiles("dkdv", bf16, 128, target(100)) == (16, 64, 8, 2)
    assert step_tiles._tiles("dq", fp32, 256, target(80)) == (16, 32, 8, 2)
    for capability in (86, 89, 120, 121):
        assert step_tiles._tiles("dq", fp32, 256, target(capability)) == (16, 16, 8, 2), capability
    assert step_tiles._tiles("dq", fp32, 256, step_tiles.GpuTarget(110, 101376)) == (16, 16, 8, 2)
    assert step_tiles._tiles("forward", bf16, 64, target(100)) == (128, 64, 8, 3)
    assert step_tiles._tiles("forward", bf16, 64, None) == step_tiles._INTERPRETER_TILES
    # The soft-capped scores keep the tiles but for sm_120's interval dq at d128,
    # which spills in its loops with two stages.
    for capability in (80, 86, 90, 100, 120):
        for kernel, intervals in itertools.product(("forward", "dq", "dkdv"), (False, True)):
            capped = step_tiles._tiles(kernel, bf16, 128, target(capability), intervals=intervals, softcap=True)
            plain = step_tiles._tiles(kernel, bf16, 128, target(capability), intervals=intervals)
            expected = (128, 32, 8, 1) if (capability, kernel, intervals) == (120, "dq", True) else plain
            assert capped == expected, (capability, kernel, intervals)
    with pytest.raises(ValueError, match="sm_75"):
        target(75)


def test_value_head_dim_takes_the_tiles_of_the_wider_dim():
    # v of another head dim than q and k: VALUE_DIM and its BLOCK_DV beside
    # HEAD_DIM and BLOCK_D, the tiles of the wider BLOCK_D (what fits there
    # for both dims fits the pair) but for sm_90's dk/dv, whose full-mask MHA
    # kernel serializes its wgmma with those at BLOCK_D 64 or 128 and whose
    # fp32 kernel spills at 192/128 (_VALUE_DIM_TILE_OVERRIDES); without
    # value_dim, v's head dim is q's.
    from seqpar_kernels.kernels import attention_step_launch as launchers

    bf16, target = torch.bfloat16, step_tiles.GpuTarget.of_capability
    sm_90_dkdv = {
        (bf16, 64, 80): (64, 32, 8, 2),
        (bf16, 80, 64): (64, 32, 8, 2),
        (torch.float32, 192, 128): (16, 16, 4, 2),
    }
    for capability in (80, 90, 100, 120):
        for dtype, headdim, value_dim, wider in (
            (bf16, 192, 128, 256),
            (bf16, 64, 80, 128),
            (bf16, 80, 64, 128),
            (torch.float32, 192, 128, 256),
        ):
            options = dict(target=target(capability), interpreted=False)
            launches = [
                step_tiles.forward_launch(dtype, headdim, True, value_dim=value_dim, **options),
                *step_tiles.backward_launches(dtype, headdim, True, value_dim=value_dim, **options),
            ]
            alike = [
                step_tiles.forward_launch(dtype, wider, True, **options),
                *step_tiles.backward_launches(dtype, wider, True, **options),
            ]
            for kernel, launch, one_dim in zip(("forward", "dq", "dkdv"), launches, alike):
                blocks = {name: launch.constexprs[name] for name in ("HEAD_DIM", "VALUE_DIM", "BLOCK_D", "BLOCK_DV")}
                assert blocks == dict(
                    HEAD_DIM=headdim,
                    VALUE_DIM=value_dim,
                    BLOCK_D=step_tiles._block_d(headdim),
                    BLOCK_DV=step_tiles._block_d(value_dim),
                )
                tiles = (
                    launch.constexprs["BLOCK_M"],
                    launch.constexprs["BLOCK_N"],
                    launch.num_warps,
                    launch.num_stages,
                )
                expected = (
                    one_dim.constexprs["BLOCK_M"],
                    one_dim.constexprs["BLOCK_N"],
                    one_dim.num_warps,
                    one_dim.num_stages,
                )
                if capability == 90 and kernel == "dkdv":
                    expected = sm_90_dkdv.get((dtype, headdim, value_dim), expected)
                assert tiles == expected, (capability, kernel, dtype, headdim, value_dim)
    one = step_tiles.forward_launch(bf16, 80, False, target=None, interpreted=True).constexprs
    assert (one["VALUE_DIM"], one["BLOCK_DV"]) == (80, 128)
    # What the ahead-of-time table compiles: out and dout of v's head dim, dq of q's,
    # dk of k's, dv of v's; sm_90 takes tensor descriptors where both dims are
    # within 128.
    for headdim, value_dim, descriptors in ((192, 128, False), (96, 64, step_tiles.TENSOR_DESCRIPTORS_AVAILABLE)):
        q = torch.empty(2, 256, 8, headdim, dtype=bf16, device="meta")
        k = torch.empty(2, 256, 2, headdim, dtype=bf16, device="meta")
        v = torch.empty(2, 256, 2, value_dim, dtype=bf16, device="meta")
        calls = launchers.cuda_kernel_calls(q, k, v, cases.MASK_CAUSAL, target(90))
        forward, preprocess, dq, dkdv = calls[0][1], calls[2][1], calls[3][1], calls[4][1]
        assert forward[3].shape == (2, 256, 8, value_dim)  # out
        assert preprocess[0].shape == preprocess[1].shape == (2, 256, 8, value_dim)  # out, dout
        assert dq[3].shape == (2, 256, 8, value_dim) and dq[6].shape == q.shape  # dout, dq
        assert dkdv[6].shape == k.shape and dkdv[7].shape == v.shape  # dk, dv
        for launch, _ in calls:
            assert launch.constexprs.get("TENSOR_DESCRIPTORS", descriptors) is descriptors


def test_tiles_follow_the_triton_release(monkeypatch):
    # Triton 3.6 serializes the wgmma of sm_90's bf16 d128 dk/dv tile: that entry only
    # differs, and only on sm_90 and under 3.6.
    bf16, target = torch.bfloat16, step_tiles.GpuTarget.of_capability
    shipped = {(kernel, capability): step_tiles._tiles(kernel, bf16, 128, target(capability))
               for kernel in ("forward", "dq", "dkdv") for capability in (80, 90, 100)}  # fmt: skip
    monkeypatch.setattr(step_tiles, "TRITON_RELEASE", (3, 6))
    for (kernel, capability), tiles in shipped.items():
        expected = (32, 64, 8, 2) if (kernel, capability) == ("dkdv", 90) else tiles
        assert step_tiles._tiles(kernel, bf16, 128, target(capability)) == expected, (kernel, capability)
    assert (32, 64, 8, 2) in step_tiles.all_cuda_tiles()


def test_check_launchable_refuses_old_gpus_and_grids_over_the_cuda_limit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: cases.properties(7, 5))
    with pytest.raises(ValueError, match=r"sm_75 \(q \(2, 16, 4, 64\)\)"):
        check_launchable(cases.cuda_stand_in((2, 16, 4, 64)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: cases.properties(8, 0))
    check_launchable(cases.cuda_stand_in((2, 16, 4, 64)))
    check_launchable(cases.cuda_stand_in((65535, 1, 65535, 8)))
    for shape in ((65536, 1, 4, 8), (1, 1, 65536, 8)):
        with pytest.raises(ValueError, match=re.escape(f"got q shape {shape}")):
            check_launchable(cases.cuda_stand_in(shape))


def test_check_launchable_passes_cpu_tensors_without_asking_for_a_gpu(monkeypatch):
    def no_gpu(device):
        raise AssertionError("a CPU tensor needs no GPU properties")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    check_launchable(torch.empty(65536, 1, 65536, 0))


@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="the grid limit applies to CUDA tensors; without a GPU "
    "test_check_launchable_refuses_old_gpus_and_grids_over_the_cuda_limit covers it",
)
@pytest.mark.parametrize("shape_q, shape_kv", [((1, 2, 65536, 8), (1, 2, 1, 8)), ((65536, 2, 1, 8), (65536, 2, 1, 8))])
def test_ring_attention_refuses_a_grid_over_the_cuda_limit(shape_q, shape_kv):
    import seqpar_kernels as sp

    q = torch.zeros(shape_q, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(shape_kv, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape(f"got q shape {shape_q}")):
        sp.ring_attention(q, k, k)
