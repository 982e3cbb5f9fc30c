"""seqpar-kernels microbenchmark suite: `python -m bench` (see bench/__main__.py).

Each benchmark times ours and the unfused baseline side by side in one run, checks that
both compute the same thing, and reports the ratio, the bytes sent against theory and,
where it means something, GB/s against the device's memory bandwidth.

    bench/__main__.py      command line
    bench/launch.py        starting ranks: spawned gloo/NCCL processes, torchrun, or one process
    bench/context.py       what every benchmark needs: rank, device, sync, rank-0 logging
    bench/hardware.py      device names, peak memory bandwidth and bf16 TFLOP/s, git commit
    bench/timing.py        the one timing helper (interleaved, warmed up, median)
    bench/baselines.py     the unfused baselines (DeepSpeed-Ulysses / tensor_split + cat)
    bench/bench_reshard.py, bench_ulysses.py, bench_kernels.py, bench_ring.py   the benchmarks
    bench/results.py       result rows, progress lines, targets summary, CSV + JSON writer
    bench/plot.py          the PNG
    bench/suite.py         runs the selected benchmarks on one rank and writes results
"""
