"""Flex attention over packed rows (hardware.attention=flex, the GPU's learner kernel) against the dense masked
attention and the padded learner it replaces. On the CPU torch's flex_attention has no backward: there the forward
is the real flex kernel and the gradients come from the same block mask materialised (fgrpo.learner.flex_attention); the
tests marked ``gpu`` run the Triton kernel, compiled, forward and backward."""

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from fgrpo.learner.flex_attention import BLOCK, FLEX_ATTENTION, block_mask, flex_segment_attention, slot_labels
from fgrpo.learner.packing import lay_out_rows, micro_batches
from test_devices import update_on
from test_segment_attention import assert_without_inputs_it_is, groups_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


def attention_pair(device, dtype, seed=2):
    """A one-row shared-prompt layout padded for flex, the same without padding with its dense mask, and q, k, v."""
    seqs = groups_of(prompts=3, samples=4, seed=seed)
    rows = [list(range(len(seqs)))]
    dense = lay_out_rows(seqs, rows, 0, device, share_prompts=True)
    flex = lay_out_rows(seqs, rows, 0, device, share_prompts=True, dense_mask=False, width_multiple=BLOCK)
    gen = torch.Generator().manual_seed(seed)
    width = flex.input_ids.shape[1]
    # head dim 16: the smallest flex_attention's Triton kernels take
    q, k, v = (torch.randn(1, h, width, 16, generator=gen).to(device, dtype).requires_grad_() for h in (4, 2, 2))
    return dense, flex, (q, k, v)


def module_of(groups=2):
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = groups, True
    return module


@pytest.fixture(scope="module")
def flex_model():
    """The tiny test Llama with a head dim of 16 (the conftest's has 8, under what flex's CUDA kernels take)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(config).float()


def test_rows_are_padded_to_whole_tiles_and_labelled():
    dense, flex, _ = attention_pair("cpu", torch.float32)
    real = dense.input_ids.shape[1]
    assert flex.input_ids.shape == (1, BLOCK) and real < BLOCK
    assert torch.equal(flex.input_ids[:, :real], dense.input_ids) and not flex.input_ids[:, real:].any()
    labels = slot_labels(flex.unit_of, flex.completion_of)[0]
    prompt_slots = sum(len(s.prompt_ids) for s in groups_of(prompts=3, samples=4, seed=2)[::4])
    assert labels.shape == (2, BLOCK) and labels.dtype == torch.int32
    assert len(set(labels[0, real:].tolist())) == BLOCK - real  # each padding slot a unit of its own
    assert (labels[1, :real] == -1).sum() == prompt_slots and (labels[1, real:] == -1).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        block_mask(labels[None, :, :100])


def test_one_row_micro_batches_count_the_padding_to_whole_tiles():
    seqs = groups_of(prompts=3, samples=4, seed=1)
    plain = micro_batches(seqs, size=4, tokens=60, share_prompts=True, one_row=True)
    tiled = micro_batches(seqs, size=4, tokens=60, share_prompts=True, one_row=True, row_multiple=BLOCK)
    assert [m.real_tokens for m in tiled] == [m.real_tokens for m in plain]
    assert all(m.padded_tokens == BLOCK for m in tiled) and all(m.padded_tokens == m.real_tokens for m in plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_flex_attention_gives_the_dense_masked_outputs_and_gradients(device, dtype, atol):
    dense_layout, flex_layout, (q, k, v) = attention_pair(device, dtype)
    real = dense_layout.input_ids.shape[1]
    additive = torch.zeros(dense_layout.allowed.shape, dtype=dtype, device=device).masked_fill(
        ~dense_layout.allowed, torch.finfo(dtype).min)
    dense, _ = eager_attention_forward(module_of(), q[:, :, :real], k[:, :, :real], v[:, :, :real], additive,
                                       scaling=16**-0.5)
    mask = block_mask(slot_labels(flex_layout.unit_of, flex_layout.completion_of).to(device))
    ours, weights = flex_segment_attention(module_of(), q, k, v, None, scaling=16**-0.5, flex_block_mask=mask)
    assert weights is None and ours.shape == (1, BLOCK, 4, 16)
    torch.testing.assert_close(ours[:, :real].float(), dense.float(), atol=atol, rtol=atol)
    with torch.no_grad():  # on the CPU: torch's own flex_attention (it has no backward there)
        kernel, _ = flex_segment_attention(module_of(), q, k, v, None, scaling=16**-0.5, flex_block_mask=mask)
    torch.testing.assert_close(kernel[:, :real].float(), dense.float(), atol=atol, rtol=atol)
    gen = torch.Generator().manual_seed(5)
    upstream = torch.randn(dense.shape, generator=gen).to(device, dtype)
    grads_dense = torch.autograd.grad(dense, (q, k, v), upstream)  # q, k, v padded: zeros there
    padded_upstream = torch.cat([upstream, upstream.new_zeros(1, BLOCK - real, 4, 16)], dim=1)
    grads_ours = torch.autograd.grad(ours, (q, k, v), padded_upstream)
    for ours_grad, dense_grad in zip(grads_ours, grads_dense):
        assert not ours_grad[:, :, real:].any()  # nothing flows into the padding
        torch.testing.assert_close(ours_grad.float(), dense_grad.float(), atol=atol * 10, rtol=atol * 10)


def test_without_a_block_mask_it_is_sdpa_attention(tiny_model):
    """Generation (sampler=hf) and plain forwards pass no block mask: transformers' sdpa attention."""
    assert_without_inputs_it_is(tiny_model, FLEX_ATTENTION, "sdpa")


