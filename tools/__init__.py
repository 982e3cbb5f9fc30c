"""Developer tools of the checkout, not installed with the package: the ahead-of-time
compile report of the Triton step kernels (ahead_of_time) and the plain reference
kernels it compares them with (reference_kernels), and the references and the accuracy rule
that the tests and the benchmarks share (reference). Run from the repository's root:
python -m tools.ahead_of_time --help."""
