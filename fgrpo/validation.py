"""The checks a config must pass before anything expensive starts: :func:`validate` (every key's range, all problems
listed together), :func:`validate_layout` (the config against the number of processes launched) and
:func:`advantage_method_of` (the advantage method a config names, a user's loaded by import path).

The lists of allowed names live with the code that implements them and are imported inside :func:`validate`, so that
``import fgrpo.validation`` stays free of torch.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig

from fgrpo.algorithm.advantage_methods import methods
from fgrpo.algorithm.advantage_registry import GAMMA_KEY, AdvantageMethod, configured, declare
from fgrpo.algorithm.user_method import user_method_problem
from fgrpo.config import Config, advantage_node, learning_rate
from fgrpo.infra.errors import ConfigError
from fgrpo.user_code.loading import is_import_path, load_function

__all__ = ["validate", "validate_layout", "advantage_method_of", "smallest_kept_lr", "TYPICAL_WEIGHT"]


def validate(cfg: DictConfig | Config) -> None:
    """Range checks that must fail before the model loads. Raises ConfigError listing every problem."""
    # every list of allowed names lives with the code that implements them; imported here, not at the top, so that
    # `import fgrpo.config` (run.py, the sweeper: before Hydra parses the command line) stays free of torch
    from fgrpo.algorithm.losses import AGG_MODES, ALGOS
    from fgrpo.infra.precision import AUTOCAST_CHOICES, SAMPLER_CHOICES
    from fgrpo.infra.tracking import BACKENDS, WANDB_MODES
    from fgrpo.learner.forward import ATTENTIONS
    from fgrpo.learner.model import DEVICES, MODEL_SOURCES, WEIGHT_DTYPES
    from fgrpo.rollout.samplers import SAMPLER_NAMES

    problems: list[str] = []

    def need(ok: bool, key: str, value: Any, allowed: str) -> None:
        if not ok:
            problems.append(f"{key}={value!r}: {allowed}")

    need(cfg.algo.name in ALGOS, "algo.name", cfg.algo.name, f"must be one of {ALGOS}")
    need(cfg.algo.group_size >= 2, "algo.group_size", cfg.algo.group_size,
         "must be >= 2 (group-relative advantages need two samples per prompt)")
    need(cfg.algo.clip_low > 0, "algo.clip_low", cfg.algo.clip_low, "must be > 0")
    need(cfg.algo.clip_high > 0, "algo.clip_high", cfg.algo.clip_high, "must be > 0")
    need(cfg.algo.loss_agg in AGG_MODES, "algo.loss_agg", cfg.algo.loss_agg, f"must be one of {AGG_MODES}")
    _check_advantage(cfg, need)
    need(cfg.algo.kl_coef >= 0, "algo.kl_coef", cfg.algo.kl_coef, "must be >= 0")
    need(cfg.algo.entropy_coef >= 0, "algo.entropy_coef", cfg.algo.entropy_coef, "must be >= 0")
    _check_corrections(cfg.algo, cfg.trainer.mini_batches, need)
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
    need(cfg.sampler.name in SAMPLER_NAMES, "sampler.name", cfg.sampler.name, f"must be one of {SAMPLER_NAMES}")
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
    need(cfg.sampler.tensor_parallel_size == 1 or cfg.sampler.name in ("vllm", "auto"), "sampler.tensor_parallel_size",
         cfg.sampler.tensor_parallel_size, "splits a vLLM engine over ranks: use sampler=vllm, or set it to 1")
    need(cfg.sampler.enforce_eager in (True, False, "auto"), "sampler.enforce_eager", cfg.sampler.enforce_eager,
         "must be true, false or auto (true on the CPU, false on a GPU: CUDA graphs on)")
    need(cfg.model.source in MODEL_SOURCES, "model.source", cfg.model.source, f"must be one of {MODEL_SOURCES}")
    need(cfg.model.source != "hub" or bool(cfg.model.path), "model.path", cfg.model.path,
         "a hub model needs model.path (a hub id or a local folder)")
    _check_dataset(cfg.dataset, need, problems)
    need(cfg.logger.name in BACKENDS, "logger.name", cfg.logger.name, f"must be one of {BACKENDS}")
    need(cfg.logger.mode is None or cfg.logger.mode in WANDB_MODES, "logger.mode", cfg.logger.mode,
         f"must be one of {WANDB_MODES} (or unset: $WANDB_MODE, else offline)")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _check_corrections(algo, mini_batches: int, need) -> None:
    """The ratio's level and the sampler/learner corrections (fgrpo.algorithm.corrections)."""
    from fgrpo.algorithm.corrections import RATIO_LEVELS, ROLLOUT_CORRECTIONS, SEQUENCE_FORMS

    need(algo.ratio_level in RATIO_LEVELS, "algo.ratio_level", algo.ratio_level, f"must be one of {RATIO_LEVELS}")
    need(algo.ratio_level != "sequence" or algo.name in SEQUENCE_FORMS, "algo.ratio_level", algo.ratio_level,
         f"algo={algo.name} has no sequence form: set algo.ratio_level=token, or use one of {SEQUENCE_FORMS}")
    need(algo.name != "gspo" or algo.ratio_level == "sequence", "algo.ratio_level", algo.ratio_level,
         "algo=gspo is GRPO's clip on the sequence ratio: keep algo.ratio_level=sequence, or use algo=grpo")
    need(algo.rollout_correction in ROLLOUT_CORRECTIONS, "algo.rollout_correction", algo.rollout_correction,
         f"must be one of {ROLLOUT_CORRECTIONS}")
    low, high = algo.correction_low, algo.correction_high
    need(0 < low <= 1, "algo.correction_low", low, "must be in (0, 1]: the masks keep ratios in [low, high]")
    need(high >= 1 and high >= low, "algo.correction_high", high,
         "must be >= 1 and >= algo.correction_low: the masks keep ratios in [low, high], the truncation caps at high")
    need(algo.off_policy_mask is None or algo.off_policy_mask >= 0, "algo.off_policy_mask", algo.off_policy_mask,
         "must be >= 0 (a mean log-ratio threshold, e.g. 0.5), or null for off")
    need(not algo.kl_bias_correction or algo.kl_coef > 0, "algo.kl_bias_correction", True,
         "corrects the KL term, which is off: set algo.kl_coef > 0, or algo.kl_bias_correction=false")
    need(algo.old_logprobs in ("learner", "sampler"), "algo.old_logprobs", algo.old_logprobs,
         "must be learner or sampler")
    need(algo.old_logprobs != "sampler" or mini_batches > 1, "algo.old_logprobs", algo.old_logprobs,
         "the old policy is read only with trainer.mini_batches > 1 (one mini-batch is on-policy): set "
         "trainer.mini_batches, or algo.old_logprobs=learner")
    need(algo.old_logprobs != "sampler" or algo.rollout_correction == "none", "algo.rollout_correction",
         algo.rollout_correction, "with algo.old_logprobs=sampler the ratio pi / pi_sampler already weights the "
         "sampler's draws: set algo.rollout_correction=none, or algo.old_logprobs=learner")


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


