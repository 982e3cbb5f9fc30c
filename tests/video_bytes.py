"""The bytes seqpar_kernels.integrations.diffusers sends per call of a transformer, by the
README's formulas: what each rank sends in one forward, or in its backward, under each
mode. Pure arithmetic on the model's shape (no torch.distributed): the tests compare
comm_stats with it, the video benchmark reports it beside the measured bytes.

shape (a dict):
    Latte: batch, frames, positions (patches per frame), width (the model's hidden size),
        heads, head_dim, layers (spatial-temporal pairs), out_per_token (p * p * out channels)
    others: batch, tokens (the video's, then the text's where joined to them), heads,
        head_dim, layers (attention modules over the tokens), out_per_token
Pieces follow torch.tensor_split (the first ranks one more); under usp piece i * U + j
is the rank at ring index i, Ulysses index j (the rank of a (ring, ulysses) mesh)."""

from __future__ import annotations


def _sizes(total: int, pieces: int) -> list[int]:
    return [total // pieces + (1 if piece < total % pieces else 0) for piece in range(pieces)]


def _ulysses_bytes(lens, rank, heads, row, forward):
    """ulysses_attention over pieces of `lens` rows; row = batch x head_dim x element size."""
    n = _sizes(heads, len(lens))  # q heads per rank; MHA: as many kv heads
    others = [j for j in range(len(lens)) if j != rank]
    if forward:
        return sum(lens[rank] * 3 * n[j] + lens[j] * n[rank] for j in others) * row
    return sum(lens[rank] * n[j] + lens[j] * 3 * n[rank] for j in others) * row


def _ring_bytes(lens, rank, kv_row, element, forward):
    """ring_attention: kv_row = batch x kv heads x head_dim."""
    total, pieces = sum(lens), len(lens)
    sent = (total - lens[(rank + 1) % pieces]) * kv_row * 2 * element
    return sent if forward else sent + (total - lens[rank]) * kv_row * 2 * 4


def _attention_bytes(mode, lens, rank, batch, heads, head_dim, element, ulysses, forward):
    """One attention call over every piece's `lens` tokens (piece i*U + j = global rank)."""
    if mode == "ulysses":
        return _ulysses_bytes(lens, rank, heads, batch * head_dim * element, forward)
    if mode == "ring":
        return _ring_bytes(lens, rank, batch * heads * head_dim, element, forward)
    ring, (i, j) = len(lens) // ulysses, divmod(rank, ulysses)
    row_lens = lens[i * ulysses : (i + 1) * ulysses]
    slot_lens = [sum(lens[k * ulysses : (k + 1) * ulysses]) for k in range(ring)]
    my_heads = _sizes(heads, ulysses)[j]
    sent = _ulysses_bytes(row_lens, j, heads, batch * head_dim * element, forward)
    if ring > 1:
        sent += _ring_bytes(slot_lens, i, batch * my_heads * head_dim, element, forward)
    return sent


def _gather_bytes(mode, lens, rank, per_token, ulysses):
    """The output gathered: (P-1) x this rank's piece; under usp (U-1) x the piece over
    the Ulysses group, then (R-1) x the slot over the ring."""
    if mode != "usp":
        return (len(lens) - 1) * lens[rank] * per_token
    ring, i = len(lens) // ulysses, rank // ulysses
    return (ulysses - 1) * lens[rank] * per_token + (ring - 1) * sum(lens[i * ulysses : (i + 1) * ulysses]) * per_token


def expected_bytes(mode, shape, rank, pieces, element, ulysses=1, forward=True, gather=True):
    """What rank `rank` sends in one forward (or its backward) of a transformer of
    `shape`; gather=False: without the output's gather (what a gradient checkpoint's
    recomputation sends again: its attention calls)."""
    if mode == "dsp":  # Latte: L pairs; reshards frames->positions L times, back L-1 times
        batch, frames, positions, width = shape["batch"], shape["frames"], shape["positions"], shape["width"]
        my_frames, my_positions = _sizes(frames, pieces)[rank], _sizes(positions, pieces)[rank]
        layers = shape["layers"]
        spatial_to_temporal = my_frames * (positions - my_positions)
        temporal_to_spatial = my_positions * (frames - my_frames)
        if not forward:  # each reshard reversed
            spatial_to_temporal, temporal_to_spatial = temporal_to_spatial, spatial_to_temporal
        sent = batch * width * element * (layers * spatial_to_temporal + (layers - 1) * temporal_to_spatial)
        if forward and gather:
            sent += (pieces - 1) * batch * frames * my_positions * shape["out_per_token"] * element
        return sent
    if "frames" in shape:  # Latte: the spatial attention, a batch of B x T frames of S positions
        lens, rows, video = _sizes(shape["positions"], pieces), shape["batch"] * shape["frames"], shape["positions"]
    else:  # the video tokens, and text tokens joined to them
        per_split = [_sizes(total, pieces) for total in shape["tokens"]]
        lens, rows, video = [sum(piece) for piece in zip(*per_split)], shape["batch"], shape["tokens"][0]
    sent = shape["layers"] * _attention_bytes(mode, lens, rank, rows, shape["heads"], shape["head_dim"], element,
                                              ulysses, forward)  # fmt: skip
    if forward and gather:
        sent += _gather_bytes(mode, _sizes(video, pieces), rank, rows * shape["out_per_token"] * element, ulysses)
    return sent
