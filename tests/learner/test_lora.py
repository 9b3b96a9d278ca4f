"""LoRA adapters on the policy (fgrpo.learner.lora, model.lora): what is trained, the merged weights the sampler gets,
the base as the KL reference, the same loss path as full fine-tuning, compiled layers, the Learner and its config."""

import copy

import pytest
import torch

from fgrpo.infra.errors import ConfigError
from fgrpo.learner.lora import LoraSettings, adapters_disabled, apply_lora, linear_layer_names, sampler_weights
from learner_cases import algo, make_seqs, update_grads

LLAMA_LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def with_lora(model, rank=4, targets=None, alpha=8.0):
    model = copy.deepcopy(model)
    trained = apply_lora(model, LoraSettings(rank=rank, alpha=alpha, dropout=0.0, target_modules=targets))
    return model, trained


def perturb_adapters(model, seed=0):
    """peft starts B at zero (the adapters add nothing): random B so that they do."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def test_only_the_adapters_train_in_fp32_on_every_projection(tiny_model):
    assert linear_layer_names(tiny_model) == LLAMA_LINEARS  # the LM head is not a target
    model, trained = with_lora(copy.deepcopy(tiny_model).to(torch.bfloat16))
    config = tiny_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    shapes = {"q_proj": (32, 32), "k_proj": (32, 2 * head_dim), "v_proj": (32, 2 * head_dim), "o_proj": (32, 32),
              "gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}  # (in, out)
    assert trained == config.num_hidden_layers * sum(4 * (i + o) for i, o in shapes.values())
    for name, param in model.named_parameters():
        adapter = ".lora_A." in name or ".lora_B." in name
        assert param.requires_grad == adapter, name
        assert param.dtype == (torch.float32 if adapter else torch.bfloat16), name


def test_target_modules_that_match_nothing_list_the_linear_layers(tiny_model):
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['q_proj', 'qkv'\]: \['qkv'\] match no linear "
                                          r"layer of this model; its linear layers are \['down_proj', 'gate_proj'"):
        with_lora(tiny_model, targets=("q_proj", "qkv"))
    model, trained = with_lora(tiny_model, targets=("q_proj", "v_proj"))
    assert trained == 2 * (4 * (32 + 32) + 4 * (32 + 16))


def test_the_sampler_gets_merged_weights_under_the_base_names_and_the_base_stays(tiny_model):
    model, _ = with_lora(tiny_model)
    perturb_adapters(model)
    base = {name: tensor.clone() for name, tensor in tiny_model.state_dict().items()}
    merged = dict(sampler_weights(model))
    assert merged.keys() == base.keys()
    plain = copy.deepcopy(tiny_model)
    plain.load_state_dict(merged)
    ids = torch.tensor([[3, 9, 27, 81, 5, 7]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
        changed = [n for n in base if not torch.equal(merged[n], base[n])]
        assert changed and all("proj" in n for n in changed)
        # merged out of place: the learner's base weights are the loaded ones still
        for name, tensor in model.state_dict().items():
            if ".base_layer." in name:
                assert torch.equal(tensor, base[name.replace(".base_layer.", ".")]), name
    assert dict(sampler_weights(tiny_model)).keys() == base.keys()  # without adapters: the state dict as it is
    # in the sampler's dtype: the merged fp32 weights cast, and a skipped name neither computed nor yielded
    in_bf16 = dict(sampler_weights(model, dtype=torch.bfloat16, skip=frozenset({"lm_head.weight"})))
    assert in_bf16.keys() == merged.keys() - {"lm_head.weight"}
    assert all(torch.equal(tensor, merged[name].to(torch.bfloat16)) for name, tensor in in_bf16.items())


def test_adapters_off_is_the_base_model(tiny_model):
    model, _ = with_lora(tiny_model)
    perturb_adapters(model)
    ids = torch.tensor([[3, 9, 27, 81, 5, 7]])
    with torch.no_grad():
        with adapters_disabled(model):
            torch.testing.assert_close(model(ids).logits, tiny_model(ids).logits, atol=0, rtol=0)
        assert not torch.allclose(model(ids).logits, tiny_model(ids).logits)  # on again after


def test_fgrpo_loss_is_the_same_code_path_with_adapters(tiny_model):
    """At the start (B = 0) the adapted policy is the base: its loss and metrics are full fine-tuning's, through the
    same update_policy and policy_loss; only the adapters get gradients, and the base's gradient reaches them."""
    model, _ = with_lora(tiny_model)
    seqs = make_seqs(seed=11, count=8)
    lora_metrics, lora_grads = _grads(model, seqs)
    full_metrics, _ = update_grads(copy.deepcopy(tiny_model), seqs)
    for key in ("loss", "entropy", "ratio_mean"):
        assert lora_metrics[key] == pytest.approx(full_metrics[key], abs=1e-6), key
    assert lora_grads and all(".lora_" in name for name in lora_grads)
    assert any(g.abs().sum() > 0 for n, g in lora_grads.items() if ".lora_B." in n)  # B learns first (A is random)


