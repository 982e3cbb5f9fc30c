"""seqpar-kernels microbenchmark suite: `python -m bench` (see bench/__main__.py).

Each benchmark times ours and the unfused baseline side by side in one run, checks that
both compute the same thing, and reports the ratio, the bytes sent against theory and,
where it means something, GB/s against the device's memory bandwidth.

    bench/__main__.py      command line
    bench/launch.py        starting ranks: spawned gloo/NCCL processes, torchrun, or one process
    bench/suite.py         the benchmark families; runs the selected ones on one rank and
                           writes results

The benchmark families, one module each:

    bench/bench_reshard.py     all_to_all_reshard vs tensor_split + cat + all_to_all_single
    bench/bench_ulysses.py     ulysses_attention vs DeepSpeed-Ulysses (whole forward; exchange only)
    bench/bench_kernels.py     the pack / unpack kernels alone vs permute + contiguous / cat;
                               the merge kernel vs ring-flash-attention's merge in ATen ops
    bench/bench_ring.py        ring_attention on P ranks vs single-device SDPA (forward; + backward)
    bench/bench_ring_step.py   (GPU) the Triton step kernel vs SDPA's flash and cuDNN backends
    bench/bench_ring_probe.py  (GPU) the single-GPU overlap probe of the ring's exchange
    bench/bench_loss.py        the fused LM loss vs materialised logits (peak memory, time; one rank)

The harness they share:

    bench/context.py       what every benchmark needs: rank, device, sync, rank-0 logging
    bench/hardware.py      device names, peak memory bandwidth and bf16 TFLOP/s, git commit
    bench/timing.py        the one timing helper (interleaved, warmed up, median)
    bench/verify.py        the checks: agreement with the baseline, bytes sent against theory,
                           attention against an exact result by the tests' accuracy rule
    bench/baselines.py     the unfused baselines (DeepSpeed-Ulysses / tensor_split + cat) and
                           single-device SDPA
    bench/ring_parts.py    the ring driver with its exchange replaced (compute only, copies)
    bench/rows.py          the result row (the CSV columns) and the benchmark names
    bench/cases.py         making a case's row; run_case, every case loop's one step
    bench/targets.py       every target and target_checks, which judges them
    bench/results.py       progress lines, the summary table, the CSV + JSON writer
    bench/plot.py          the PNG
    bench/headline.py      python -m bench.headline: a GPU check folder's headline numbers
    bench/step_table.py    python -m bench.step_table: a run's measured step backend into
                           this checkout's table
"""
