import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from fgrpo.validation import validate

from fgrpo.infra.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["model", "algo", "focal", "advantage", "dataset", "hardware", "sampler", "logger"]


@pytest.mark.parametrize(
    "group, option", [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
)
def test_every_option_of_every_group_composes(compose, group, option):
    overrides = [f"{group}={option}"]
    if option == "local":  # its file paths are mandatory: give some
        overrides += ["dataset.train.path=a.jsonl", "dataset.eval.0.path=b.jsonl"]
    cfg = compose(*overrides)
    assert cfg[group].get("name", option) in (option, cfg[group].get("name"))
    validate(cfg)


def test_paper_values_per_algorithm(compose):
    expected = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "cispo": (1.0, 5.0)}
    for algo, (low, high) in expected.items():
        cfg = compose(f"algo={algo}")
        assert (cfg.algo.name, cfg.algo.clip_low, cfg.algo.clip_high) == (algo, low, high)
        assert cfg.algo.group_size == 8 and cfg.algo.loss_agg == "token-mean" and cfg.algo.kl_coef == 0
        assert not cfg.algo.dynamic_sampling and not cfg.algo.overlong_shaping
    assert compose().focal.gamma == 0.0
    assert compose("algo=cispo", "focal.gamma=1.0").focal.gamma == 1.0
    assert compose("focal=fgrpo").focal.gamma == 1.0
    gspo = compose("algo=gspo").algo  # GSPO's clip range on the sequence ratio, each sequence weighted alike
    assert (gspo.name, gspo.ratio_level, gspo.clip_low, gspo.clip_high, gspo.loss_agg) == (
        "gspo", "sequence", 3e-4, 4e-4, "seq-mean-token-mean")
    assert compose().algo.rollout_correction == "none" and compose().algo.ratio_level == "token"


def test_path_valued_overrides_stay_out_of_a_sweep_job_directory_name(compose):
    """A '/' in hydra.sweep.subdir would nest a sweep job's run directory under folders named after the path."""
    paths = ["model.path=org/model", "dataset.train.path=data/train.jsonl", "dataset.eval.0.path=data/eval.jsonl",
             "eval.model=outputs/run", "eval.rare_set=docs/results/arith_headroom/rare_set"]
    cfg = compose("dataset=local", "seed=1", *paths, hydra=True)
    assert cfg.hydra.job.override_dirname == "dataset=local,seed=1"


