"""seqpar-kernels microbenchmark suite: `python -m bench` (see bench/__main__.py).

Each benchmark times ours and the unfused baseline side by side in one run, checks that
both compute the same thing, and reports the ratio, the bytes sent against theory and,
where it means something, GB/s against the device's memory bandwidth.

    bench/__main__.py                     command line
    bench/runner/launch.py                starting ranks: spawned gloo/NCCL processes, torchrun, or one process
    bench/runner/suite.py                 the benchmark families; runs the selected ones on one rank and
                                          writes results

The benchmark families, one module each:

    bench/families/reshard.py             all_to_all_reshard vs tensor_split + cat + all_to_all_single
    bench/families/ulysses.py             ulysses_attention vs DeepSpeed-Ulysses (whole forward; exchange only)
    bench/families/kernels.py             the pack / unpack kernels alone vs permute + contiguous / cat;
                                          the merge kernel vs ring-flash-attention's merge in ATen ops
    bench/families/ring.py                ring_attention on P ranks vs single-device SDPA (forward; + backward)
    bench/families/ring_step.py           (GPU) the Triton step kernel vs SDPA's flash and cuDNN backends
    bench/families/ring_probe.py          (GPU) the single-GPU overlap probe of the ring's exchange
    bench/families/loss.py                the fused LM loss vs materialised logits (peak memory, time; one rank)

The harness they share:

    bench/runner/context.py               what every benchmark needs: rank, device, sync, rank-0 logging
    bench/runner/hardware.py              device names, peak memory bandwidth and bf16 TFLOP/s, git commit
    bench/runner/timing.py                the one timing helper (interleaved, warmed up, median)
    bench/runner/verify.py                the checks: agreement with the baseline, bytes sent against theory,
                                          attention against an exact result by the tests' accuracy rule
    bench/families/shared/baselines.py    the unfused baselines (DeepSpeed-Ulysses / tensor_split + cat) and
                                          single-device SDPA
    bench/families/shared/ring_parts.py   the ring driver with its exchange replaced (compute only, copies)
    bench/runner/rows.py                  the result row (the CSV columns) and the benchmark names
    bench/runner/cases.py                 making a case's row; run_case, every case loop's one step
    bench/runner/targets.py               every target and target_checks, which judges them
    bench/runner/results.py               progress lines, the summary table, the CSV + JSON writer
    bench/runner/plot.py                  the PNG
    bench/runner/headline.py              python -m bench.runner.headline: a GPU check folder's headline numbers
    bench/runner/step_table.py            python -m bench.runner.step_table: a run's measured step backend into
                                          this checkout's table
"""
