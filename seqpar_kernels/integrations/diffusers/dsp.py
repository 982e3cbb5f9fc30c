"""DSP (Dynamic Sequence Parallelism) on a diffusers transformer whose blocks alternate
spatial and temporal attention: LatteTransformer3DModel. The hooks switch the sharded
dimension with all_to_all_reshard between the blocks, so no attention needs a collective.
"""

from __future__ import annotations

import torch

from seqpar_kernels.integrations.diffusers.hooks import Call, Hooks
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.reshard import all_to_all_reshard

__all__ = ["LatteDSP"]


class LatteDSP(Hooks):
    """DSP on LatteTransformer3DModel.

    Latte's forward keeps hidden_states as (B*T, S, C) for a spatial block and reshapes
    it to (B*S, T, C) for a temporal block (rows in batch-major order). Here each rank
    holds T_r of the T frames through a spatial block, (B*T_r, S, C), and S_r of the S
    spatial positions through a temporal block, (B*S_r, T, C); Latte's own reshapes
    between the blocks then carry this rank's piece, since they only move the batch of
    frames and the batch of positions:

        pos_embed out (B*T, S, C)  -> cut: this rank's frames (B*T_r, S, C)
        spatial block i            (B*T_r, S, C); its text and timestep rows cut alike
          out: (B, T_r, S, C) -all_to_all_reshard(scatter S, gather T)-> (B, T, S_r, C)
               = (B*T, S_r, C), which Latte turns into (B*S_r, T, C)
        temporal block i           (B*S_r, T, C); its timestep rows cut alike
          out (not the last):  (B, S_r, T, C) -reshard(scatter T, gather S)-> (B, S, T_r, C)
               = (B*S, T_r, C), which Latte turns into (B*T_r, S, C)
        after the last block       (B*T, S_r, C): final norm and projection per token,
        proj_out out               gathered over the positions: (B*T, S, p*p*c_out)

    Without temporal attention (enable_temporal_attentions=False) the frames stay
    sharded until the last spatial block, whose output is resharded for the output
    projection. No attention needs a collective."""

    def __init__(self, transformer, parallelism: SequenceParallelism):
        super().__init__(transformer, parallelism)
        self.handles.append(transformer.register_forward_pre_hook(
            lambda module, args, kwargs: self._enter(args, kwargs), with_kwargs=True))  # fmt: skip
        self.handles.append(transformer.pos_embed.register_forward_hook(
            lambda module, args, output: self._cut_frames(output)))  # fmt: skip
        spatial, temporal = transformer.transformer_blocks, transformer.temporal_transformer_blocks
        last = len(spatial) - 1
        for index, block in enumerate(spatial):
            for argument in ("encoder_hidden_states", "encoder_attention_mask", "timestep"):
                self.input_hook(block, argument, self._cut_frames)
            self.handles.append(block.register_forward_hook(
                lambda module, args, output, index=index: self._after_spatial(output, index == last)))  # fmt: skip
        for index, block in enumerate(temporal):
            self.input_hook(block, "timestep", self._cut_positions)
            if index < last:
                self.handles.append(block.register_forward_hook(
                    lambda module, args, output: self._after_temporal(output)))  # fmt: skip
        self.handles.append(transformer.proj_out.register_forward_hook(
            lambda module, args, output: self.parallelism.gather(output, 1, self.call.positions)))  # fmt: skip

    def _enter(self, args, kwargs):
        arguments = self.start_call(args, kwargs)
        video = arguments["hidden_states"]  # (B, C, T, H, W)
        patch = self.transformer.config.patch_size
        batch, frames = video.shape[0], video.shape[2]
        positions = (video.shape[3] // patch) * (video.shape[4] // patch)
        pieces = self.parallelism.pieces
        if frames < pieces or positions < pieces:
            raise ValueError(
                f"{self.describe()}: a video of {frames} frames of {positions} patches on {pieces} ranks: DSP gives "
                "every rank whole frames and whole patch trajectories, so it needs at least as many frames and "
                "patches per frame as ranks (mode='ulysses' shards the patches alone)"
            )
        self.call = Call(arguments, frames=frames, positions=positions, batch=batch)

    def _cut_frames(self, x):
        """This rank's frames of (B*T, ...) rows (batch-major); other tensors pass."""
        call = self.call
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] != call.batch * call.frames:
            raise ValueError(f"{self.describe()}: {tuple(x.shape)} does not have a row per frame of each video "
                             f"({call.batch} x {call.frames})")  # fmt: skip
        return self.take(x.unflatten(0, (call.batch, call.frames)), 1).flatten(0, 1)

    def _cut_positions(self, x):
        """This rank's spatial positions of (B*S, ...) rows (batch-major)."""
        call = self.call
        return self.take(x.unflatten(0, (call.batch, call.positions)), 1).flatten(0, 1)

    def _after_spatial(self, output, last: bool):
        """(B*T_r, S, C) -> (B*T, S_r, C) when a temporal block follows or the output
        projection does; else the frames stay sharded."""
        call = self.call
        if not (call.arguments.get("enable_temporal_attentions", True) or last):
            return output
        video = output.unflatten(0, (call.batch, -1))  # (B, T_r, S, C)
        resharded = all_to_all_reshard(video, scatter_dim=2, gather_dim=1, group=self.parallelism.groups()[0],
                                       gather_sizes=self.parallelism.piece_lengths(call.frames))  # fmt: skip
        return resharded.flatten(0, 1)  # (B*T, S_r, C)

    def _after_temporal(self, output):
        """(B*S_r, T, C) -> (B*S, T_r, C) for the next spatial block."""
        call = self.call
        trajectories = output.unflatten(0, (call.batch, -1))  # (B, S_r, T, C)
        resharded = all_to_all_reshard(trajectories, scatter_dim=2, gather_dim=1, group=self.parallelism.groups()[0],
                                       gather_sizes=self.parallelism.piece_lengths(call.positions))  # fmt: skip
        return resharded.flatten(0, 1)  # (B*S, T_r, C)
