"""seqpar-kernels: fused kernels for sequence parallelism.

Public API:
    all_to_all_reshard, split_sequence, gather_sequence   (DSP and friends)
    ulysses_attention                                      (DeepSpeed-Ulysses)
    ring_attention, zigzag_split, zigzag_gather            (ring attention)
    usp_attention, usp_split, usp_gather, make_usp_groups  (USP: Ulysses inside a ring)
    varlen_plan                                            (packed documents: varlen=plan)
    ssd_scan, selective_scan                               (state-space scans of hybrid models:
                                                            Mamba2's SSD and Mamba's selective scan)
    gated_delta_rule, kimi_delta_attention,                (Gated DeltaNet's, Kimi's and MiniMax's linear
    lightning_attention                                     attention over the sharded sequence, their
                                                            state passed across ranks)
    sparse_placement, indexer_topk, sparse_attention       (indexer-sparse attention, DSA: the top-k
                                                            keys of every rank, then attention over them)
    sequence_parallel_cross_entropy,                       (the LM loss over every rank's tokens,
    sequence_parallel_cross_entropy_from_logits             logits a chunk of tokens at a time)
    sequence_parallel_logprobs                             (each token's log-probability and entropy,
                                                            the same chunks; per-sequence sums)
    shard_batch, all_reduce_gradients                      (a training step: this rank's tokens with
                                                            shifted labels; the ranks' gradient shares summed)
    decode_attention, prefill_attention,                   (inference over a KV cache sharded across ranks;
    decode_attention_partial, merge_attention_partials      the local part and the merge, for serving engines)
    comm_stats                                             (bytes sent, for tests and benchmarks;
                                                            seqpar_kernels.traffic has the formulas)
"""

from seqpar_kernels import (
    extension,  # noqa: F401  (loads the compiled ops)
    ops,  # noqa: F401  (registers fake kernels and autograd)
)
from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.parallel.cross_entropy import (
    sequence_parallel_cross_entropy,
    sequence_parallel_cross_entropy_from_logits,
    sequence_parallel_logprobs,
)
from seqpar_kernels.parallel.gated_delta import gated_delta_rule, kimi_delta_attention, lightning_attention
from seqpar_kernels.parallel.inference import (
    decode_attention,
    decode_attention_partial,
    merge_attention_partials,
    prefill_attention,
)
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.recurrent import causal_conv1d
from seqpar_kernels.parallel.reshard import all_to_all_reshard, gather_sequence, split_sequence
from seqpar_kernels.parallel.ring import ring_attention, zigzag_gather, zigzag_split
from seqpar_kernels.parallel.sparse import indexer_topk, sparse_attention, sparse_placement
from seqpar_kernels.parallel.state_space import selective_scan, ssd_scan
from seqpar_kernels.parallel.training import all_reduce_gradients, shard_batch
from seqpar_kernels.parallel.ulysses import ulysses_attention
from seqpar_kernels.parallel.usp import make_usp_groups, usp_attention, usp_gather, usp_split
from seqpar_kernels.parallel.varlen import VarlenPlan, varlen_plan
from seqpar_kernels.traffic import comm_stats

__version__ = "0.1.0"
__all__ = [
    "all_to_all_reshard",
    "split_sequence",
    "gather_sequence",
    "ulysses_attention",
    "ring_attention",
    "zigzag_split",
    "zigzag_gather",
    "usp_attention",
    "usp_split",
    "usp_gather",
    "make_usp_groups",
    "varlen_plan",
    "VarlenPlan",
    "ssd_scan",
    "selective_scan",
    "gated_delta_rule",
    "kimi_delta_attention",
    "lightning_attention",
    "sparse_placement",
    "indexer_topk",
    "sparse_attention",
    "sequence_parallel_cross_entropy",
    "sequence_parallel_cross_entropy_from_logits",
    "sequence_parallel_logprobs",
    "shard_batch",
    "all_reduce_gradients",
    "comm_stats",
    "SequenceParallelism",
    "AttentionMask",
    "causal_conv1d",
    "decode_attention",
    "decode_attention_partial",
    "merge_attention_partials",
    "prefill_attention",
]
