"""What the README's and docs/' Python blocks leave to the reader (its model, dataset,
batch, pipeline...), made small for tests/test_docs_run.py, which runs every block on
gloo CPU ranks.

A block names what it needs by using it without defining it (`model`, `batch`,
`replica_batches`...); STANDINS makes each such name, on every rank alike (seeded).
Where a block uses `...` for "the rest of your arguments" (`TrainingArguments(...,
...)`), the run passes REST_OF_THE_ARGUMENTS there: one step, on the CPU, no reports.
What a block writes at a size no test machine has is scaled down by SCALE_DOWNS (each
rewrite must apply to some block: a rewrite that matches nothing fails, so that the list
cannot outlive the pages); its DeviceMeshes are made by `mesh_at_the_pools_size`: the
block's dims, names and order, the largest halved until the mesh fits the pool."""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist

# (pattern, replacement) applied to a block's source before it runs.
SCALE_DOWNS = (
    (r"sequence_parallel_size=8", "sequence_parallel_size=2"),  # a node's 8 ranks -> the pool's 4: 2 replicas of 2
    (r"max_new_tokens=256", "max_new_tokens=3"),
    (r",\s*\.\.\.(?=\s*\))", ", **REST_OF_THE_ARGUMENTS"),  # f(a=1, ...): the rest of the arguments
    (r"\binit_device_mesh\(", "mesh_at_the_pools_size("),
)

REST_OF_THE_ARGUMENTS = dict(max_steps=1, optim="sgd", learning_rate=0.1, report_to="none", save_strategy="no",
                             disable_tqdm=True, use_cpu=True, logging_steps=1)  # fmt: skip

VOCAB = 29  # the example tokenizer's characters, <pad> and <eos>


def mesh_at_the_pools_size(device_type, mesh_shape, *, mesh_dim_names=None, **kwargs):
    """init_device_mesh for a block: the block's dims and names, its largest dim halved
    until the mesh spans the pool's world (a page's 32 GPUs are 4 CPU ranks here), on
    the CPU when there is no GPU."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, world = list(mesh_shape), dist.get_world_size()
    while math.prod(shape) > world:
        largest = shape.index(max(shape))
        shape[largest] //= 2
    assert math.prod(shape) == world, (mesh_shape, world)
    device_type = device_type if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=mesh_dim_names, **kwargs)


def _character_tokenizer():
    from test_transformers_post_training import _example

    return _example().character_tokenizer()


def _llama(vocab: int = VOCAB):
    """A tiny Llama as from_pretrained returns one: in eval mode, its cache on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _batch(length: int = 30, seed: int = 1) -> dict:
    ids = _tokens(length, seed)
    return {"input_ids": ids, "labels": ids.clone()}


class _LazySGD:
    """An optimizer over the model's parameters as they are at its first step (after
    FSDP2 replaced them by sharded ones, as a user makes it after wrapping)."""

    def __init__(self, model):
        self.model, self.optimizer = model, None

    def _made(self):
        if self.optimizer is None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        return self.optimizer

    def step(self):
        self._made().step()

    def zero_grad(self):
        self._made().zero_grad()


class _TinyPipeline:
    """A diffusers pipeline class whose from_pretrained builds the tiny pipeline of
    tests/test_diffusers_integration.py (no download), called with its own small sizes."""

    def __init__(self, make):
        self.make = make

    def from_pretrained(self, name, torch_dtype=None, **kwargs):
        pipe, arguments = self.make()
        pipe.set_progress_bar_config(disable=True)
        call = pipe.__class__.__call__

        class Tiny(pipe.__class__):
            def __call__(self, prompt=None, **options):  # the prompt's embeddings: no text encoder here
                return call(self, **{**arguments, "num_inference_steps": 2, **options})

        pipe.__class__ = Tiny
        return pipe


def _vision(names: dict) -> dict:
    """A tiny vision-language model, its batch as a processor returns it and its labels."""
    import test_transformers_vision as vision

    family = next(family for family in vision.FAMILIES if vision._here(family))
    inputs, _ = vision._batch(family, "dense")
    labels = inputs.pop("labels")
    return dict(model=vision._model(family), processor=lambda **kwargs: dict(inputs), labels=labels, texts=None,
                images=None, videos=None)  # fmt: skip


