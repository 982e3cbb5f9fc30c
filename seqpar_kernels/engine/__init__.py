"""What the public functions drive: the ring's schedule and loops (ring_driver), the step
backends behind one interface (step_backends) and torch's block kernels they may use
(block_attention), attention masks (masks), one-process attention over packed documents
(varlen_local), and the custom ops of the ring and of packed documents (ring_ops,
varlen_ops)."""