def test_packed_flex_update_equals_the_padded_update_on_cpu(flex_model):
    """The whole learner step: one packed row per micro-batch, prompts shared, rows padded to whole tiles (flex's
    layout, its block mask materialised for the CPU's backward) against the padded sdpa path, fp32."""
    padded_metrics, padded_grads = update_on("cpu", flex_model, attention="sdpa")
    flex_metrics, flex_grads = update_on("cpu", flex_model, attention=FLEX_ATTENTION, micro_batch_tokens=40,
                                         share_prompts=True)
    assert flex_metrics["loss"] == pytest.approx(padded_metrics["loss"], abs=1e-6)
    assert flex_metrics["computed_tokens"] < padded_metrics["computed_tokens"]  # each prompt once, not 4 times
    assert flex_metrics["padding_frac"] > 0  # rows rounded up to whole tiles of 128
    for name, want in padded_grads.items():
        torch.testing.assert_close(flex_grads[name], want, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kept_matmul_bytes", [0, 2**20])
def test_gpu_defaults_learner_on_cuda_matches_the_padded_cpu_fp32_update(flex_model, kept_matmul_bytes):
    """What hardware=gpu runs (flex attention, packed rows, shared prompts, compiled checkpointed layers, bf16)
    against today's padded path on the CPU in fp32."""
    cpu_metrics, cpu_grads = update_on("cpu", flex_model, attention="sdpa")
    gpu_metrics, gpu_grads = update_on("cuda", flex_model, autocast_dtype=torch.bfloat16, attention=FLEX_ATTENTION,
                                       compiled=True, micro_batch_tokens=40, share_prompts=True,
                                       kept_matmul_bytes=kept_matmul_bytes)
    assert gpu_metrics["loss"] == pytest.approx(cpu_metrics["loss"], abs=2e-3)
    for name, want in cpu_grads.items():
        assert (gpu_grads[name] - want).norm() <= 0.03 * want.norm() + 1e-9, name


def test_flex_for_a_model_it_cannot_run_is_refused_before_the_weights_load(tmp_path, tiny_model):
    from transformers import MistralConfig

    from fgrpo.infra.errors import ConfigError
    from fgrpo.learner.model import load_policy

    tiny_model.config.save_pretrained(tmp_path / "narrow")  # head dim 8
    with pytest.raises(ConfigError, match="head dimension of at least 16.*hardware.attention=sdpa"):
        load_policy(tmp_path / "narrow", dtype="float32", device="cpu", attention="flex")
    MistralConfig(hidden_size=64, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=16).save_pretrained(tmp_path / "mistral")
    with pytest.raises(ConfigError, match="hardware.attention=flex supports llama, qwen2, qwen3"):
        load_policy(tmp_path / "mistral", dtype="float32", device="cpu", attention="flex")


def test_flex_on_the_cpu_or_an_unfit_gpu_is_refused_before_loading(compose, monkeypatch):
    from fgrpo import prepare as setup
    from fgrpo.learner import flex_attention
    from fgrpo.validation import validate
    from fgrpo.infra.errors import ConfigError
    from fgrpo.prepare import prepare

    with pytest.raises(ConfigError, match="hardware.attention='flex'.*hardware.attention=segments"):
        validate(compose("hardware=cpu", "hardware.attention=flex"))
    with pytest.raises(ConfigError, match="attends within packed rows: set hardware.micro_batch_tokens"):
        validate(compose("hardware=gpu", "hardware.micro_batch_tokens=null"))
    validate(compose("hardware=gpu"))  # the GPU defaults: flex, checked against the machine at start
    assert torch.cuda.is_available() or "no CUDA device" in flex_attention.flex_available("cuda")
    monkeypatch.setattr(setup, "flex_available", lambda device: "Triton is not installed")
    with pytest.raises(ConfigError, match="Triton is not installed.*hardware.attention=sdpa"):
        setup.require_flex("cuda")
    if not torch.cuda.is_available():  # a run stops at the device check, before the model loads
        with pytest.raises(ConfigError, match="no CUDA device"):
            prepare(compose("hardware=gpu", "model=tiny_random", "sampler=hf", "logger=none"))


def test_block_mask_tiles_equal_torchs_own_construction(monkeypatch):
    """Ours classifies tiles a band at a time; torch's create_block_mask from the same mask over the whole square.
    Several bands (a small chunk) and several rows, with a row of one long segment and tiles full, partial, empty."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fgrpo.learner import flex_attention

    seqs = groups_of(prompts=4, samples=8, seed=4) + groups_of(prompts=1, samples=2, seed=9)
    for seq in seqs[-2:]:
        seq.completion_ids = seq.completion_ids * 40  # a long completion: full tiles inside it
    layout = lay_out_rows(seqs, [list(range(32)), list(range(32, 34))], 0, "cpu", share_prompts=True,
                          dense_mask=False, width_multiple=BLOCK)
    labels = slot_labels(layout.unit_of, layout.completion_of)
    monkeypatch.setattr(flex_attention, "PAIRS_PER_CHUNK", BLOCK * labels.shape[2])  # one query tile per band
    ours = block_mask(labels)
    theirs = create_block_mask(flex_attention._allowed_pairs(labels), B=labels.shape[0], H=None,
                               Q_LEN=labels.shape[2], KV_LEN=labels.shape[2], device="cpu", BLOCK_SIZE=BLOCK)
    assert labels.shape[2] >= 4 * BLOCK
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.full_kv_num_blocks.sum() > 0 and ours.kv_num_blocks.sum() > 0
    full, partial = ours.full_kv_num_blocks.sum(), ours.kv_num_blocks.sum()
    assert (full, partial) == (theirs.full_kv_num_blocks.sum(), theirs.kv_num_blocks.sum())


def test_an_offloaded_learner_computes_on_its_meshs_device():
    """FSDP2 with CPU offload keeps the parameters in CPU memory between uses, as DTensors whose mesh is on the GPU:
    the learner's inputs (and the block mask) go to the mesh's device, not the parameters'."""
    from types import SimpleNamespace

    from fgrpo.learner.forward import compute_device

    model = torch.nn.Linear(2, 2)
    assert compute_device(model) == torch.device("cpu")
    model.weight.device_mesh = SimpleNamespace(device_type="cpu")  # a sharded learner not offloaded: the same
    assert compute_device(model) == torch.device("cpu")
    model.weight.device_mesh = SimpleNamespace(device_type="meta")  # offloaded: the mesh's device (meta: CPU-testable)
    assert compute_device(model) == torch.device("meta")


def test_flex_attention_falling_back_to_eager_on_a_wide_row_is_an_error_naming_the_setting():
    """Where torch.compile gives up on flex_attention it runs it as plain Python, which builds the whole [W, W]
    score matrix: on a wide row that is an error naming hardware.micro_batch_tokens, not a silent out-of-memory.
    The ``force_eager`` stance is dynamo giving up on every call, as its recompile limit or a graph break does."""
    from fgrpo.learner.flex_attention import EAGER_FLEX_MAX_SLOTS, EagerFlexAttention, _compiled_flex

    width = 2 * EAGER_FLEX_MAX_SLOTS
    labels = torch.stack([torch.arange(width) // 256, torch.full((width,), -1)])[None].to(torch.int32)
    q, k, v = (torch.randn(1, h, width, 16) for h in (4, 2, 2))
    with torch.compiler.set_stance("force_eager"), pytest.raises(
            EagerFlexAttention, match=r"uncompiled over a packed row of 4096 slots.*hardware.micro_batch_tokens"):
        _compiled_flex()(q, k, v, block_mask(labels), 0.25)
    # a row within the bound runs uncompiled (the CPU's forward): what the tests above compare
    narrow = labels[..., :EAGER_FLEX_MAX_SLOTS]
    with torch.compiler.set_stance("force_eager"):
        out = _compiled_flex()(q[:, :, :EAGER_FLEX_MAX_SLOTS], k[:, :, :EAGER_FLEX_MAX_SLOTS],
                               v[:, :, :EAGER_FLEX_MAX_SLOTS], block_mask(narrow), 0.25)
    assert out.shape == (1, 4, EAGER_FLEX_MAX_SLOTS, 16) and torch.isfinite(out).all()
