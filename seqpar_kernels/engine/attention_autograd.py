"""The autograd of the engine's attention ops (ring and one-process): a forward op
(q, k, v, *args) -> (out, lse) whose last argument is the sinks (or None), and its
backward op (dout, q, k, v, out, lse, *args) -> (dq, dk, dv, dsinks)."""

from __future__ import annotations


def register_attention_autograd(forward_op, backward_op) -> None:
    """Makes forward_op differentiable in q, k, v and the sinks through backward_op."""

    def setup_context(ctx, inputs, output):
        q, k, v, *args = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = tuple(args)

    def backward(ctx, grad_out, grad_lse):
        # lse is a non-differentiable output (as flash-attention's returned lse): its
        # gradient, if any, is ignored; the public functions hand it out detached.
        q, k, v, out, lse = ctx.saved_tensors
        no_grads = [None] * len(ctx.args)
        if grad_out is None:
            return None, None, None, *no_grads
        sinks = ctx.args[-1]
        # The sinks as data: the backward op is not differentiated again.
        args = (*ctx.args[:-1], None if sinks is None else sinks.detach())
        dq, dk, dv, dsinks = backward_op(grad_out, q, k, v, out, lse, *args)
        if sinks is not None:
            no_grads[-1] = dsinks
        return dq, dk, dv, *no_grads

    forward_op.register_autograd(backward, setup_context=setup_context)
