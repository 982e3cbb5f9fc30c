"""Compile Triton kernels ahead of time for a GPU that is not here, and read the SASS.

One tool in one file (over 500 lines): the compile, the SASS reading, the record and the
table share the launch descriptions and the compile key (its source up to the record
section).

Triton normally compiles a kernel at its first launch, on the GPU that runs it.
Its compiler needs no GPU, though: given a target (``GPUTarget("cuda", 90, 32)``
for an H100) it produces the cubin a launch would, and the cubin records the
resources the kernel takes.  That lets a machine without a GPU check what would
otherwise only show on one:

- that every launch configuration compiles for each target (sm_80, sm_86,
  sm_90, sm_100, sm_120 by default);
- that its shared memory fits the target (Triton would refuse the launch with
  ``OutOfResources``);
- that its registers do not spill inside a loop.  A spilling attention kernel
  still runs and is still correct, only slower, so no correctness test would
  catch it;
- what ptxas said about it.  Triton drops the ptxas log of a kernel that
  compiled; among its lines are the advisories that cost the most without
  failing anything, e.g. ``(C7515) Potential Performance Loss: wgmma.mma_async
  instructions are serialized ...``: every Hopper warpgroup product then waits
  for the previous one;
- how many SASS instructions one iteration of each kernel's hot loop (the K/V
  sweep of the forward, the sweeps of dq and of dk/dv) executes, and how many of
  them are tensor-core products.  Each is set next to a tutorial-style
  FlashAttention-2 kernel compiled with the same tiles
  (reference_kernels.py), which says what the step kernel's extra work costs
  per iteration.

The same SASS reading applies to the CUDA pack/unpack kernels of the built
extension (csrc/cuda/block_copy.cu): instructions per 16-byte unit in their
copy loops.

Compiling every launch for every target takes about 23 minutes on 2 cores
with a cold Triton cache.  A record (``--record FILE``, JSON) keeps each
compiled kernel's row under a key of everything its compile and the reading of
its SASS depend on (compile_key); a run takes the rows whose key it finds there
and compiles the rest, and ``--update-record`` writes the record of the run.

Used by tests/test_attention_step_ahead_of_time.py; ``python -m
tools.ahead_of_time`` (from the repository's root) prints the table of every
launch (``--help`` for the options).  A developer tool of the checkout: it is
not installed with the package.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton

from seqpar_kernels.kernels.attention_step_tiles import (
    SHARED_MEMORY_PER_BLOCK,
    GpuTarget,
    KernelLaunch,
    uses_tensor_descriptors,
)

# One target per family of tile choices (attention_step_tiles._TILE_OVERRIDES): H100
# (wgmma), A100 (mma.sync, 163 KiB of shared memory per block), RTX 30xx/40xx
# (mma.sync, 99 KiB; sm_89 compiles like sm_86), B200 (tcgen05), RTX 50xx
# (mma.sync, 99 KiB).
DEFAULT_CAPABILITIES = (90, 80, 86, 100, 120)

_TRITON_TYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel takes from the streaming multiprocessor, what
    ptxas said about it, and what its hot loop executes per iteration."""

    kernel: str
    capability: int
    shared_memory_bytes: int
    registers: int  # per thread; 255 is the hardware maximum
    spill_bytes: int  # per-thread stack + local memory: 0 means nothing spilled
    spills_in_loops: int  # local-memory loads/stores (STL/LDL) inside a loop of the SASS
    loops: int  # loops found in the SASS: a check that the parse saw them
    num_warps: int
    # SASS instructions in the body of the hot loop (see hot_loop), 0 without a
    # loop, and the tensor-core products (HMMA, HGMMA, UTC*MMA, ...) among them.
    loop_instructions: int
    loop_matrix_instructions: int
    # (instructions, tensor-core products) of every innermost loop that does the
    # kernel's arithmetic, in address order: the hot loop is one of them.
    compute_loops: tuple[tuple[int, int], ...]
    # ptxas's warnings and numbered advisories, without its -v statistics.
    ptxas_warnings: tuple[str, ...]


def _specialize(launch: KernelLaunch, args: tuple) -> tuple[dict, dict, dict]:
    """Triton's signature, constexprs and attributes for a launch of ``launch``
    with the runtime arguments ``args``: what its JIT would derive when called.

    The JIT specializes on argument values, and the specialization changes the
    code: an integer equal to 1 (a unit stride) becomes a compile-time constant,
    which lets loads vectorize; a pointer or integer divisible by 16 is marked so;
    None is a compile-time constant.
    Tensors (meta tensors will do) stand for pointers to 16-byte-aligned memory,
    as torch allocates it.
    """
    names = [name for name in launch.kernel.arg_names if name not in launch.constexprs]
    assert len(names) == len(args), f"{launch.kernel.__name__} takes {names}, got {len(args)} arguments"
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for index, (name, value) in enumerate(zip(names, args)):
        position = (launch.kernel.arg_names.index(name),)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPE[value.dtype]
            attrs[position] = [["tt.divisibility", 16]]
        elif value is None:  # e.g. a pointer the kernel does not read in this mode
            signature[name] = "constexpr"
            constexprs[name] = None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"argument {index} ({name}) of {launch.kernel.__name__}: {value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[position] = [["tt.divisibility", 16]]
    for name in launch.constexprs:
        signature[name] = "constexpr"
    return {name: signature[name] for name in launch.kernel.arg_names}, constexprs, attrs


def _nvidia_tool(name: str) -> str:
    # Triton ships the CUDA binary utilities it uses; a CUDA toolkit has them too.
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    for candidate in (
        bundled,
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name),
        shutil.which(name),
    ):
        if candidate and os.path.exists(candidate):
            return candidate
    raise RuntimeError(f"{name} not found (neither bundled with triton nor in CUDA_HOME/bin)")


def _cuobjdump() -> str:
    return _nvidia_tool("cuobjdump")


# ----------------------------------------------------------------------------
# Reading SASS: instructions, control flow, loops
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SassInstruction:
    address: int
    guard: str  # the predicate that guards it, e.g. "!P1" or "UP0"; "" when unguarded
    opcode: str  # with its modifiers, e.g. "HGMMA.64x64x16.F32.BF16"
    operands: str

    @property
    def base(self) -> str:
        """The opcode without modifiers: "LDG" for "LDG.E.128"."""
        return self.opcode.split(".")[0]


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@(!?\w+)\s+)?([A-Z][\w.]*)\s*([^;]*);")