def advantage_method_of(name: str) -> AdvantageMethod:
    """The method ``advantage.name`` names: fgrpo's by name, or a user's function by import path (loaded here; its
    declaration, or none, then known under that path). ConfigError listing the choices otherwise."""
    known = methods()
    if name in known:
        return known[name]
    if not is_import_path(name):
        own = tuple(n for n, m in known.items() if getattr(m.fn, "__module__", "").startswith("fgrpo."))
        raise ConfigError(f"advantage.name={name!r}: must be one of {own} (advantage=<name>), or a function "
                          "of yours by import path (advantage.name=\"my_adv.py:my_method\", docs/tasks.md)")
    fn = load_function(name, "advantage.name")
    method = getattr(fn, "advantage_method", None) or AdvantageMethod(name, fn)
    declare(name, method)
    return method


def _check_advantage(cfg, need) -> None:
    """The advantage method, its declared parameters' ranges and what it combines with, through :func:`validate`'s
    ``need``: all from the method's declaration (fgrpo.algorithm.advantage_registry)."""
    adv = cfg.advantage
    try:
        method = advantage_method_of(adv.name)
    except ConfigError as error:
        need(False, "advantage.name", adv.name, str(error).split(": ", 1)[1])
        return
    values, ranges_ok = {}, True
    for param_name, param in method.params.items():
        key = method.key(param_name)
        value = cfg.get("focal", {}).get("gamma", 0.0) if key == GAMMA_KEY else configured(adv, param_name, param)
        problem = param.problem(value, lambda bound: _select(cfg, bound))
        need(problem is None, key, value, problem or "")
        values[param_name], ranges_ok = value, ranges_ok and problem is None
    if is_import_path(adv.name) and ranges_ok:  # a user's: its signature and a call on a small synthetic batch
        problem = user_method_problem(method, values, cfg.algo.group_size)
        need(problem is None, "advantage.name", adv.name, problem or "")
    if all(method.key(p) != GAMMA_KEY for p in method.params):
        need(cfg.focal.gamma == 0, "focal.gamma", cfg.focal.gamma,
             f"weights advantage=focal only: use advantage=focal, or focal.gamma=0 with advantage={adv.name}")
    schema = set(advantage_node())  # the built-in methods' keys, always there (null where unset)
    for key in adv:
        need(key in schema or key in method.params or adv[key] is None, f"advantage.{key}", adv[key],
             f"is not a parameter of advantage={adv.name} (its parameters: {sorted(method.params) or 'none'})")
    # these read the 0/1 verdicts (or need rewards >= 0): DAPO's overlong penalty would be ignored or break them
    need(not (cfg.algo.overlong_shaping and not method.shaped_rewards), "algo.overlong_shaping", True,
         f"advantage={adv.name} reads whether each sample is correct, not shaped rewards (MaxRL divides by the "
         "mean reward, which a penalty can make <= 0): set algo.overlong_shaping=false, or use advantage=focal, "
         "dr_grpo or unlikeliness")