def _grads(model, seqs):
    from fgrpo.learner.step import update_policy

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    metrics = update_policy(model, optimizer, seqs, loss=algo("dapo"), pad_id=0, temperature=0.8, micro_batch_size=4,
                            grad_clip=1e9, max_new_tokens=8)
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_kl_reference_is_the_base_with_the_adapters_off(tiny_model):
    """kl_coef > 0 and no reference model: the KL term is against the policy's base (adapters off), which at a
    perturbed adapter differs from the policy, so kl_ref > 0; with a reference copy of the base it is the same."""
    import dataclasses

    from fgrpo.learner.step import update_policy

    model, _ = with_lora(tiny_model)
    perturb_adapters(model)
    seqs = make_seqs(seed=12, count=6)
    loss = dataclasses.replace(algo("grpo"), kl_coef=0.1)
    common = dict(loss=loss, pad_id=0, temperature=1.0, micro_batch_size=3, grad_clip=1e9, max_new_tokens=8)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    own = update_policy(model, optimizer, seqs, **common)
    copied = update_policy(model, optimizer, seqs, ref_model=copy.deepcopy(tiny_model).eval(), **common)
    assert own["kl_ref"] > 0
    assert own["kl_ref"] == pytest.approx(copied["kl_ref"], rel=1e-6)


def test_compiled_layers_with_adapters_compile_and_give_the_eager_gradients(tiny_model):
    from torch._dynamo.utils import counters

    from fgrpo.learner.compiled_layers import compile_decoder_layers

    eager, _ = with_lora(tiny_model)
    perturb_adapters(eager)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    assert compile_decoder_layers(compiled) == 2
    frames = counters["frames"]["ok"]
    seqs = make_seqs(seed=13, count=7)
    (m1, g1), (m2, g2) = _grads(compiled, seqs), _grads(eager, seqs)
    assert counters["frames"]["ok"] > frames, "the layers with adapters ran eager"
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-5)
    for name in g2:
        assert (g1[name] - g2[name]).norm() <= 1e-4 * g2[name].norm() + 1e-9, name