def sass_instructions(listing: str) -> list[SassInstruction]:
    """The instructions of one function's SASS listing (cuobjdump -sass), in
    address order; the encoding comments are dropped."""
    return [
        SassInstruction(int(address, 16), guard or "", opcode, operands.strip())
        for address, guard, opcode, operands in _INSTRUCTION.findall(listing)
    ]


@dataclass(frozen=True)
class SassLoop:
    """One natural loop of a function's control-flow graph."""

    header: int  # address of its first instruction
    instructions: tuple[SassInstruction, ...]  # its body, in address order
    inner_loops: int  # loops nested inside it
    # The body as blocks in a topological order of its forward edges (the
    # header first), each block's predecessors by forward edges (indices into
    # blocks), and the blocks that branch back to the header.
    blocks: tuple[tuple[SassInstruction, ...], ...]
    forward_predecessors: tuple[tuple[int, ...], ...]
    latches: tuple[int, ...]

    def count(self, predicate) -> int:
        return sum(1 for instruction in self.instructions if predicate(instruction))

    def heaviest_path(self, weight) -> tuple[SassInstruction, ...]:
        """The instructions of one iteration: the path through the body from
        the header to a branch back to it with the largest sum of
        ``weight(instruction)``, of those the longest; an inner loop's body is
        on it once.  Where the body branches (e.g. on which way a copy goes),
        the static body counts both arms, one iteration runs one."""
        best = []  # per block: (weight, instructions, previous block) of the heaviest path to its end
        for position, block in enumerate(self.blocks):
            here = (sum(weight(instruction) for instruction in block), len(block))
            if position == 0:
                best.append((*here, None))
                continue
            sources = [source for source in self.forward_predecessors[position] if best[source] is not None]
            if not sources:
                best.append(None)
                continue
            source = max(sources, key=lambda s: best[s][:2])
            best.append((best[source][0] + here[0], best[source][1] + here[1], source))
        ends = [latch for latch in self.latches if best[latch] is not None]
        if not ends:
            return ()
        path, position = [], max(ends, key=lambda latch: best[latch][:2])
        while position is not None:
            path.append(position)
            position = best[position][2]
        return tuple(instruction for position in reversed(path) for instruction in self.blocks[position])


# Instructions after which control does not simply fall through to the next one.
_BRANCHES = {"BRA", "JMP", "BRX", "JMX"}
_ENDS = {"EXIT", "RET", "KILL", "BPT"}


def _branch_target(instruction: SassInstruction) -> int | None:
    if instruction.base not in ("BRA", "JMP"):
        return None
    match = re.search(r"(-?)0x([0-9a-f]+)\s*$", instruction.operands)
    return None if match is None or match.group(1) else int(match.group(2), 16)


def _is_conditional(instruction: SassInstruction) -> bool:
    # Guarded by a predicate other than the always-true PT, or a branch on a
    # predicate operand ("BRA.U !UP0, 0x140", "BRA.DIV UR4, 0x2f0").
    return instruction.guard not in ("", "PT") or "," in instruction.operands


def sass_loops(instructions: list[SassInstruction]) -> list[SassLoop]:
    """The natural loops of a function: a branch to a block that dominates it
    closes a loop, whose body is every block that reaches the branch without
    passing that block.

    Dominance, not just a branch to a lower address, tells a loop apart from
    the out-of-line blocks ptxas puts after the function's EXIT: an mbarrier
    wait that has to retry (sm_100's tensor-core loops) branches to a spin loop
    at the end and from there back into the middle of the code, a backward
    branch that closes no loop.  The spin loop itself is a loop, nested in the
    loop it was reached from.  Blocks only reached through CALL (ptxas's
    subroutines, e.g. the slow path of a division) are left out."""
    count = len(instructions)
    if count == 0:
        return []
    index = {instruction.address: position for position, instruction in enumerate(instructions)}
    starts = {0}
    for position, instruction in enumerate(instructions):
        if instruction.base in _BRANCHES or instruction.base in _ENDS:
            starts.add(position + 1)
            target = _branch_target(instruction)
            if target in index:
                starts.add(index[target])
    starts = sorted(start for start in starts if start < count)
    block_of_start = {start: block for block, start in enumerate(starts)}
    ends = starts[1:] + [count]
    successors = []
    for block, end in enumerate(ends):
        last = instructions[end - 1]
        following = [block + 1] if end < count else []
        if last.base in _BRANCHES:
            target = _branch_target(last)
            targets = [block_of_start[index[target]]] if target in index else []
            successors.append(targets + (following if _is_conditional(last) else []))
        elif last.base in _ENDS:
            successors.append(following if _is_conditional(last) else [])
        else:
            successors.append(following)

    # Blocks reachable from the entry, in reverse postorder.
    order, seen, stack = [], {0}, [(0, iter(successors[0]))]
    while stack:
        block, pending = stack[-1]
        following = next(pending, None)
        if following is None:
            order.append(block)
            stack.pop()
        elif following not in seen:
            seen.add(following)
            stack.append((following, iter(successors[following])))
    order.reverse()
    predecessors = {block: [] for block in order}
    for block in order:
        for following in successors[block]:
            predecessors[following].append(block)

    # Dominators as bit sets, iterated to the fixed point.
    everything = (1 << len(starts)) - 1
    dominators = {block: everything for block in order}
    dominators[0] = 1
    changed = True
    while changed:
        changed = False
        for block in order[1:]:
            common = everything
            for predecessor in predecessors[block]:
                common &= dominators[predecessor]
            common |= 1 << block
            if common != dominators[block]:
                dominators[block], changed = common, True

    bodies: dict[int, set[int]] = {}
    for block in order:
        for header in successors[block]:
            if dominators[block] >> header & 1:  # a back edge block -> header
                body = bodies.setdefault(header, {header})
                stack = [block]
                while stack:
                    member = stack.pop()
                    if member not in body:
                        body.add(member)
                        stack.extend(predecessors[member])
    rank = {block: position for position, block in enumerate(order)}
    loops = []
    for header, body in sorted(bodies.items()):
        members = tuple(
            instruction for block in sorted(body) for instruction in instructions[starts[block] : ends[block]]
        )
        inner = sum(1 for other in bodies.values() if other < body)
        # Reverse postorder puts every forward edge's source before its target.
        in_order = sorted(body, key=rank.__getitem__)
        position = {block: index for index, block in enumerate(in_order)}
        forward = tuple(
            tuple(
                position[source]
                for source in predecessors[block]
                if source in body and not dominators[source] >> block & 1
            )
            for block in in_order
        )
        latches = tuple(position[block] for block in in_order if header in successors[block])
        loops.append(
            SassLoop(
                instructions[starts[header]].address,
                members,
                inner,
                tuple(tuple(instructions[starts[block] : ends[block]]) for block in in_order),
                forward,
                latches,
            )
        )
    return loops


