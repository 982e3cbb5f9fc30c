"""What the public functions drive: the ring's schedule and loops (ring_driver), one step
and its StepSpec (steps), the step backends behind one interface (step_backends) and
the block kernels they may use (block_attention), what each step computes under an
attention mask (step_masks), one-process attention under any mask (local_attention),
the custom ops of the ring and of the one-process attention (ring_ops, local_ops) and
what they share (attention_ops: the mask's encoding, their autograd), the chunked
cross entropy of one process (cross_entropy), the state-space scans of one process,
run by run (state_space), the gated delta rule (gated_delta), which backend runs a
recurrence's sequential part (kernel_backend), and the partial attention of a few
queries over one rank's share of a KV cache, with its merge (decode)."""