def test_schema_rejects_misspelt_key(compose, tmp_path):
    with pytest.raises(ConfigCompositionException, match="clip_lowx"):
        compose("algo.clip_lowx=0.3")
    # a misspelt key in a user's own option file fails at start, naming the key and the schema
    import shutil

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "algo" / "mine.yaml").write_text("name: grpo\nclip_lw: 0.1\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as info:
            hydra_compose("config", overrides=["algo=mine"])
    assert "Key 'clip_lw' not in 'AlgoConfig'" in str(info.value.__cause__ or info.value)


def test_schema_rejects_wrong_type(compose):
    with pytest.raises((ConfigCompositionException, ValidationError), match="gamma"):
        compose("focal.gamma=lots")
    with pytest.raises((ConfigCompositionException, ValidationError), match="group_size"):
        compose("algo.group_size=8.5")


def test_unknown_group_option_lists_choices(compose):
    with pytest.raises(Exception, match=r"(?s)Could not find 'algo/ppo'.*cispo.*dapo.*grpo"):
        compose("algo=ppo")


@pytest.mark.parametrize(
    "override, message",
    [
        ("focal.gamma=-0.5", "focal.gamma=-0.5: must be >= 0"),
        ("algo.group_size=1", "algo.group_size=1: must be >= 2"),
        ("trainer.lr=0", "trainer.lr=0.0: must be > 0"),
        ("trainer.lr=-1e-5", "trainer.lr=-1e-05: must be > 0"),
        ("sampler.temperature=0", "sampler.temperature"),
        ("eval.n_samples=0", "eval.n_samples"),
        ("logger.mode=sometimes", "logger.mode"),
        ("hardware.attention=flash", "hardware.attention='flash': must be one of ('sdpa', 'eager', 'segments', 'flex')"),
        ("hardware.sampler_kv_cache_gib=0", "hardware.sampler_kv_cache_gib=0.0: must be > 0"),
        ("hardware.autocast_dtype=fp16", "hardware.autocast_dtype='fp16': must be auto (bfloat16 where this machine "
                                         "runs it natively), float32 or null (no autocast), bfloat16 or float16"),
        ("hardware.sampler_dtype=half", "hardware.sampler_dtype='half': must be auto"),
        ("hardware.learner_dtype=auto", "hardware.learner_dtype='auto': must be one of ('float32', 'bfloat16', 'float16')"),
        ("advantage.name=grpo_passk", "advantage.name='grpo_passk': must be one of ('focal', 'mean_focal', 'dr_grpo', "
                                      "'maxrl', 'unlikeliness', 'w_reinforce', 'passk') (advantage=<name>)"),
        ("dataset.reward_timeout_s=inf", "dataset.reward_timeout_s=inf: must be a finite number > 0"),
        ("dataset.messages_field=prompt", "dataset.messages_field='prompt': dataset=arithmetic has no column of chat"),
        ("advantage=passk advantage.k=9", "advantage.k=9: must be in .1, algo.group_size=8. (the k of the pass@k"),
        ("advantage=w_reinforce advantage.lam=0", "advantage.lam=0: must be > 0.0 (W-REINFORCE's weight"),
        ("advantage=unlikeliness advantage.beta=1.5", "advantage.beta=1.5: must be in .0.0, 1.0. (the unlikeliness "
                                                     "penalty"),
        ("algo.rollout_correction=token_clip", "algo.rollout_correction='token_clip': must be one of ('none', "
                                               "'token_truncate'"),
        ("algo.correction_low=0", "algo.correction_low=0.0: must be in (0, 1]"),
        ("algo.correction_low=0.5 algo.correction_high=0.8", "algo.correction_high=0.8: must be >= 1 and >= "
                                                             "algo.correction_low"),
        ("algo.ratio_level=group", "algo.ratio_level='group': must be one of ('token', 'sequence')"),
        ("algo=gspo algo.ratio_level=token", "algo.ratio_level='token': algo=gspo is GRPO's clip on the sequence"),
        ("algo.off_policy_mask=-1", "algo.off_policy_mask=-1.0: must be >= 0"),
        ("algo.kl_bias_correction=true", "algo.kl_bias_correction=True: corrects the KL term, which is off"),
        ("algo.old_logprobs=sampler", "algo.old_logprobs='sampler': the old policy is read only with "
                                      "trainer.mini_batches > 1"),
        ("algo.old_logprobs=sampler trainer.mini_batches=2 algo.rollout_correction=token_mask",
         "algo.rollout_correction='token_mask': with algo.old_logprobs=sampler the ratio"),
    ],
)
def test_range_checks_name_key_and_value(compose, override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(compose(*override.split()))


def test_several_problems_are_reported_together(compose):
    with pytest.raises(ConfigError) as info:
        validate(compose("focal.gamma=-1", "algo.group_size=1"))
    assert "focal.gamma" in str(info.value) and "algo.group_size" in str(info.value)


def test_cpu_defaults_are_the_fast_path(compose):
    hardware = compose().hardware
    assert (hardware.attention, hardware.compile_learner) == ("segments", "auto")
    # the dtypes follow the CPU (fgrpo.infra.precision): bf16 only where it is native
    assert (hardware.learner_dtype, hardware.autocast_dtype, hardware.sampler_dtype) == ("float32", "auto", "auto")
    assert compose("hardware=gpu").hardware.autocast_dtype == "auto"
    validate(compose("hardware.autocast_dtype=null", "hardware.sampler_dtype=float32"))  # the fp32 spelling by hand
    assert hardware.share_prompts and hardware.gradient_checkpointing and hardware.keep_matmul_outputs_gib == "auto"
    assert compose("hardware.sampler_kv_cache_gib=0.25").hardware.sampler_kv_cache_gib == 0.25  # fractions allowed


@pytest.mark.parametrize("algo", ["dapo", "cispo"])
def test_dapo_or_cispo_on_policy_warns_that_it_is_grpo(compose, caplog, algo):
    from fgrpo.prepare import warn_if_same_as_grpo

    with caplog.at_level("WARNING", logger="fgrpo"):
        warn_if_same_as_grpo(compose(f"algo={algo}"))
    assert f"algo={algo} with trainer.mini_batches=1" in caplog.text and "trainer.mini_batches > 1" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fgrpo"):
        warn_if_same_as_grpo(compose(f"algo={algo}", "trainer.mini_batches=4"))
        warn_if_same_as_grpo(compose("algo=grpo"))
    assert caplog.text == ""


def test_an_advantage_method_with_what_it_cannot_combine_with_is_refused(compose):
    with pytest.raises(ConfigError, match="focal.gamma=1.0: weights advantage=focal only: use advantage=focal, or "
                                          "focal.gamma=0 with advantage=maxrl"):
        validate(compose("advantage=maxrl", "focal.gamma=1.0"))
    with pytest.raises(ConfigError, match="algo.overlong_shaping=True: advantage=passk reads whether each sample is "
                                          "correct, not shaped rewards"):
        validate(compose("advantage=passk", "algo.overlong_shaping=true"))
    validate(compose("advantage=unlikeliness", "algo=dapo", "algo.overlong_shaping=true"))  # it reads the rewards
    validate(compose("advantage=focal", "focal=fgrpo", "algo=cispo"))
    validate(compose("algo.group_size=2"))  # advantage.k=4 is passk's alone
    # the step-size control scales GRPO by the focal weight's step mean: at gamma 0 it would be GRPO itself
    with pytest.raises(ConfigError, match="focal.gamma=0.0: must be > 0.0 .with advantage=mean_focal"):
        validate(compose("advantage=mean_focal", "focal.gamma=0"))
    assert compose("advantage=mean_focal").focal.gamma == 1.0  # F-GRPO's gamma unless the command line says
    validate(compose("advantage=mean_focal", "focal.gamma=0.5"))


def test_the_removed_std_normalize_key_is_now_advantage_dr_grpo(compose):
    with pytest.raises(ConfigCompositionException):
        compose("algo.std_normalize=false")
    assert compose("advantage=dr_grpo").advantage.name == "dr_grpo"


def test_the_sampler_defaults_to_auto_which_settles_to_what_is_installed(compose, monkeypatch):
    from fgrpo.rollout.samplers import settle_sampler, vllm_available

    cfg = compose()
    assert cfg.sampler.name == "auto"
    validate(cfg)  # a sweep's jobs are checked on the login node, unsettled: their nodes may differ
    settle_sampler(cfg)
    assert cfg.sampler.name == ("vllm" if vllm_available() else "hf")
    monkeypatch.setitem(sys.modules, "vllm", None)  # as a venv without vLLM: importlib finds nothing
    cfg = compose()
    settle_sampler(cfg)
    assert cfg.sampler.name == "hf"
    for named in ("vllm", "hf"):  # a named sampler is never replaced (sampler=vllm without vLLM: an error later)
        cfg = compose(f"sampler={named}")
        settle_sampler(cfg)
        assert cfg.sampler.name == named
    with pytest.raises(ConfigError, match=r"sampler.name='vlm': must be one of \('auto', 'vllm', 'hf'\)"):
        validate(compose("sampler.name=vlm"))


def test_the_learner_compiles_by_auto_for_runs_of_40_updates_or_more(compose):
    from fgrpo.learner.compiled_layers import COMPILE_AFTER_UPDATES, settle_compile

    assert COMPILE_AFTER_UPDATES == 40
    settled = {}
    for overrides in ((), ("trainer.steps=39",), ("trainer.steps=40",), ("trainer.steps=10", "trainer.mini_batches=4"),
                      ("trainer.steps=1000", "hardware.compile_learner=false"),
                      ("trainer.steps=2", "hardware.compile_learner=true")):
        cfg = compose(*overrides)
        validate(cfg)  # a sweep's jobs are checked unsettled
        settle_compile(cfg)
        validate(cfg)
        settled[overrides[0] if overrides else "default"] = cfg.hardware.compile_learner
    assert settled == {"default": False, "trainer.steps=39": False, "trainer.steps=40": True,
                       "trainer.steps=10": True, "trainer.steps=1000": False, "trainer.steps=2": True}
    assert compose("hardware=gpu").hardware.compile_learner is True  # a GPU compiles in seconds: always
    with pytest.raises(ConfigError, match=r"hardware.compile_learner='yes': must be true, false or auto"):
        validate(compose("hardware.compile_learner=yes"))
    # matmul outputs are kept only inside compiled layers: asked for in a run that auto leaves eager, refused
    cfg = compose("hardware.keep_matmul_outputs_gib=0.5")
    validate(cfg)
    settle_compile(cfg)
    with pytest.raises(ConfigError, match="hardware.keep_matmul_outputs_gib"):
        validate(cfg)