def is_matrix_instruction(instruction: SassInstruction) -> bool:
    """A tensor-core product: HMMA (mma.sync), HGMMA (wgmma), UTCHMMA and the
    other UTC*MMA (tcgen05), IMMA, DMMA, ..."""
    return instruction.base.endswith("MMA")


def _is_spill_access(instruction: SassInstruction) -> bool:
    return instruction.base in ("STL", "LDL")


def _is_fma(instruction: SassInstruction) -> bool:
    return instruction.base == "FFMA"


def hot_loop(loops: list[SassLoop]) -> tuple[SassLoop | None, list[SassLoop]]:
    """(the hot loop, every compute loop) of an attention kernel.

    A compute loop is an innermost loop of the arithmetic: one that holds
    tensor-core products (FFMAs where the kernel has none: fp32 products are
    computed as FMAs) while no loop nested in it does; spin loops of mbarrier
    waits do not count as nesting.  The hot loop is the compute loop with the
    most products, and of those the smallest: where a sweep is split in two
    (the forward's whole k tiles, then the diagonal or partial ones with their
    masks), the unmasked loop runs every iteration but the last few."""
    work = is_matrix_instruction if any(loop.count(is_matrix_instruction) for loop in loops) else _is_fma
    computing = [loop for loop in loops if loop.count(work)]
    members = {id(loop): {instruction.address for instruction in loop.instructions} for loop in computing}
    innermost = [
        loop
        for loop in computing
        if not any(other is not loop and members[id(other)] < members[id(loop)] for other in computing)
    ]
    innermost.sort(key=lambda loop: loop.header)
    if not innermost:
        return None, []
    return max(innermost, key=lambda loop: (loop.count(work), -len(loop.instructions))), innermost


def spills_in_loops(loops: list[SassLoop]) -> int:
    """Local-memory accesses (spill stores STL, reloads LDL) inside any loop.  A
    spill in the prologue or the epilogue costs a few cycles once per program;
    one inside the K/V sweep costs every iteration."""
    addresses = {
        instruction.address for loop in loops for instruction in loop.instructions if _is_spill_access(instruction)
    }
    return len(addresses)


# ----------------------------------------------------------------------------
# ptxas's log
# ----------------------------------------------------------------------------

# Where the log travels: a key of the compiled kernel's metadata, which Triton's
# cache keeps with the cubin.
_PTXAS_LOG = "seqpar_ptxas_log"


def _keep_ptxas_log(*hook_args):
    """A Triton stages hook (knobs.runtime.add_stages_inspection_hook) that keeps
    ptxas's log of each kernel in its metadata.

    Called without arguments, it names itself for Triton's cache key: a kernel
    cached without the log is then never found for one that wants it.  Called
    with the backend's stages, it wraps the cubin stage: Triton prints the ptxas
    log when asked to (knobs.nvidia.dump_ptxas_log), and the wrapper takes that
    print instead of the console.  Triton's own ptxas run is the one logged, so
    the log costs no second compile (a rerun of ptxas would add up to a second
    per kernel)."""
    if not hook_args:
        return _PTXAS_LOG, _PTXAS_LOG
    _backend, stages, *_ = hook_args
    make_cubin = stages.get("cubin")
    if make_cubin is None:
        return

    def make_cubin_keeping_log(src, metadata):
        nvidia = triton.knobs.nvidia
        dump, nvidia.dump_ptxas_log = nvidia.dump_ptxas_log, True
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                cubin = make_cubin(src, metadata)
        finally:
            nvidia.dump_ptxas_log = dump
        metadata[_PTXAS_LOG] = log.getvalue()
        return cubin

    stages["cubin"] = make_cubin_keeping_log


@contextlib.contextmanager
def _ptxas_log_kept():
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if not (hasattr(runtime, "add_stages_inspection_hook") and hasattr(knobs.nvidia, "dump_ptxas_log")):
        yield  # an older Triton: _ptxas_log compiles the PTX again
        return
    previous, runtime.add_stages_inspection_hook = runtime.add_stages_inspection_hook, _keep_ptxas_log
    try:
        yield
    finally:
        runtime.add_stages_inspection_hook = previous