def test_learner_trains_adapters_pushes_merged_weights_and_round_trips(compose):
    from fgrpo.rollout.samplers import HFSampler
    from test_learner import make_learner as make_lora_learner

    learner = make_lora_learner(compose, "model.lora.rank=4", "algo.entropy_coef=0.01", "trainer.lr=1e-2")
    trained = {n for n, p in learner.policy.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert sum(len(group["params"]) for group in learner.optimizer.param_groups) == len(trained)
    before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
    learner.update(make_seqs(seed=1, count=8))
    moved = {n for n, p in learner.policy.named_parameters() if not torch.equal(p, before[n])}
    assert moved == trained

    target = make_lora_learner(compose).policy  # a plain policy as the sampler's model
    sampler = HFSampler(target, tokenizer=None)
    learner.push_weights(sampler)
    for name, tensor in dict(sampler_weights(learner.policy)).items():
        torch.testing.assert_close(sampler.model.state_dict()[name], tensor, rtol=0, atol=0, msg=name)

    resumed = make_lora_learner(compose, "model.lora.rank=4", "algo.entropy_coef=0.01", "trainer.lr=1e-2")
    resumed.load_state_dict(copy.deepcopy(learner.state_dict()))
    seqs = make_seqs(seed=2, count=8)
    learner.update(seqs)
    resumed.update(seqs)
    for (name, a), b in zip(learner.policy.state_dict().items(), resumed.policy.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("override, message", [
    ("model.lora.rank=0", r"model.lora.rank=0: must be >= 1 \(e.g. 16\), or null to train every weight"),
    ("model.lora.alpha=-1", r"model.lora.alpha=-1.0: must be > 0"),
    ("model.lora.dropout=1.0", r"model.lora.dropout=1.0: must be in \[0, 1\)"),
    ("model.lora.target_modules=[]", r"model.lora.target_modules=\[\]: must be a non-empty list"),
])
def test_bad_lora_settings_are_refused_before_the_model_loads(compose, override, message):
    from fgrpo.validation import validate

    with pytest.raises(ConfigError, match=message):
        validate(compose("model.lora.rank=8", override))


def test_a_resume_that_mixes_lora_and_full_weights_is_refused(compose):
    from fgrpo.config import experiment_differences, to_container

    full, lora = to_container(compose()), to_container(compose("model.lora.rank=8"))
    # the unset lr is each one's default: they differ too (a saved unset lr without LoRA is the 1e-5 it meant then)
    assert experiment_differences(full, lora) == ["model.lora.rank: None -> 8", "trainer.lr: 1e-05 -> 0.0002"]
    assert experiment_differences(lora, full) == ["model.lora.rank: 8 -> None", "trainer.lr: 0.0002 -> 3e-05"]
    before_lora = copy.deepcopy(full)
    del before_lora["model"]["lora"]  # a checkpoint written before model.lora existed
    assert experiment_differences(before_lora, lora)[0] == "model.lora.rank: <absent: every weight trained> -> 8"
    assert experiment_differences(before_lora, to_container(compose("trainer.lr=1e-5"))) == []


def test_an_unset_lr_is_the_default_for_what_trains_and_a_set_one_wins(compose):
    from fgrpo.config import DEFAULT_LORA_LR, DEFAULT_LR, experiment_differences, to_container
    from fgrpo.prepare import learner_settings

    assert DEFAULT_LORA_LR > DEFAULT_LR
    assert learner_settings(compose()).lr == DEFAULT_LR
    assert learner_settings(compose("model.lora.rank=16")).lr == DEFAULT_LORA_LR
    assert learner_settings(compose("model.lora.rank=16", "trainer.lr=3e-5")).lr == 3e-5
    # a run saves the lr it resolved; one saved with lr unset before 2026-12-01 ran at 1e-5, today's unset lr is 3e-5
    saved = to_container(compose("trainer.lr=3e-5"))
    assert experiment_differences(saved, to_container(compose())) == []
    assert experiment_differences(saved, to_container(compose("trainer.lr=1e-5"))) == ["trainer.lr: 3e-05 -> 1e-05"]
    unset_then = to_container(compose())
    assert unset_then["trainer"]["lr"] is None
    assert experiment_differences(unset_then, to_container(compose())) == ["trainer.lr: 1e-05 -> 3e-05"]
    assert experiment_differences(unset_then, to_container(compose("trainer.lr=1e-5"))) == []
    lora_then = to_container(compose("model.lora.rank=16"))  # the LoRA default has not moved
    assert experiment_differences(lora_then, to_container(compose("model.lora.rank=16"))) == []


def test_a_checkpoint_holds_the_adapters_and_their_moments_alone_and_loads_bitwise(tiny_model, tmp_path):
    from fgrpo.infra import checkpoint
    from fgrpo.learner.step import update_policy

    model, trained = with_lora(tiny_model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    update_policy(model, optimizer, make_seqs(seed=14, count=6), loss=algo("dapo"), pad_id=0, temperature=1.0,
                  micro_batch_size=3, grad_clip=1e9, max_new_tokens=8)
    state = checkpoint.TrainerState(step=1, stream={"epoch": 1, "cursor": 6}, scheduler={"last_epoch": 1})
    path = checkpoint.save_checkpoint(tmp_path, model, optimizer, state, keep=1)
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path / checkpoint.WEIGHTS)).read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("model.")]
    assert weights and all(".lora_" in key for key in weights), [k for k in weights if ".lora_" not in k]
    assert sum(saved[key].size.numel() for key in weights) == trained

    other, _ = with_lora(tiny_model)  # the base from the same weights, fresh adapters
    other_optimizer = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    checkpoint.load_checkpoint(path, other, other_optimizer)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    def moments(opt):
        return [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]

    assert len(moments(other_optimizer)) == 2 * len(other_optimizer.param_groups[0]["params"])
    assert all(torch.equal(a, b) for a, b in zip(moments(optimizer), moments(other_optimizer), strict=True))
    assert any(m.abs().sum() > 0 for m in moments(other_optimizer))  # B's moved (A's gradient is 0 while B is)


def test_a_bf16_base_trains_fp32_adapters(tiny_model):
    """hardware.learner_dtype=bfloat16 with LoRA (allowed: the base is frozen): the adapters stay fp32, get fp32
    gradients and move; the merged weights for the sampler are bf16 like the base."""
    from fgrpo.learner.step import update_policy

    model, _ = with_lora(copy.deepcopy(tiny_model).to(torch.bfloat16))
    trained = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    update_policy(model, optimizer, make_seqs(seed=15, count=6), loss=algo("dapo"), pad_id=0, temperature=1.0,
                  micro_batch_size=3, grad_clip=1e9, max_new_tokens=8, autocast_dtype=torch.bfloat16)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trained)
    assert any(not torch.equal(p, b) for p, b in zip(trained, before))
    assert all(t.dtype == torch.bfloat16 for _, t in sampler_weights(model))


def test_bf16_base_weights_are_allowed_with_lora_only(compose):
    from fgrpo.validation import validate

    with pytest.raises(ConfigError, match="hardware.learner_dtype='bfloat16'"):
        validate(compose("hardware.learner_dtype=bfloat16", "trainer.lr=1e-6"))
    validate(compose("hardware.learner_dtype=bfloat16", "trainer.lr=1e-6", "model.lora.rank=16"))
