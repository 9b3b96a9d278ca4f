"""Each rank loads its share (fgrpo.learner.sharded_load): on 2 gloo ranks, rank 1 builds the model on the meta device
and takes its shards and buffers from rank 0, and the learner it makes steps exactly as the one every rank loads whole
(tests/children/sharded_load.py builds both, from one model folder, and runs one update on the same batch)."""

import pytest
import torch

from sharded_load import CASES
from test_sharded import CHILDREN, torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("sharded_load")
    done = torchrun(2, CHILDREN / "sharded_load.py", ",".join(CASES), str(out_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return {case: torch.load(out_dir / f"{case}.pt", weights_only=False) for case in CASES}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    unequal = [name for name in a if not torch.equal(a[name], b[name])]
    assert not unequal, unequal


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_built_on_the_meta_device_updates_as_one_that_loaded_the_whole_model(results, case):
    new, old = results[case]["from rank 0"], results[case]["each rank whole"]
    loads = 2 if CASES[case].get("kl") and not CASES[case].get("lora") else 1  # the policy, and a KL reference model
    assert new["empties"] == [[False] * loads, [True] * loads]  # rank 0 read the weights, rank 1 built on meta
    assert old["empties"] == [[False] * loads, [False] * loads]
    assert_equal(new["loaded"], old["loaded"])  # every weight, LoRA's adapters too, as rank 0 read them
    assert_equal(new["updated"], old["updated"])  # bit for bit after the update
    assert new["metrics"] == old["metrics"]
    assert any(not torch.equal(new["loaded"][n], new["updated"][n]) for n in new["loaded"])  # the update moved them
    if new["reference"] is not None:
        assert_equal(new["reference"], old["reference"])
    # what a state dict does not carry: the rotary inv_freq (non-persistent) and the tie of the LM head
    rank0, rank1 = new["rank_buffers"]
    assert "model.rotary_emb.inv_freq" in rank0
    assert_equal(rank1, rank0)
    assert new["tied"] == [CASES[case]["tie"]] * 2
    assert new["generation_eos"] == [2, 2]  # the folder's generation config (the HF sampler's stop token)


def test_a_build_that_fails_or_differs_on_one_rank_stops_both_with_its_error(tmp_path):
    done = torchrun(2, CHILDREN / "sharded_load.py", "faults", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for fault in ("rank0-fails", "differs"):
        errors = [torch.load(tmp_path / f"{fault}-{rank}.pt", weights_only=False) for rank in (0, 1)]
        assert errors[0]["error"] is not None and errors[0]["error"] == errors[1]["error"], errors
        # at once, not after the process group's 60 s timeout in a broadcast that never comes
        assert all(e["seconds"] < 30 for e in errors), errors
    name, message = torch.load(tmp_path / "rank0-fails-1.pt", weights_only=False)["error"]
    assert "model.safetensors" in message or "Safetensor" in name + message, (name, message)  # rank 0's read
    name, message = torch.load(tmp_path / "differs-0.pt", weights_only=False)["error"]
    assert name == "ModelSourceError"
    assert "rank 1 built the model of" in message and "model-differs" in message
    assert "is model.rotary_emb.inv_freq (4,) float64 here and model.rotary_emb.inv_freq (4,) float32 on rank 0" in message