def _ptxas_log(compiled, capability: int) -> str:
    """ptxas's log of ``compiled``: the one Triton's compile kept, or, where this
    Triton has no stages hook, that of the bundled ptxas run again on its PTX for
    the same architecture (e.g. sm_90a, whose wgmma a plain sm_90 does not have)."""
    log = getattr(compiled.metadata, _PTXAS_LOG, None)
    if log is not None:
        return log
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    ptxas = _nvidia_tool(
        "ptxas-blackwell"
        if capability >= 100
        and os.path.exists(
            os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
        )
        else "ptxas"
    )
    fmad = [] if getattr(compiled.metadata, "enable_fp_fusion", True) else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as scratch:
        ptx = os.path.join(scratch, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        result = subprocess.run(
            [
                ptxas,
                "-lineinfo",
                "-v",
                *fmad,
                f"--gpu-name={sm_arch_from_capability(capability)}",
                ptx,
                "-o",
                os.path.join(scratch, "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    return result.stdout + result.stderr


def ptxas_diagnostics(log: str) -> tuple[str, ...]:
    """The lines of a ptxas log that are not its -v statistics: its warnings and
    its numbered advisories, which -v prints as info, e.g. "(C7515) Potential
    Performance Loss: wgmma.mma_async instructions are serialized due to ...".
    Without its "ptxas warning :" prefix, each once."""
    lines = []
    for line in log.splitlines():
        match = re.match(r"\s*ptxas\s+(warning|info)\s*:\s*(.*)", line)
        if match and (match.group(1) == "warning" or re.match(r"\(C\d+\)", match.group(2))):
            lines.append(match.group(2).strip())
    return tuple(dict.fromkeys(lines))


def is_serialization_warning(text: str) -> bool:
    """Whether a ptxas diagnostic says that it serialized the tensor-core work:
    C7515 (a wgmma's accumulator defined by other instructions inside its
    pipeline stage) and the others of its kind (C7509, C7510, ..., all worded
    "Potential Performance Loss: ... serialized ...").  Each wgmma then waits
    for the one before it, which on an H100 can halve a kernel's throughput."""
    lowered = text.lower()
    return "serialized" in lowered or "potential performance loss" in lowered


def short_diagnostics(diagnostics) -> str:
    """ "C7515" or "C7515,C7510" (warnings without a code count as "W"); "-" for none."""
    codes = [(re.match(r"\((C\d+)\)", text) or [None, "W"])[1] for text in diagnostics]
    return ",".join(dict.fromkeys(codes)) or "-"


# ----------------------------------------------------------------------------
# Compiling one launch
# ----------------------------------------------------------------------------


def compile_for_gpu(launch: KernelLaunch, args: tuple, capability: int) -> KernelResources:
    """Compile ``launch`` as a call with the runtime arguments ``args`` would, for
    an NVIDIA GPU of compute capability ``capability`` (90: H100/H200, 80: A100),
    and report what the cubin takes.  The target must be one the ptxas bundled
    with Triton knows (sm_100 and sm_120 need CUDA 12.8's or newer)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = _specialize(launch, args)
    source = ASTSource(launch.kernel, signature, constexprs=constexprs, attrs=attrs)
    with _ptxas_log_kept():
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", capability, 32),
            options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages),
        )
    with tempfile.TemporaryDirectory() as scratch:
        cubin = os.path.join(scratch, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    # e.g. "REG:255 STACK:904 SHARED:1024 LOCAL:0 CONSTANT[0]:752 ..." (SHARED is the
    # static part only; Triton's dynamic shared memory is in the metadata).
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    assert "REG" in fields, f"no resource usage for {launch.kernel.__name__}:\n{usage}"
    loops = sass_loops(sass_instructions(sass))
    hot, computing = hot_loop(loops)
    return KernelResources(
        kernel=launch.kernel.__name__,
        capability=capability,
        shared_memory_bytes=int(compiled.metadata.shared),
        registers=int(fields["REG"]),
        spill_bytes=int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)),
        spills_in_loops=spills_in_loops(loops),
        loops=len(loops),
        num_warps=launch.num_warps,
        loop_instructions=len(hot.instructions) if hot else 0,
        loop_matrix_instructions=hot.count(is_matrix_instruction) if hot else 0,
        compute_loops=tuple((len(loop.instructions), loop.count(is_matrix_instruction)) for loop in computing),
        ptxas_warnings=ptxas_diagnostics(_ptxas_log(compiled, capability)),
    )


# ----------------------------------------------------------------------------
# The record: compiled rows kept under the key of their compile
# ----------------------------------------------------------------------------
# Everything above this section (the compile and the reading of its SASS) goes
# into every compile key; what follows builds the launches (which go into the
# key one by one), the table and the command, and must not change a kernel's row.
_RECORD_SECTION = "# The record: compiled rows kept under the key of their compile"


@functools.lru_cache(maxsize=1)
def _toolchain_fingerprint() -> str:
    # What every compile and its row depend on besides the launch: the Triton
    # release, the ptxas builds it runs (the bundled ones, or the overrides
    # Triton takes from the environment) and this module's code up to the
    # record's section, which compiles and reads the SASS.
    parts = [
        triton.__version__,
        *(os.environ.get(name, "") for name in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")),
    ]
    for tool in ("ptxas", "ptxas-blackwell"):
        try:
            parts.append(subprocess.run([_nvidia_tool(tool), "--version"], capture_output=True, text=True).stdout)
        except RuntimeError:
            parts.append(f"no {tool}")
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    assert source.count(_RECORD_SECTION) == 2, "the record's section header moved"  # itself and its constant
    parts.append(source[: source.index(_RECORD_SECTION)])
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def compile_key(launch: KernelLaunch, args: tuple, capability: int) -> str:
    """The key of the compile of ``launch`` with the arguments ``args`` for
    ``capability`` in a record: a hash of the kernel's source and of every
    @triton.jit function it calls (Triton's own cache key, which also changes
    with the kernel's first line), its specialization, warps and stages, the
    target, the Triton release with its ptxas, and this module's compile and
    SASS reading."""
    signature, constexprs, attrs = _specialize(launch, args)
    text = repr(
        (
            launch.kernel.cache_key,
            signature,
            constexprs,
            attrs,
            launch.num_warps,
            launch.num_stages,
            capability,
            _toolchain_fingerprint(),
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read_record(path: str) -> dict:
    """``{compile key: KernelResources fields (and the case's description)}`` of
    the record at ``path``; empty when there is no such file."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)["kernels"]


def write_record(path: str, kernels: dict) -> None:
    """Writes ``kernels`` ({compile key: row}; a row's "recorded" is left out)
    as the record at ``path``: one
    kernel per line, sorted by target and description, so that a change of
    tiles shows as the lines of the kernels it changed."""
    order = sorted(kernels, key=lambda key: (kernels[key]["capability"], kernels[key]["description"], key))
    lines = [
        f"  {json.dumps(key)}: "
        + json.dumps({name: value for name, value in kernels[key].items() if name != "recorded"}, sort_keys=True)
        for key in order
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            '{"about": "python -m tools.ahead_of_time --record FILE --update-record: '
            'the compiled step and reference kernels under their compile keys", "kernels": {\n'
        )
        f.write(",\n".join(lines))
        f.write("\n}}\n")


# ----------------------------------------------------------------------------
# The table of every CUDA launch of the ring-attention step kernels
# ----------------------------------------------------------------------------

TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 80 and 96 compile like 128.  Head dims up to 32 take the 64 tiles with a narrower
# BLOCK_D (16 or 32): not compiled here.
TABLE_HEAD_DIMS = (64, 128, 256)
TABLE_HEADS, TABLE_SEQLEN = 16, 4096
# The interval mask (packed documents, sliding windows, chunks) holds its row or
# column intervals in registers through the sweep and splits its sweep in three
# (masked, unmasked, masked).  It is compiled for bf16 (fp16 compiles alike) at
# head dims 128 and 256 (Gemma's windows are d256) and fp32 at head dim 128, MHA
# and GQA, where every dtype and head dim would add more than 100 kernels to
# the table's compile time.
TABLE_INTERVAL_CASES = ((torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float32, 128))
# The soft-capped scores (SOFTCAP: Gemma 2 is d256 with a cap of 50): a tanh per
# score and one more score-sized tile in the backward's registers.  The masks
# compiled with the cap, by (dtype, head dim): every mask for bf16, the causal
# and interval ones for fp16 (which compiles like bf16), the interval mask for
# fp32 at d128 (its tightest registers); MHA and GQA each.
TABLE_SOFTCAP_CASES = {
    (torch.bfloat16, 128): ("full", "causal", "intervals"),
    (torch.bfloat16, 256): ("full", "causal", "intervals"),
    (torch.float16, 128): ("causal", "intervals"),
    (torch.float16, 256): ("causal", "intervals"),
    (torch.float32, 128): ("intervals",),
}
TABLE_SOFTCAP = 50.0  # a runtime argument: any value compiles alike
# Where the step kernels load through tensor descriptors (TMA), a q whose
# strides TMA cannot take (a head dim of 100 bf16 elements: 200-byte rows) makes
# the launcher fall back to pointer loads with the pointer tiles.  That fallback
# is compiled for bf16 at head dim 128, full and causal, MHA and GQA: the
# tightest of the pointer tiles in registers, at 18 kernels on sm_90 where
# every descriptor case would add 72.
TABLE_POINTER_FALLBACK_CASES = ((torch.bfloat16, 128),)
# v of another head dim than q and k (multi-head latent attention), by (dtype, q's
# and k's head dim, v's head dim): the masks compiled, MHA and GQA each.  192/128
# is DeepSeek-V3's, Kimi K2's and MiMo-V2-Flash's (whose sliding-window layers take
# the interval mask), in bf16 and in fp32 (which "auto" runs on the Triton kernels);
# 96/64 has both dims within 128, so sm_90 loads it through tensor descriptors of
# two widths.
TABLE_VALUE_DIM_CASES = {
    (torch.bfloat16, 192, 128): ("full", "causal", "intervals"),
    (torch.bfloat16, 96, 64): ("full", "causal"),
    (torch.float32, 192, 128): ("full", "causal"),
}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@functools.cache  # each worker process builds the list once, not per case
def step_kernel_cases(capability: int):
    """The ring-attention step kernel launches worth compiling for ``capability``
    (with the shared memory attention_step_tiles.SHARED_MEMORY_PER_BLOCK gives it),
    one per distinct compiled kernel: ``[(description, KernelLaunch, args)]``.

    Inputs are contiguous (batch 2, seqlen 4096, 16 heads), the layout the ring
    passes; kv heads 16 (MHA: the GQA group size 1 is a compile-time constant)
    and 4 (GQA) on every target: register use differs between them (GQA dk/dv
    at d128 spills on sm_80 with the sm_90 tiles).  Masks full and causal
    everywhere, intervals for TABLE_INTERVAL_CASES; the soft-capped scores
    (SOFTCAP) for TABLE_SOFTCAP_CASES; v of another head dim for
    TABLE_VALUE_DIM_CASES.  On a target whose
    launches take tensor descriptors, TABLE_POINTER_FALLBACK_CASES also with a
    q that TMA cannot take (each row padded by one element), which takes the
    pointer loads.

    A description reads "kernel dtype dN mask MHA|GQA" ("dNvM" where v's head
    dim M differs from q's N), followed by "softcap"
    for the soft-capped scores; where several launches share one, each is
    followed by the lower-cased names of the boolean compile-time flags it sets
    and another of them does not (e.g. "first_step" for the forward of a ring's
    first step), so that every variant has its own.
    """
    from seqpar_kernels.kernels.attention_step_launch import MASK_CAUSAL, MASK_FULL, MASK_INTERVALS, cuda_kernel_calls

    mask_names = {MASK_FULL: "full", MASK_CAUSAL: "causal", MASK_INTERVALS: "intervals"}
    target = GpuTarget.of_capability(capability)
    cases, seen = [], set()

    def add(dtype, headdim, value_dim, mask_mode, softcap, kv_heads, q_row):
        q = torch.empty(2, TABLE_SEQLEN, TABLE_HEADS, q_row, dtype=dtype, device="meta")[..., :headdim]
        k = torch.empty(2, TABLE_SEQLEN, kv_heads, headdim, dtype=dtype, device="meta")
        v = torch.empty(2, TABLE_SEQLEN, kv_heads, value_dim, dtype=dtype, device="meta")
        dims = f"d{headdim}" + (f"v{value_dim}" if value_dim != headdim else "")
        for launch, args in cuda_kernel_calls(q, k, v, mask_mode, target, softcap=softcap):
            key = (
                launch.kernel.__name__,
                repr(_specialize(launch, args)),
                launch.num_warps,
                launch.num_stages,
            )
            if key in seen:
                continue
            seen.add(key)
            description = (
                f"{launch.kernel.__name__} {str(dtype).removeprefix('torch.')} "
                f"{dims} {mask_names[mask_mode]} "
                f"{'MHA' if kv_heads == TABLE_HEADS else 'GQA'}" + " softcap" * bool(softcap)
            )
            cases.append((description, launch, args))

    for dtype in TABLE_DTYPES:
        for headdim in TABLE_HEAD_DIMS:
            masks = [MASK_FULL, MASK_CAUSAL] + [MASK_INTERVALS] * ((dtype, headdim) in TABLE_INTERVAL_CASES)
            capped = [mode for mode in mask_names if mask_names[mode] in TABLE_SOFTCAP_CASES.get((dtype, headdim), ())]
            for mask_mode, softcap in [(mode, 0.0) for mode in masks] + [(mode, TABLE_SOFTCAP) for mode in capped]:
                layouts = [headdim] + [headdim + 1] * (
                    mask_mode != MASK_INTERVALS
                    and not softcap
                    and (dtype, headdim) in TABLE_POINTER_FALLBACK_CASES
                    and uses_tensor_descriptors(dtype, headdim, target)
                )
                for kv_heads, q_row in itertools.product((TABLE_HEADS, 4), layouts):
                    add(dtype, headdim, headdim, mask_mode, softcap, kv_heads, q_row)
    for (dtype, headdim, value_dim), mask_modes in TABLE_VALUE_DIM_CASES.items():
        for mask_mode in [mode for mode in mask_names if mask_names[mode] in mask_modes]:
            for kv_heads in (TABLE_HEADS, 4):
                add(dtype, headdim, value_dim, mask_mode, 0.0, kv_heads, headdim)
    alike: dict[str, list[dict]] = {}
    for description, launch, _ in cases:
        alike.setdefault(description, []).append(launch.constexprs)
    described = []
    for description, launch, args in cases:
        flags = [
            name.lower()
            for name, value in launch.constexprs.items()
            if value is True and any(other.get(name) is not True for other in alike[description])
        ]
        described.append((" ".join([description, *flags]), launch, args))
    return described


def _reference_launch(step: KernelLaunch, dtype) -> tuple[KernelLaunch, tuple] | None:
    """The reference kernel (reference_kernels.py) of the step kernel launch
    ``step`` on ``dtype`` inputs, with the same tiles, warps, stages, head dim
    (q's, where v's differs: the reference has one) and product precision, and
    the arguments of its launch on the table's shapes; None for a kernel
    without a reference (the backward preprocess).
    Its mask is causal where the step's is (a step with the interval mask is
    set against the full reference: neither has a tile it may skip)."""
    from seqpar_kernels.kernels.attention_step_kernels import (
        attention_step_bwd_dkdv_kernel,
        attention_step_bwd_dq_kernel,
        attention_step_fwd_kernel,
    )
    from seqpar_kernels.kernels.attention_step_launch import LOG2E
    from tools.reference_kernels import (
        reference_attention_bwd_dkdv_kernel,
        reference_attention_bwd_dq_kernel,
        reference_attention_fwd_kernel,
    )

    kernels = {
        attention_step_fwd_kernel: reference_attention_fwd_kernel,
        attention_step_bwd_dq_kernel: reference_attention_bwd_dq_kernel,
        attention_step_bwd_dkdv_kernel: reference_attention_bwd_dkdv_kernel,
    }
    if step.kernel not in kernels:
        return None
    block_d = step.constexprs["BLOCK_D"]
    constexprs = {name: step.constexprs[name] for name in ("CAUSAL", "BLOCK_M", "BLOCK_N", "BLOCK_D", "DOT_PRECISION")}
    launch = KernelLaunch(kernels[step.kernel], constexprs, step.num_warps, step.num_stages)
    q = torch.empty(2, TABLE_SEQLEN, TABLE_HEADS, block_d, dtype=dtype, device="meta")
    lse = torch.empty(2, TABLE_HEADS, TABLE_SEQLEN, dtype=torch.float32, device="meta")
    scale = block_d**-0.5
    if step.kernel is attention_step_fwd_kernel:
        k, v, out = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
        return launch, (
            q,
            k,
            v,
            out,
            lse,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride(),
            *lse.stride(),
            TABLE_SEQLEN,
            scale * LOG2E,
        )
    k, v, dout, delta = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q), torch.empty_like(lse)
    grads = (torch.empty(q.shape, dtype=torch.float32, device="meta"),)
    if step.kernel is attention_step_bwd_dkdv_kernel:
        grads += (torch.empty(q.shape, dtype=torch.float32, device="meta"),)
    return launch, (
        q,
        k,
        v,
        dout,
        lse,
        delta,
        *grads,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *dout.stride(),
        *lse.stride(),
        *delta.stride(),
        *(stride for grad in grads for stride in grad.stride()),
        TABLE_SEQLEN,
        scale,
        scale * LOG2E,
    )


@functools.cache
def reference_cases(capability: int):
    """``(references, reference_of)``: the distinct reference launches that the
    step kernels of ``capability`` call for, ``[(KernelLaunch, args)]``, and for
    each step case (by index into step_kernel_cases) with a reference, the index
    of its reference."""
    references, index_of, reference_of = [], {}, {}
    for case, (_description, launch, args) in enumerate(step_kernel_cases(capability)):
        reference = _reference_launch(launch, args[0].dtype)
        if reference is None:
            continue
        reference_launch = reference[0]
        key = (
            reference_launch.kernel.__name__,
            args[0].dtype,
            repr(reference_launch.constexprs),
            reference_launch.num_warps,
            reference_launch.num_stages,
        )
        if key not in index_of:
            index_of[key] = len(references)
            references.append(reference)
        reference_of[case] = index_of[key]
    return references, reference_of


def _case(kind, capability, index):
    # (description, KernelLaunch, args) of a job: cases travel to the workers
    # by index, as kernels do not pickle.
    if kind == "reference":
        launch, args = reference_cases(capability)[0][index]
        return (
            f"reference {launch.kernel.__name__} {launch.constexprs} w{launch.num_warps} s{launch.num_stages}",
            launch,
            args,
        )
    return step_kernel_cases(capability)[index]


def _compile_case(job):
    # Runs in a worker process.  A job found in the record is not compiled.
    kind, capability, index, recorded = job
    description, launch, args = _case(kind, capability, index)
    resources = dict(recorded) if recorded is not None else compile_for_gpu(launch, args, capability).__dict__
    resources["description"] = description
    if kind == "reference":
        return resources
    return dict(
        resources,
        constexprs={k: v for k, v in launch.constexprs.items() if k.startswith("BLOCK")},
        num_stages=launch.num_stages,
    )


def _reference_summary(resources: dict) -> dict:
    return {
        name: resources[name]
        for name in (
            "registers",
            "spill_bytes",
            "spills_in_loops",
            "shared_memory_bytes",
            "loop_instructions",
            "loop_matrix_instructions",
            "compute_loops",
            "ptxas_warnings",
            "recorded",
        )
    }


def compile_table(
    capabilities, workers: int, reference_capabilities=None, on_row=None, record=None, compiled=None
) -> list[dict]:
    """Every step kernel case of every capability, compiled by ``workers``
    processes: one dict per case (KernelResources' fields, plus description,
    constexprs (the BLOCK_* ones), num_stages, compile_key, recorded (whether
    the row came from ``record``), and for a forward, dq or dk/dv kernel
    ``reference``: the numbers of the reference kernel with the same tiles;
    None where the capability is not in ``reference_capabilities`` (None: every
    capability)).  ``record``: {compile key: row} (read_record) of kernels
    not to compile again.  ``compiled``: a dict that receives {compile key:
    row} of every step and reference kernel of the run (write_record's
    input).  ``on_row(row)`` sees each row as it is done, in order."""
    from concurrent.futures import ProcessPoolExecutor

    record = record or {}
    jobs, keys = [], []
    for capability in capabilities:
        kinds = [("step", len(step_kernel_cases(capability)))]
        if reference_capabilities is None or capability in reference_capabilities:
            # Before the step kernels, so that each row can be told its reference at once.
            kinds.insert(0, ("reference", len(reference_cases(capability)[0])))
        for kind, count in kinds:
            for index in range(count):
                _, launch, args = _case(kind, capability, index)
                key = compile_key(launch, args, capability)
                keys.append(key)
                jobs.append((kind, capability, index, record.get(key)))
    rows, compiled_references = [], {}
    with ProcessPoolExecutor(workers) as pool:
        for job, key, result in zip(jobs, keys, pool.map(_compile_case, jobs)):
            kind, capability, index, recorded = job
            result["recorded"] = recorded is not None
            if compiled is not None:
                compiled[key] = {
                    name: value
                    for name, value in result.items()
                    if name in KernelResources.__dataclass_fields__ or name in ("description", "recorded")
                }
            if kind == "reference":
                compiled_references[capability, index] = _reference_summary(result)
                continue
            reference = reference_cases(capability)[1].get(index)
            result["reference"] = None if reference is None else compiled_references.get((capability, reference))
            result["compile_key"] = key
            rows.append(result)
            if on_row is not None:
                on_row(result)
    return rows


def recompile(capability: int, prefixes, without=()) -> list[dict]:
    """The rows of the step kernel cases of ``capability`` whose descriptions
    start with one of ``prefixes`` and hold none of the words ``without`` (e.g.
    "softcap"), compiled now whatever a record holds (with their compile_key):
    a record's rows can be checked against them."""
    rows = []
    for description, launch, args in step_kernel_cases(capability):
        if description.startswith(tuple(prefixes)) and not set(without) & set(description.split()):
            rows.append(
                dict(
                    compile_for_gpu(launch, args, capability).__dict__,
                    description=description,
                    compile_key=compile_key(launch, args, capability),
                )
            )
    return rows


# ----------------------------------------------------------------------------
# The CUDA pack/unpack kernels of the built extension
# ----------------------------------------------------------------------------


def extension_library() -> str | None:
    """The built extension (seqpar_kernels/_C*.so) of the checkout, or None."""
    spec = importlib.util.find_spec("seqpar_kernels._C")
    if spec is not None and spec.origin and os.path.exists(spec.origin):
        return spec.origin
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "seqpar_kernels")
    found = sorted(glob.glob(os.path.join(package, "_C*.so")) + glob.glob(os.path.join(package, "_C*.pyd")))
    return found[0] if found else None


def sass_functions(listing: str) -> list[tuple[str, str, str]]:
    """``[(architecture, mangled name, listing)]`` of every function in the output
    of ``cuobjdump -sass`` on a library (sections "code for sm_90a", functions
    "Function : name")."""
    functions, architecture = [], None
    pieces = re.split(r"^\s*(code for sm_\w+|Function : \S+)\s*$", listing, flags=re.MULTILINE)
    for heading, body in zip(pieces[1::2], pieces[2::2]):
        if heading.startswith("code for "):
            architecture = heading.removeprefix("code for ")
        else:
            functions.append((architecture, heading.removeprefix("Function : "), body))
    return functions


def _short_names(mangled: list[str]) -> dict[str, str]:
    # "block_copy_kernel<Unit16, int, InlineBlocks>": demangled (c++filt, where
    # there is one) without the namespaces and the parameter list.
    filt = shutil.which("c++filt")
    if not filt or not mangled:
        return {name: name for name in mangled}
    demangled = subprocess.run([filt], input="\n".join(mangled), capture_output=True, text=True).stdout.splitlines()
    if len(demangled) != len(mangled):
        return {name: name for name in mangled}
    short = {}
    for name, readable in zip(mangled, demangled):
        readable = re.sub(r"\(anonymous namespace\)::|\bseqpar::", "", readable)
        depth = 0
        for position, character in enumerate(readable):
            depth += character in "<"
            depth -= character in ">"
            if character == "(" and depth == 0:
                readable = readable[:position]
                break
        short[name] = readable.strip().removeprefix("void ")
    return short


def _unit_loads(instruction: SassInstruction) -> int:
    """16-byte units that one load from global (or generic) memory moves:
    LDG.E.128 and its variants 1, a 256-bit load (sm_100) 2, narrower ones 0."""
    if instruction.base not in ("LDG", "LD"):
        return 0
    width = re.search(r"\.(128|256)(?:\.|$)", instruction.opcode)
    return int(width.group(1)) // 128 if width else 0


def _units_per_iteration(path) -> int:
    """16-byte units that the instructions ``path`` of one iteration load.  A
    load under a predicate and one under its negation (``@P2 LDG`` / ``@!P2
    LDG``: both directions of a copy, if-converted) are alternatives: the
    larger side counts."""
    by_guard: dict[str, int] = {}
    for instruction in path:
        by_guard[instruction.guard] = by_guard.get(instruction.guard, 0) + _unit_loads(instruction)
    units = by_guard.pop("", 0)
    for guard in {guard.removeprefix("!") for guard in by_guard}:
        units += max(by_guard.get(guard, 0), by_guard.get("!" + guard, 0))
    return units


def block_copy_report(library: str | None = None) -> dict:
    """The copy loops of the extension's block_copy kernels, per architecture,
    read from its SASS: ``{"library", "skipped" (why there is nothing, or None),
    "kernels": [{"architecture", "kernel", "loops": [{"instructions", "units",
    "instructions_per_unit", "body_instructions", "inner_loops"}]}]}``, the
    kernels whose loops move 16-byte units only.

    A copy loop is a loop that loads 16-byte units from global memory while no
    loop nested in it does: the grid-stride loop, or the loops a kernel that
    keeps several units in flight splits it into (a main loop and a remainder).
    One iteration is the path through its body that loads the most units, of
    those the longest (SassLoop.heaviest_path): the body may branch on the
    direction of the copy, and then runs one of two arms.  ``instructions`` and
    ``units`` (its 16-byte loads, a 256-bit load counting two; see
    _units_per_iteration) are that path's, so instructions per unit is what copying 16 bytes costs in that loop.
    ``body_instructions`` is the static size of the body; a loop with
    ``inner_loops`` (e.g. over the dims of a strided layout) runs those more
    than once per iteration."""
    library = library or extension_library()
    report = {"library": library, "skipped": None, "kernels": []}
    if library is None:
        report["skipped"] = "the extension seqpar_kernels._C is not built"
        return report
    result = subprocess.run([_cuobjdump(), "-sass", library], capture_output=True, text=True)
    functions = [function for function in sass_functions(result.stdout) if "block_copy" in function[1]]
    if not functions:
        report["skipped"] = f"{os.path.basename(library)} holds no CUDA SASS of block_copy kernels (a CPU-only build?)"
        return report
    names = _short_names([name for _, name, _ in functions])
    for architecture, name, listing in functions:
        loops = sass_loops(sass_instructions(listing))
        loading = [loop for loop in loops if loop.count(_unit_loads)]
        addresses = {id(loop): {instruction.address for instruction in loop.instructions} for loop in loading}
        rows = []
        for loop in loading:
            if any(other is not loop and addresses[id(other)] < addresses[id(loop)] for other in loading):
                continue  # an outer loop of a copy loop
            path = loop.heaviest_path(_unit_loads)
            units = _units_per_iteration(path)
            if units:
                rows.append(
                    dict(
                        instructions=len(path),
                        units=units,
                        instructions_per_unit=round(len(path) / units, 2),
                        body_instructions=len(loop.instructions),
                        inner_loops=loop.inner_loops,
                    )
                )
        if rows:
            report["kernels"].append(
                dict(
                    architecture=architecture,
                    kernel=names[name],
                    loops=sorted(rows, key=lambda row: row["instructions_per_unit"]),
                )
            )
    if not report["kernels"]:
        report["skipped"] = f"no block_copy kernel of {os.path.basename(library)} has a loop of 16-byte loads"
    return report


def _print_block_copy(report: dict) -> None:
    print(
        f"\nblock_copy kernels with 16-byte units in {report['library']}:\n"
        "  each copy loop: instructions / 16-byte loads on one iteration = instructions per unit; "
        "'+n inner' marks a loop with n loops inside it (index math per dim), run more than once per iteration"
    )
    if report["skipped"]:
        print(f"  skipped: {report['skipped']}")
        return
    for kernel in report["kernels"]:
        loops = [
            f"{loop['instructions']}/{loop['units']} = {loop['instructions_per_unit']:g}"
            + (f" (+{loop['inner_loops']} inner)" if loop["inner_loops"] else "")
            for loop in kernel["loops"]
        ]
        print(f"  {kernel['architecture']:<7} {kernel['kernel']:<42} " + "; ".join(loops))


# ----------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------

_SHORT_KERNELS = {
    "attention_step_fwd_kernel": "fwd",
    "attention_bwd_preprocess_kernel": "bwd_pre",
    "attention_step_bwd_dq_kernel": "dq",
    "attention_step_bwd_dkdv_kernel": "dkdv",
}


def _loop_text(resources: dict) -> str:
    if not resources["loop_instructions"]:
        return "-"
    return f"{resources['loop_instructions']}/{resources['loop_matrix_instructions']}"


def format_row(row: dict) -> str:
    """One line of the table: the kernel, its tiles, what it takes, its hot loop
    (instructions / tensor-core products per iteration), ptxas's diagnostics, and
    the reference kernel with the same tiles (reference_kernels.py)."""
    kernel, dtype, headdim, mask, heads, *flags = row["description"].split()
    blocks = row["constexprs"]
    tiles = f"{blocks.get('BLOCK_M', '-')}x{blocks.get('BLOCK_N', '-')} w{row['num_warps']} s{row['num_stages']}"
    line = (
        f"sm_{row['capability']:<4}{_SHORT_KERNELS.get(kernel, kernel):<8}{dtype:<9}{headdim:<9}{mask:<10}"
        f"{heads:<4}{','.join(flags) or '-':<12}{tiles:<16}{row['registers']:>4}{row['spill_bytes']:>7}"
        f"{row['spills_in_loops']:>7}"
        f"{row['shared_memory_bytes']:>8}{_loop_text(row):>11}  {short_diagnostics(row['ptxas_warnings']):<12}"
    )
    reference = row.get("reference")
    if reference:
        line += (
            f"| ref {reference['registers']:>4}{reference['spill_bytes']:>7}{reference['spills_in_loops']:>7}"
            f"{reference['shared_memory_bytes']:>8}{_loop_text(reference):>11}  "
            f"{short_diagnostics(reference['ptxas_warnings'])}"
        )
    return line


TABLE_HEADER = (
    f"{'target':<7}{'kernel':<8}{'dtype':<9}{'d':<9}{'mask':<10}{'kv':<4}{'variant':<12}{'tiles':<16}{'reg':>4}"
    f"{'spill':>7}{'inloop':>7}{'smem':>8}{'instr/mma':>11}  {'ptxas':<12}"
    f"| reference kernel, same tiles: reg spill inloop smem instr/mma ptxas"
)


def main(argv=None):
    """python -m tools.ahead_of_time [--capability 90 80 ...]
    [--json] [--reference-capability 90 ... | --no-reference] [--block-copy]:
    compile every step kernel launch for each capability and list what it takes,
    next to the reference kernel with its tiles, then the block-copy loops of
    the built extension."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--capability", type=int, nargs="+", default=list(DEFAULT_CAPABILITIES), choices=sorted(SHARED_MEMORY_PER_BLOCK)
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON list of the step kernels' rows on stdout (with --block-copy: that report)",
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--reference-capability",
        type=int,
        nargs="+",
        default=None,
        help="compile the reference kernels for these capabilities only (default: all); "
        "one compile per distinct tile of the forward, dq and dk/dv",
    )
    parser.add_argument("--no-reference", action="store_true", help="compile no reference kernel")
    parser.add_argument(
        "--block-copy",
        action="store_true",
        help="only the block-copy kernels of the built extension (no Triton compile)",
    )
    parser.add_argument(
        "--record",
        metavar="FILE",
        help="take the rows of the kernels whose compile key this record holds instead of "
        "compiling them (tests/data/attention_step_ahead_of_time.json: every default target, "
        "references for sm_90)",
    )
    parser.add_argument(
        "--update-record",
        action="store_true",
        help="write the kernels of this run into the record FILE of --record, in place of "
        "its kernels of the same targets",
    )
    options = parser.parse_args(argv)
    if options.block_copy:
        report = block_copy_report()
        if options.json:
            json.dump(report, sys.stdout)
        else:
            _print_block_copy(report)
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled for a GPU")
    if not options.json:
        print(
            "reg: registers per thread; spill: bytes spilled; inloop: spill accesses inside loops; "
            "smem: shared memory in bytes;\ninstr/mma: SASS instructions / tensor-core products per "
            "iteration of the hot loop; ptxas: its warnings and numbered advisories (C7515: wgmma serialized)"
        )
        print(TABLE_HEADER, flush=True)
    if options.update_record and not options.record:
        parser.error("--update-record needs --record FILE")
    references = () if options.no_reference else options.reference_capability
    compiled = {}
    rows = compile_table(
        options.capability,
        options.workers,
        reference_capabilities=references,
        on_row=None if options.json else lambda row: print(format_row(row), flush=True),
        record=read_record(options.record) if options.record else None,
        compiled=compiled,
    )
    recorded = sum(row["recorded"] for row in compiled.values())
    print(f"{len(compiled)} kernels: {recorded} from the record, {len(compiled) - recorded} compiled", file=sys.stderr)
    if options.update_record:
        # The run's kernels replace the record's for the targets it compiled;
        # those of other targets stay.
        kept = {
            key: row for key, row in read_record(options.record).items() if row["capability"] not in options.capability
        }
        write_record(options.record, {**kept, **compiled})
    if options.json:
        json.dump(rows, sys.stdout)
        return
    diagnostics = {text: None for row in rows for text in row["ptxas_warnings"]}
    if diagnostics:
        print("\nptxas diagnostics (with the function name in each):")
        for text in diagnostics:
            print(f"  {text}")
    _print_block_copy(block_copy_report())


if __name__ == "__main__":
    main()
