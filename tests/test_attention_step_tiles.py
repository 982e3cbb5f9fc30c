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
