"""The setup every entry point shares (run.py's training, fgrpo.evaluate, fgrpo.rare_nll build), in the order that
makes bad input fail cheaply: what ``auto`` and an unset lr mean here -> the config's ranges -> the sampler's package
and the device -> the reward functions (loaded where they run) -> the data (and the functions' parameters against its
columns; the same on every rank) -> the model's folder -> the precision this machine runs fast -> every prompt's token
ids. :func:`prepare` runs it and returns a :class:`Run`; nothing here loads the model's weights.

The pieces the loop builds from a config (the learner's and the loss's settings, the sampler, the tracker) are here
too, so that a second entry point makes them the same way.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from fgrpo.algorithm.advantage_methods import AdvantageSettings
from fgrpo.algorithm.advantage_registry import GAMMA_KEY, configured
from fgrpo.algorithm.losses import LossSettings
from fgrpo.config import learning_rate, to_container
from fgrpo.evaluation.rare_set import RareSet, check_vocabulary, load_rare_set
from fgrpo.infra import distributed
from fgrpo.infra.checkpoint import Resumed
from fgrpo.infra.determinism import check_deterministic_settings, make_deterministic
from fgrpo.infra.distributed import SINGLE, Ranks
from fgrpo.infra.errors import ConfigError, DataError
from fgrpo.infra.precision import Precision, resolve_precision
from fgrpo.infra.process_memory import bound_kernel_caches, keep_freed_memory
from fgrpo.infra.tracking import NoTracker, Tracker
from fgrpo.learner.compiled_layers import auto_kept_matmul_gib, require_cpp_compiler, settle_compile
from fgrpo.learner.flex_attention import flex_available
from fgrpo.learner.gpu_memory import fit_learner_to_gpus
from fgrpo.learner.learner import LearnerSettings
from fgrpo.learner.lora import lora_settings_of
from fgrpo.learner.model import load_tokenizer, resolve_model_folder
from fgrpo.environments.spec import DescribeEnvironment, EnvSpec, warm_up_environment
from fgrpo.rewards.binding import EPISODE_NAMES
from fgrpo.rewards.entries import reward_entries
from fgrpo.user_code.loading import resolve_target
from fgrpo.rewards.scoring import Scorer
from fgrpo.environments.chat import Renderer
from fgrpo.rollout.episodes import Environment
from fgrpo.rollout.data import (Problem, RowFormat, arithmetic_problems, generated_problems, load_problems, templated,
                                with_prompts)
from fgrpo.rollout.samplers import (HFSampler, Sampler, VLLMSampler, check_vllm_dtype, require_vllm,
                                    settle_sampler, vllm_enforce_eager)
from fgrpo.validation import advantage_method_of, validate, validate_layout

log = logging.getLogger("fgrpo")


# evaluations draw from their own seed (cfg.seed + this), apart from the training steps' (fgrpo.evaluate uses it too)
EVAL_SEED_OFFSET = 1_000_003


@dataclass
class Run:
    """What :func:`prepare` checked and loaded before the model: the data, the reward functions (:class:`Scorer`), the
    model's folder and tokenizer, every prompt's token ids, and the precision settled for this machine."""

    data: Data
    scorer: Scorer
    folder: Path
    tokenizer: object
    prompt_ids: dict[str, list[int]]
    precision: Precision
    rare_set: RareSet | None = None  # eval.rare_set, scored at each evaluation
    environment: Environment | None = None  # dataset.environment: episodes instead of single samples


def prepare(cfg: DictConfig, ranks: Ranks = SINGLE, *, saved_config: Path | None = None, training: bool = True,
            model_folder: Callable[[], Path] | None = None, check_data: Callable[[Data], None] | None = None) -> Run:
    """Every check that can fail on bad input, before the model loads; seeds, threads and process memory.

    ``training``: also the config's fit to ``ranks.world`` processes, the C++ compiler of compiled layers, whether the
    learner fits the GPUs and ``eval.rare_set``. ``model_folder``: where the weights are (default: the ``model``
    group's), called after the cheap checks. ``check_data``: the entry point's own check of the problems.
    ``saved_config``: the run's ``.hydra/config.yaml``, rewritten with the settled precision.
    Several ranks: each checks, and if any fails all raise the first failure (distributed.agree), so rank 0 can say
    why and no rank is left waiting in a collective."""
    data, scorer = distributed.agree(lambda: check_inputs(cfg, ranks.world, training=training, check_data=check_data))
    try:
        return _prepare_checked(cfg, ranks, data, scorer, saved_config, training, model_folder)
    except BaseException:
        scorer.close()  # its workers started in check_inputs
        raise


def _prepare_checked(cfg: DictConfig, ranks: Ranks, data: Data, scorer: Scorer, saved_config: Path | None,
                     training: bool, model_folder: Callable[[], Path] | None) -> Run:
    """:func:`prepare` after the inputs' checks: the same data on every rank, the model's folder, seeds and threads,
    the precision, every prompt's token ids."""
    same_data_on_every_rank(data)
    folder = distributed.agree(lambda: _weights_folder(cfg, ranks.world, training, model_folder))
    hw = cfg.hardware
    # the layout settled from rank 0's card for all: ranks that ran different micro-batch counts would hang
    hw.micro_batch_tokens, hw.keep_matmul_outputs_gib = distributed.from_rank0(
        (hw.micro_batch_tokens, hw.keep_matmul_outputs_gib))
    if hw.deterministic:  # before the first matmul (cuBLAS reads its workspace setting at start) and any compile
        make_deterministic()
    if hw.device == "cpu":
        keep_freed_memory()
        bound_kernel_caches()  # before the first matmul (the precision probe, vLLM's start-up)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if hw.device == "cpu" and (hw.threads > 0 or ranks.world > 1):
        # several ranks on one machine split its cores (all of them each would oversubscribe)
        torch.set_num_threads(hw.threads or max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    precision = settle_hardware(cfg, saved_config, ranks)
    tokenizer, prompt_ids = distributed.agree(lambda: encode_prompts(cfg, folder, data))
    # batch reward functions (TRL's) get the prompts and completions in chat form where a chat template built them
    scorer.conversational = uses_chat_template(tokenizer, cfg.model)
    scorer.system_prompt = cfg.model.system_prompt
    rare_set = (distributed.agree(lambda: _checked_rare_set(cfg.eval.rare_set, len(tokenizer)))
                if training and cfg.eval.rare_set else None)
    environment = environment_of(cfg, scorer, tokenizer) if scorer.environment is not None else None
    return Run(data, scorer, folder, tokenizer, prompt_ids, precision, rare_set, environment)


def environment_of(cfg: DictConfig, scorer: Scorer, tokenizer) -> Environment:
    """The run's environment: its class's spec (read in check_inputs), how its episodes are rendered, its limits."""
    ds, spec = cfg.dataset, scorer.environment
    renderer = Renderer(tokenizer, chat=uses_chat_template(tokenizer, cfg.model), system_prompt=cfg.model.system_prompt,
                        tools=spec.tools)
    kwargs = to_container(ds.environment_kwargs) if ds.environment_kwargs is not None else {}
    marked = any(bool(item.get("verdict", False)) for item in ds.rewards or [])
    return Environment(spec, renderer, ds.max_turns, ds.episode_max_tokens, ds.environment_timeout_s,
                       ds.environment_threshold, kwargs, verdict_from_rewards=marked,
                       startup_s=ds.reward_import_timeout_s)


def same_data_on_every_rank(data: Data) -> None:
    """Every rank read (or generated) the same problems, else DataError on all of them: a generator that is not
    seeded by its arguments, or files that differ between nodes, would give ranks other problems under one id."""
    digests = distributed.gather_objects(data.digest())
    if len(set(digests)) > 1:
        differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        raise DataError(f"ranks {differing} loaded other problems than rank 0 (other prompts or answers under the same "
                        "ids): a generator must make the same rows from the same dataset.generator_args (seed it from "
                        "them), and every node must see the same data files")


def _weights_folder(cfg: DictConfig, world: int, training: bool, model_folder: Callable[[], Path] | None) -> Path:
    folder = model_folder() if model_folder is not None else resolve_model_folder(cfg.model)
    if training and cfg.hardware.device == "cuda":
        fit_learner_to_gpus(folder, cfg, world)  # settles auto micro-batches and kept matmul outputs too
    return folder



def _checked_rare_set(path: str, vocab_size: int) -> RareSet:
    try:
        rare = load_rare_set(path)
        check_vocabulary(rare, vocab_size)
    except (OSError, ValueError) as error:
        raise ConfigError(f"eval.rare_set={path}: {error}") from error
    return rare


def check_inputs(cfg: DictConfig, world: int = 1, *, training: bool = True,
                 check_data: Callable[[Data], None] | None = None) -> tuple[Data, Scorer]:
    """The config's ranges (and, training, its fit to ``world`` processes), the sampler's package and the device (and,
    training, the compiler of compiled layers), the reward functions (loaded where they run: their workers start), the
    data and the functions' parameters against its columns. ``sampler=auto`` is settled first (vllm or hf), and
    ``sampler.enforce_eager=auto`` (by the device) and ``hardware.compile_learner=auto`` (by the run's learner updates)."""
    settle_sampler(cfg)
    cfg.sampler.enforce_eager = vllm_enforce_eager(cfg.sampler.enforce_eager, cfg.hardware.device)  # saved as it ran
    settle_compile(cfg, say=training)
    # the lr an unset trainer.lr means today, written into the config the run saves (the default may move again)
    cfg.trainer.lr = learning_rate(cfg.trainer.lr, cfg.model.lora.rank)
    validate(cfg)
    check_deterministic_settings(cfg)
    if training:
        validate_layout(cfg, world)
        warn_if_same_as_grpo(cfg)
        warn_if_truncated_sampling(cfg)
    hw = cfg.hardware
    if cfg.sampler.name == "vllm":
        require_vllm()
    if hw.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware=gpu (hardware.device=cuda) but torch sees no CUDA device: use hardware=cpu")
    if training and hw.compile_learner and hw.device == "cpu":
        require_cpp_compiler()
    if training and hw.attention == "flex":
        require_flex(hw.device)
    ds = cfg.dataset
    env_target = resolve_target(ds.environment, "dataset.environment") if ds.environment else None
    scorer = Scorer(reward_entries(ds.rewards, allow_empty=env_target is not None), workers=ds.reward_workers,
                    timeout_s=ds.reward_timeout_s, seed=cfg.seed, rank=int(os.environ.get("RANK", 0)),
                    memory_gib=ds.reward_memory_gib, max_calls=ds.reward_worker_max_calls,
                    import_timeout_s=ds.reward_import_timeout_s, stop_after=ds.reward_stop_after,
                    warm_up_also=functools.partial(warm_up_environment, env_target) if env_target else None)
    try:
        scorer.describe()
        env_spec = describe_environment(scorer, env_target, ds) if env_target else None
        # a row needs a reference answer only where a reward function takes one; as text only where one takes `answer`
        needs = "text" if scorer.needs_answer_text() else "value" if scorer.needs_answer() else False
        data = load_data(cfg.dataset, instruction=cfg.model.instruction, require_answer=needs)
        scorer.check_columns(data.columns() | (set(EPISODE_NAMES) if env_spec else set()))
        if env_spec is not None:
            env_spec.check_columns(data.columns())
        if check_data is not None:
            check_data(data)
    except BaseException:
        scorer.close()
        raise
    scorer.environment = env_spec
    return data, scorer


def describe_environment(scorer: Scorer, target: str, ds) -> EnvSpec:
    """The environment's class read in a worker of the pool (its shape, reset's parameters, its tools), checked
    against the rewards: a tool class without get_reward needs a reward function to judge its episodes."""
    kwargs = to_container(ds.environment_kwargs) if ds.environment_kwargs is not None else {}
    spec = scorer.pool.run([(DescribeEnvironment(target, tuple(kwargs.items())),)], [ds.reward_import_timeout_s])[0]
    if not isinstance(spec, EnvSpec):
        raise ConfigError(str(spec))
    if spec.shape == "tools" and not spec.has_get_reward and not scorer.entries:
        raise ConfigError(f"dataset.environment={target!r} has no get_reward and dataset.rewards is empty: nothing "
                          "says whether an episode is right. Add get_reward() to the class, or a reward function "
                          "(dataset.rewards=[{fn: \"my_env.py:score\"}])")
    return spec



def warn_if_same_as_grpo(cfg: DictConfig) -> None:
    """DAPO's clip and CISPO's clamped weight act only where the ratio pi/pi_old moves from 1, i.e. after the first
    optimizer step on a batch: with one step per batch their gradient is GRPO's, token for token
    (tests/algorithm/test_losses.py::test_on_policy_gradient_equals_reinforce; docs/pilot.md shows a DAPO and a
    GRPO run that agree to 4 digits at every step). Say so where a user asks for DAPO or CISPO and gets GRPO."""
    if cfg.algo.name != "grpo" and cfg.trainer.mini_batches == 1:
        log.warning("algo=%s with trainer.mini_batches=1: every update is on-policy (ratio 1 at every token), where "
                    "%s's loss has the same gradient as GRPO's; set trainer.mini_batches > 1 (the paper: 4, "
                    "mini-batches of 64 of its 256 prompts) for the off-policy updates where the algorithms differ",
                    cfg.algo.name, cfg.algo.name.upper())


def warn_if_truncated_sampling(cfg: DictConfig) -> None:
    """vLLM's log-probs are of the distribution it drew from, after top-p; the learner's are over the whole
    vocabulary. With top_p < 1 the two differ by the truncation too: the mismatch metrics and the corrections see it
    (for the importance weight that is the right ratio: the sampler did draw from the truncated distribution)."""
    if cfg.sampler.name == "vllm" and cfg.sampler.top_p < 1:
        log.warning("sampler.top_p=%g: vLLM's log-probs are renormalised over the top-p tokens, the learner's are over "
                    "the whole vocabulary, so train/mismatch/* and algo.rollout_correction count the truncation as "
                    "mismatch (docs/mismatch.md)", cfg.sampler.top_p)


def require_flex(device: str) -> None:
    """hardware.attention=flex on a machine that cannot run it: fail before the model loads, naming the way out."""
    problem = flex_available(device)
    if problem:
        raise ConfigError(f"hardware.attention=flex cannot run here: {problem}. Set hardware.attention=sdpa (and, for "
                          "padded micro-batches, hardware.micro_batch_tokens=null hardware.share_prompts=false)")


def encode_prompts(cfg: DictConfig, folder: Path, data: Data) -> tuple[object, dict[str, list[int]]]:
    """The tokenizer and every prompt's token ids, each checked to leave room for a completion."""
    tokenizer = load_tokenizer(folder)
    problems = data.train + [p for eval_set in data.eval.values() for p in eval_set]
    prompt_ids = {p.id: encode_prompt(tokenizer, cfg.model, p) for p in problems}
    # an episode's turns follow its prompt: its whole budget must fit
    key, after = (("dataset.episode_max_tokens", cfg.dataset.episode_max_tokens) if cfg.dataset.environment
                  else ("sampler.max_new_tokens", cfg.sampler.max_new_tokens))
    too_long = [pid for pid, ids in prompt_ids.items() if len(ids) + after > cfg.sampler.max_model_len]
    if too_long:
        raise ConfigError(
            f"{len(too_long)} prompts (e.g. {too_long[0]}) plus {key}={after} "
            f"exceed sampler.max_model_len={cfg.sampler.max_model_len}: raise sampler.max_model_len"
        )
    return tokenizer, prompt_ids


def uses_chat_template(tokenizer, model_cfg) -> bool:
    """Whether prompts go through the tokenizer's chat template (``model.chat_template: auto`` and it has one)."""
    return model_cfg.chat_template != "plain" and tokenizer.chat_template is not None


def encode_prompt(tokenizer, model_cfg, problem: Problem) -> list[int]:
    """Token ids of one problem's prompt (its user message, or its chat messages), through the model's chat template
    unless ``chat_template: plain`` (then the messages' contents, one per paragraph)."""
    prompt = with_prompts([problem], model_cfg.instruction)[0].prompt
    messages = list(prompt) if isinstance(prompt, tuple) else [{"role": "user", "content": prompt}]
    if model_cfg.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": model_cfg.system_prompt})
    if not uses_chat_template(tokenizer, model_cfg):
        return tokenizer("\n\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@dataclass
class Data:
    train: list[Problem]
    eval: dict[str, list[Problem]]  # dataset name -> held-out problems

    def digest(self) -> str:
        """A hash of every problem's id, prompt and answer: equal on ranks that loaded the same problems."""
        problems = self.train + [p for name in sorted(self.eval) for p in self.eval[name]]
        text = json.dumps([(p.id, p.prompt, p.answer) for p in problems], default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def columns(self) -> set[str]:
        """The columns every problem's row has (what a reward function's parameter may name)."""
        problems = self.train + [p for problems in self.eval.values() for p in problems]
        return set.intersection(*(set(p.fields) for p in problems)) if problems else set()


def load_data(dataset_cfg, *, instruction: str = "", require_answer: bool | str = True) -> Data:
    """Read (or generate) every problem up front, so a bad file fails before the model loads; each prompt settled
    (``instruction``: ``model.instruction``)."""
    fmt = RowFormat(messages_field=dataset_cfg.messages_field, prompt_template=dataset_cfg.prompt_template,
                    instruction=instruction, require_answer=require_answer)
    if dataset_cfg.kind == "arithmetic":
        a = dataset_cfg.arithmetic
        train, held_out = arithmetic_problems(ops=tuple(a.ops), max_operand=a.max_operand, seed=a.seed, n_eval=a.n_eval)
        if fmt.prompt_template is not None:  # over each problem's fields: question, answer, a, op, b
            train, held_out = (templated(problems, fmt.prompt_template, instruction=instruction, where=where)
                               for problems, where in ((train, "arithmetic (train)"), (held_out, "arithmetic (eval)")))
        return Data(train=with_prompts(train, instruction), eval={dataset_cfg.name: with_prompts(held_out, instruction)})
    if dataset_cfg.kind == "generator":
        args = OmegaConf.to_container(dataset_cfg.generator_args) if dataset_cfg.generator_args is not None else {}
        train, held_out = generated_problems(dataset_cfg.generator, args, name=dataset_cfg.name,
                                             n_eval=dataset_cfg.generator_n_eval, fmt=fmt,
                                             timeout_s=dataset_cfg.generator_timeout_s,
                                             import_timeout_s=dataset_cfg.reward_import_timeout_s)
        return Data(train=with_prompts(train, instruction), eval={dataset_cfg.name: with_prompts(held_out, instruction)})
    if dataset_cfg.kind == "reasoning_gym":  # reasoning-gym's tasks by name: one held-out set per task
        from fgrpo.tasks.reasoning_gym import reasoning_gym_problems

        train, held_out = reasoning_gym_problems(dataset_cfg, fmt)
        return Data(train=with_prompts(train, instruction),
                    eval={task: with_prompts(problems, instruction) for task, problems in held_out.items()})
    if dataset_cfg.train is None or not dataset_cfg.eval:
        raise ConfigError(f"dataset={dataset_cfg.name}: a 'sources' dataset needs dataset.train and a dataset.eval list")

    def read(source) -> list[Problem]:
        if source.path is None:
            raise ConfigError(f"dataset source '{source.name}' has no path: set it, e.g. dataset.train.path=/data/train.jsonl")
        return load_problems(
            name=source.name, kind=source.kind, path=source.path, split=source.split, subset=source.subset,
            question_field=source.question_field, answer_field=source.answer_field, limit=source.limit,
            messages_field=fmt.messages_field, prompt_template=fmt.prompt_template, instruction=instruction,
            require_answer=require_answer,
        )

    return Data(train=with_prompts(read(dataset_cfg.train), instruction),
                eval={source.name: with_prompts(read(source), instruction) for source in dataset_cfg.eval})


def settle_hardware(cfg: DictConfig, saved_config: Path | None = None, ranks: Ranks = SINGLE):
    """Replace ``auto`` in ``hardware.autocast_dtype`` / ``sampler_dtype`` by what this machine runs fast
    (fgrpo.infra.precision) and in ``hardware.keep_matmul_outputs_gib`` by the budget for that dtype, log the choice
    and its reason, and write the settled config to ``saved_config`` (the run's ``.hydra/config.yaml``) so that
    the run directory says what ran. Before the model loads; returns the :class:`~fgrpo.infra.precision.Precision`.
    Several ranks: rank 0 probes and decides for all (a timed probe could tip differently on another rank)."""
    hw = cfg.hardware
    precision = distributed.from_rank0(distributed.agree(
        lambda: resolve_precision(hw.device, hw.autocast_dtype, hw.sampler_dtype) if ranks.main else None))
    hw.autocast_dtype, hw.sampler_dtype = precision.autocast_dtype, precision.sampler_dtype
    if hw.keep_matmul_outputs_gib == "auto":
        selective = hw.gradient_checkpointing and hw.compile_learner
        matmul_dtype = getattr(torch, hw.autocast_dtype or hw.learner_dtype)
        hw.keep_matmul_outputs_gib = auto_kept_matmul_gib(matmul_dtype) if selective else 0.0
    log.info("precision: learner matmuls in %s (%s weights%s), sampler in %s; %s%s",
             hw.autocast_dtype or hw.learner_dtype, hw.learner_dtype,
             f", up to {hw.keep_matmul_outputs_gib:g} GiB of matmul outputs kept" if hw.keep_matmul_outputs_gib else "",
             hw.sampler_dtype, f"{precision.cpu}: " if precision.cpu else "", precision.reason)
    if cfg.sampler.name == "vllm":
        distributed.agree(lambda: check_vllm_dtype(hw.sampler_dtype, hw.device))
    if saved_config is not None and saved_config.is_file() and ranks.main:
        OmegaConf.save(cfg, saved_config)
    return precision


def learner_settings(cfg: DictConfig) -> LearnerSettings:
    hw, trainer = cfg.hardware, cfg.trainer
    return LearnerSettings(
        model_name=cfg.model.name,
        # a response's longest (Dr. GRPO's norm): an episode's budget where the run has an environment
        max_new_tokens=cfg.dataset.episode_max_tokens if cfg.dataset.environment else cfg.sampler.max_new_tokens, temperature=cfg.sampler.temperature, device=hw.device,
        dtype=hw.learner_dtype, autocast_dtype=hw.autocast_dtype, attention=hw.attention, compile=hw.compile_learner,
        gradient_checkpointing=hw.gradient_checkpointing, fsdp=hw.fsdp, cpu_offload=hw.cpu_offload,
        sync_grads_once=hw.sync_grads_once,
        kept_matmul_gib=hw.keep_matmul_outputs_gib,
        micro_batch_size=hw.micro_batch_size, micro_batch_tokens=hw.micro_batch_tokens,
        share_prompts=hw.share_prompts, lr=learning_rate(trainer.lr, cfg.model.lora.rank), betas=tuple(trainer.betas), weight_decay=trainer.weight_decay,
        warmup_steps=trainer.warmup_steps, grad_clip=trainer.grad_clip, mini_batches=trainer.mini_batches,
        lora=lora_settings_of(cfg.model),
    )


def advantage_settings(cfg: DictConfig) -> AdvantageSettings:
    """The advantage method and the values of the parameters it declares (``focal.gamma`` where it takes gamma)."""
    method = advantage_method_of(cfg.advantage.name)
    params = {name: cfg.focal.gamma if method.key(name) == GAMMA_KEY else configured(cfg.advantage, name, param)
              for name, param in method.params.items()}
    return AdvantageSettings(cfg.advantage.name, **params)


def loss_settings(algo: DictConfig) -> LossSettings:
    return LossSettings(algo=algo.name, clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.loss_agg,
                        kl_coef=algo.kl_coef, entropy_coef=algo.entropy_coef, ratio_level=algo.ratio_level,
                        rollout_correction=algo.rollout_correction, correction_low=algo.correction_low,
                        correction_high=algo.correction_high, off_policy_mask=algo.off_policy_mask,
                        kl_bias_correction=algo.kl_bias_correction, old_logprobs=algo.old_logprobs)


def make_sampler(cfg: DictConfig, folder: Path, policy, tokenizer, ranks: Ranks = SINGLE) -> Sampler:
    if cfg.sampler.name == "vllm":
        return VLLMSampler(
            # one seed per engine: on CPU the engine's seed drives every draw, and engines with one seed would
            # draw the same random numbers for different prompts
            folder, dtype=cfg.hardware.sampler_dtype, max_model_len=cfg.sampler.max_model_len,
            seed=cfg.seed + 7_919 * ranks.data_parallel_rank, device=cfg.hardware.device,
            kv_cache_gib=cfg.hardware.sampler_kv_cache_gib,
            gpu_memory_utilization=cfg.hardware.sampler_gpu_memory_utilization,
            tensor_parallel_size=cfg.sampler.tensor_parallel_size, distributed=ranks.world > 1,
            sleep=cfg.hardware.sampler_sleep,
            enforce_eager=vllm_enforce_eager(cfg.sampler.enforce_eager, cfg.hardware.device),  # settled: as it is
        )
    return HFSampler(policy, tokenizer, batch_size=cfg.sampler.hf_batch_size, autocast_dtype=cfg.hardware.autocast_dtype)


def make_tracker(cfg: DictConfig, run_dir: Path, run_name, overrides, precision: Precision,
                 ranks: Ranks = SINGLE, resumed: Resumed | None = None) -> Tracker | NoTracker:
    """Rank 0's tracker. Resumed: the same W&B run, and metrics.jsonl keeps the rows up to the checkpoint's step
    (later ones, logged before the run stopped, move to metrics_superseded.jsonl); a run that starts at step 0 in a
    directory with rows from an attempt that saved no checkpoint supersedes all of them."""
    if not ranks.main:
        return NoTracker()
    return Tracker(
        run_dir, resume_id=resumed.state.wandb_run_id if resumed else None,
        keep_steps_through=resumed.state.step if resumed else -1, backend=cfg.logger.name, project=cfg.logger.get("project", "fgrpo"),
        name=cfg.run_name or run_name, group=cfg.logger.get("group"), mode=cfg.logger.get("mode"),
        entity=cfg.logger.get("entity"), tags=list(cfg.logger.get("tags") or []),
        config={**to_container(cfg), "overrides": list(overrides or []), "precision": precision.as_dict(),
                "world_size": ranks.world},
    )