def _decode_partials(names: dict) -> dict:
    """Each rank's share of a 2-sequence cache: 8 keys a rank, at positions rank x 8 + i."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 4, 16, generator=generator)
    k_cache, v_cache = (torch.randn(dist.get_world_size(), 2, 8, 2, 16, generator=generator)[rank] for _ in range(2))
    positions = torch.arange(8) + 8 * rank
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, q_positions=torch.full((2, 1), 8 * dist.get_world_size()),
                cache_positions=positions.expand(2, 8), cache_lengths=torch.tensor([8, 5]), group=None,
                sinks=torch.zeros(4))  # fmt: skip


def _diffusers(names: dict) -> dict:
    import test_diffusers_integration as video

    return dict(LattePipeline=_TinyPipeline(video._latte_pipeline), WanPipeline=_TinyPipeline(video._wan_pipeline),
                pipe=_TinyPipeline(video._wan_pipeline).from_pretrained("Wan"), prompt="a cat",
                export_to_gif=lambda frames, path: None, device=torch.device("cpu"),
                mesh=mesh_at_the_pools_size("cuda", (2, 4), mesh_dim_names=("ring", "ulysses")))  # fmt: skip


def _preferences(names: dict) -> dict:
    from test_transformers_post_training import _preference_data

    return dict(ref_model=_llama(), pairs=_preference_data(), tokenizer=_character_tokenizer())


def _generation(names: dict) -> dict:
    tokenizer = _character_tokenizer()
    return dict(tokenizer=tokenizer, prompts=["a short prompt", "and a longer prompt"], replies=["yes", "now"],
                device=torch.device("cpu"))  # fmt: skip


def _training(names: dict) -> dict:
    import tempfile

    from test_transformers_trainer import _arguments, _as_torchrun_started

    _as_torchrun_started()
    # Rows of one length: the README's Trainer takes the default collator, which does not pad.
    rows = torch.randint(2, VOCAB, (8, 32), generator=torch.Generator().manual_seed(3)).tolist()
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    return dict(training_args=_arguments(tempfile.mkdtemp(), 2, max_steps=1), dataset=dataset)


# Kits: the names each makes (together, as they belong together), made when a block uses
# any of them. The model is a kit's when it has one, else a tiny Llama.
KITS = (
    (("processor", "texts", "images", "videos", "labels"), _vision),
    (
        ("q", "k_cache", "v_cache", "q_positions", "cache_positions", "cache_lengths", "group", "sinks"),
        _decode_partials,
    ),
    (("LattePipeline", "WanPipeline", "pipe", "prompt", "export_to_gif"), _diffusers),
    (("ref_model", "pairs"), _preferences),
    (("tokenizer", "prompts", "replies"), _generation),
    (("training_args", "dataset"), _training),
)


def standins(free: set[str], source: str) -> dict:
    """The objects a block uses without defining them, made on this rank."""
    made: dict = {
        "torch": torch,
        "dist": dist,
        "REST_OF_THE_ARGUMENTS": dict(REST_OF_THE_ARGUMENTS),
        "mesh_at_the_pools_size": mesh_at_the_pools_size,
    }
    for names, kit in KITS:
        if free & set(names):
            made.update(kit(free))
    if "model" in free and "model" not in made:
        if "output_router_logits" in source:
            from test_transformers_trainer import moe_model

            made["model"] = moe_model("qwen3_moe", VOCAB)
        else:
            made["model"] = _llama()
    if "mesh" in free and "mesh" not in made:
        made["mesh"] = mesh_at_the_pools_size("cuda", (2, 2), mesh_dim_names=("ring", "ulysses"))
    simple = {
        "device": lambda: torch.device("cpu"),
        "batch": _batch,
        "input_ids": lambda: _tokens(12, 2).expand(2, 12).clone(),
        "attention_mask": lambda: torch.ones(2, 12, dtype=torch.long),
        "no_logits": lambda: torch.empty(0, dtype=torch.long),
        "replica_batches": lambda: [_batch(30 + 6 * replica, seed=replica) for replica in range(dist.get_world_size())],
        "optimizer": lambda: _LazySGD(made["model"]),
        "micro_batches": lambda: [_batch(32, seed=index) for index in range(8)],  # a pipeline's step
    }
    for name in free - set(made):
        if name in simple:
            made[name] = simple[name]()
    missing = free - set(made)
    assert not missing, f"no stand-in for {sorted(missing)}"
    return made


def scaled_down(source: str) -> tuple[str, set[int]]:
    """The block as it runs here, and which SCALE_DOWNS applied."""
    applied = set()
    for index, (pattern, replacement) in enumerate(SCALE_DOWNS):
        source, count = re.subn(pattern, replacement, source)
        if count:
            applied.add(index)
    return source, applied
