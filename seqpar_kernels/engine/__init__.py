"""What the public functions drive: the ring's schedule and loops (ring_driver), the step
backends behind one interface (step_backends) and the block kernels they may use
(block_attention), attention masks (masks: causal, documents, windows, chunks),
one-process attention under any of them (local_attention), and the custom ops of the
ring and of the one-process attention (ring_ops, local_ops)."""
