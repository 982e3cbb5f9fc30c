"""The algorithms users call. Each validates its arguments on every rank before any
collective, then composes ops from seqpar_kernels.ops."""