def _select(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node.get(part) if hasattr(node, "get") else None
    return node


def _check_environment(dataset, need) -> None:
    """``dataset.environment`` and its limits (the class itself is read in a worker: fgrpo.environments.spec)."""
    need(is_import_path(dataset.environment), "dataset.environment", dataset.environment,
         "name the class as \"my_env.py:MyEnv\" or \"package.module:MyEnv\"")
    need(dataset.max_turns >= 1, "dataset.max_turns", dataset.max_turns, "must be >= 1 (the model's turns per episode)")
    need(dataset.episode_max_tokens >= 1, "dataset.episode_max_tokens", dataset.episode_max_tokens,
         "must be >= 1 (an episode's tokens after its first prompt, e.g. 512)")
    need(0 < dataset.environment_timeout_s < math.inf, "dataset.environment_timeout_s", dataset.environment_timeout_s,
         "must be a finite number of seconds > 0 (each call's limit, e.g. 10)")
    need(dataset.environment_kwargs is None or hasattr(dataset.environment_kwargs, "keys"),
         "dataset.environment_kwargs", dataset.environment_kwargs, "must be the constructor's arguments by name, e.g. "
         "{attempts: 3}, or null")


def _check_dataset(dataset, need, problems: list[str]) -> None:
    """``dataset.*``: its kind, the reward functions (fgrpo.rewards.entries; their files must exist), the pool, the
    prompt's template or messages, a generator."""
    from fgrpo.rewards.entries import reward_entries
    from fgrpo.user_code.pool import AUTO_WORKERS
    from fgrpo.rollout.data import DATASET_KINDS
    from fgrpo.rollout.rows import template_fields

    need(dataset.kind in DATASET_KINDS, "dataset.kind", dataset.kind, f"must be one of {DATASET_KINDS}")
    try:
        reward_entries(dataset.rewards, allow_empty=dataset.environment is not None)
    except ConfigError as error:
        problems.extend(line.strip() for line in str(error).splitlines()[1:] or [str(error)])
    workers = dataset.reward_workers
    need(workers == AUTO_WORKERS or (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1),
         "dataset.reward_workers", workers, f"must be {AUTO_WORKERS} or an int >= 1 (a user's reward functions "
         f"always run in workers; 1: one); e.g. dataset.reward_workers={AUTO_WORKERS} or dataset.reward_workers=4")
    need(0 < dataset.reward_timeout_s < math.inf, "dataset.reward_timeout_s", dataset.reward_timeout_s,
         "must be a finite number > 0 (seconds one call may take, e.g. 5.0)")
    need(0 < dataset.reward_import_timeout_s < math.inf, "dataset.reward_import_timeout_s",
         dataset.reward_import_timeout_s, "must be a finite number > 0 (seconds a worker's imports may take, e.g. 120)")
    need(dataset.reward_memory_gib is None or 0 < dataset.reward_memory_gib < math.inf, "dataset.reward_memory_gib",
         dataset.reward_memory_gib, "must be a number of GiB > 0 (each worker's cap, e.g. 4) or null (no cap)")
    need(dataset.reward_worker_max_calls >= 0, "dataset.reward_worker_max_calls", dataset.reward_worker_max_calls,
         "must be >= 0 (0: a worker is never replaced)")
    need(dataset.reward_stop_after >= 0, "dataset.reward_stop_after", dataset.reward_stop_after,
         "must be >= 0 (0: a function failing its first calls does not stop the run early)")
    if dataset.environment is not None:
        _check_environment(dataset, need)
    if dataset.prompt_template is not None:
        try:
            template_fields(dataset.prompt_template)
        except ConfigError as error:
            problems.append(str(error))
    need(dataset.messages_field is None or dataset.kind != "arithmetic", "dataset.messages_field",
         dataset.messages_field, "dataset=arithmetic has no column of chat messages: set it to null (a prompt_template "
         "can use the columns question, answer, a, op and b)")
    need(dataset.prompt_template is None or dataset.messages_field is None, "dataset.messages_field",
         dataset.messages_field, "takes the prompt from a column of chat messages, and dataset.prompt_template builds "
         "it from columns: set one of them to null")
    if dataset.kind == "generator":
        need(is_import_path(dataset.generator or ""), "dataset.generator", dataset.generator,
             "dataset.kind=generator needs the function that makes the rows: dataset.generator=\"my_task.py:generate\"")
        need(dataset.generator_args is None or hasattr(dataset.generator_args, "keys"), "dataset.generator_args",
             dataset.generator_args, "must be the generator's keyword arguments, e.g. {seed: 0, count: 200}")
        need(0 < dataset.generator_timeout_s < math.inf, "dataset.generator_timeout_s", dataset.generator_timeout_s,
             "must be a finite number of seconds > 0 (the generator's time limit, e.g. 300)")
        need(dataset.generator_n_eval >= 1, "dataset.generator_n_eval", dataset.generator_n_eval,
             "must be >= 1 (rows held out for evaluation)")


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
    need(hw.compile_learner in (True, False, "auto"), "hardware.compile_learner", hw.compile_learner,
         "must be true, false or auto (compiled for runs of 40 learner updates or more)")
    kept = hw.keep_matmul_outputs_gib
    numeric = isinstance(kept, (int, float)) and not isinstance(kept, bool)
    need(kept == "auto" or (numeric and kept >= 0), "hardware.keep_matmul_outputs_gib", kept,
         "must be auto or >= 0 (GiB per micro-batch; 0 keeps none)")
    need(kept in ("auto", 0) or (hw.gradient_checkpointing and hw.compile_learner),
         "hardware.keep_matmul_outputs_gib", kept, "chooses what gradient checkpointing keeps inside compiled layers: "
         "set hardware.gradient_checkpointing=true and hardware.compile_learner=true, or set it to 0")



# the magnitude of a typical weight of a trained LLM's linear layers (Qwen2.5-7B's: std about 0.02, median |w| about
# 0.013): the scale at which the bf16 / fp16 spacing is judged against the learning rate
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


