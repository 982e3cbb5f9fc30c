"""The bytes seqpar_kernels.integrations.diffusers sends per call of a transformer: what
each rank sends in one forward, or in its backward, under each mode, the model's calls
counted here and each call's bytes by seqpar_kernels.traffic's formulas (docs/ quotes them).
Pure arithmetic on the model's shape (no torch.distributed): the tests compare
comm_stats with it, the video benchmark reports it beside the measured bytes.

shape (a dict):
    Latte: batch, frames, positions (patches per frame), width (the model's hidden size),
        heads, head_dim, layers (spatial-temporal pairs), out_per_token (p * p * out channels)
    others: batch, tokens (the video's, then the text's where joined to them), heads,
        head_dim, layers (attention modules over the tokens), out_per_token
Pieces follow torch.tensor_split (the first ranks one more); under usp piece i * U + j
is the rank at ring index i, Ulysses index j (the rank of a (ring, ulysses) mesh)."""

from __future__ import annotations

from seqpar_kernels.layouts import tensor_split_sizes
from seqpar_kernels.traffic import gather_bytes, reshard_bytes, ring_bytes, ulysses_bytes, usp_bytes, usp_gather_bytes


def _attention_bytes(mode, lens, rank, batch, heads, head_dim, element, ulysses, forward):
    """One attention call (MHA: as many kv heads as q heads) over every piece's `lens`
    tokens (piece i*U + j = global rank)."""
    shape = dict(batch=batch, num_kv_heads=heads, head_dim=head_dim, element_size=element)
    if mode == "ulysses":
        sent = ulysses_bytes(lens, rank, num_heads=heads, **shape)
    elif mode == "ring":
        sent = ring_bytes(lens, rank, **shape)
    else:
        i, j = divmod(rank, ulysses)
        groups = usp_bytes(lens, i, j, ulysses_size=ulysses, num_heads=heads, **shape)
        return sum(group.forward if forward else group.backward for group in groups)
    return sent.forward if forward else sent.backward


def _gather_bytes(mode, lens, rank, row_bytes, ulysses):
    """The output gathered (gather_sequence; under usp over the Ulysses group, then the ring)."""
    if mode != "usp":
        return gather_bytes(lens, rank, row_bytes)
    i, j = divmod(rank, ulysses)
    return usp_gather_bytes(lens, i, j, ulysses_size=ulysses, row_bytes=row_bytes)


def expected_bytes(mode, shape, rank, pieces, element, ulysses=1, forward=True, gather=True):
    """What rank `rank` sends in one forward (or its backward) of a transformer of
    `shape`; gather=False: without the output's gather (what a gradient checkpoint's
    recomputation sends again: its attention calls)."""
    if mode == "dsp":  # Latte: L pairs; reshards frames->positions L times, back L-1 times
        batch, frames, positions, width = shape["batch"], shape["frames"], shape["positions"], shape["width"]
        my_frames = tensor_split_sizes(frames, pieces)[rank]
        my_positions = tensor_split_sizes(positions, pieces)[rank]
        # (B, T_r, S, C) scattered along S, and (B, T, S_r, C) along T; the backward
        # reshards each gradient back the other way.
        spatial_to_temporal = reshard_bytes((batch, my_frames, positions, width), 2, rank, pieces, element)
        temporal_to_spatial = reshard_bytes((batch, frames, my_positions, width), 1, rank, pieces, element)
        if not forward:
            spatial_to_temporal, temporal_to_spatial = temporal_to_spatial, spatial_to_temporal
        layers = shape["layers"]
        sent = layers * spatial_to_temporal + (layers - 1) * temporal_to_spatial
        if forward and gather:  # the output (B, T, S_r, out_per_token), gathered along S
            position_lens = tensor_split_sizes(positions, pieces)
            sent += gather_bytes(position_lens, rank, batch * frames * shape["out_per_token"] * element)
        return sent
    if "frames" in shape:  # Latte: the spatial attention, a batch of B x T frames of S positions
        video = shape["positions"]
        lens, rows = tensor_split_sizes(video, pieces), shape["batch"] * shape["frames"]
    else:  # the video tokens, and text tokens joined to them
        per_split = [tensor_split_sizes(total, pieces) for total in shape["tokens"]]
        lens, rows, video = [sum(piece) for piece in zip(*per_split)], shape["batch"], shape["tokens"][0]
    sent = shape["layers"] * _attention_bytes(mode, lens, rank, rows, shape["heads"], shape["head_dim"], element,
                                              ulysses, forward)  # fmt: skip
    if forward and gather:
        sent += _gather_bytes(mode, tensor_split_sizes(video, pieces), rank, rows * shape["out_per_token"] * element,
                              ulysses)  # fmt: skip
    return sent
