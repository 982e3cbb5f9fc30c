"""seqpar-kernels microbenchmark suite: `python -m bench` (see bench/__main__.py).

Each benchmark times ours and the unfused baseline side by side in one run, checks that
both compute the same thing, and reports the ratio, the bytes sent against theory and,
where it means something, GB/s against the device's memory bandwidth.

    bench/__main__.py          the command line
    bench/runner/              the run: starting ranks (launch.py), the plan and the budget
                               (plan.py, budget.py), timing and checks (timing.py,
                               verify.py), the rows and targets (rows.py, targets.py), the
                               CSV, JSON, figures and report (results.py, plot.py,
                               report.py); family.py: the interface every family declares
                               and finding the families; headline.py and step_table.py:
                               python -m bench.runner.headline / .step_table
    bench/families/<name>.py   one benchmark family each, ending with its FAMILY =
                               Family(...): its --only name, what it measures, run(ctx),
                               its sizes (bench/README.md lists the families)
    bench/families/shared/     what several families use: the unfused baselines and
                               single-device SDPA (baselines.py), the ring's parts timed
                               apart (ring_parts.py)
"""
