"""LoRA (learner.lora_rank > 0, a job's model.lora_rank): a step on packed trees changes only the adapters (base
weights bit-identical, only adapters in the optimizer) for every algorithm; the merged export equals peft's own
merge_and_unload (and the merged model's logits the adapted model's); a checkpoint holds a peft adapter that
resumes; two FSDP2 ranks train the adapters like one process."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.algo.losses import LossConfig
from treepo_ray.engines.weights import view
from treepo_ray.learner import Learner, LearnerConfig, shard_trees
from treepo_ray.learner.checkpoint import ADAPTER_CONFIG, ADAPTER_FILE, MERGED_DIR, unreadable_reason
from treepo_ray.learner.export import export_packed
from treepo_ray.learner.strategy import FSDP2
from learner_testlib import random_train_trees, run_two_ranks

pytestmark = pytest.mark.slow

ALGORITHMS = ("grpo", "dapo", "treepo", "treerpo", "catpo")


def _config(algorithm: str = "treepo", **kw) -> LearnerConfig:
    aggregation = "node-mean" if algorithm in ("treerpo", "catpo") else "token-mean"
    return LearnerConfig(lr=1e-2, eps=1e-5, micro_batch_tokens=24, lora_rank=4, lora_alpha=8.0,
                         loss=LossConfig(aggregation=aggregation), **kw)


def _trees(algorithm: str = "treepo", seed: int = 3):
    return random_train_trees(np.random.default_rng(seed), algorithm, n=4, vocab=200)


def _named(learner) -> dict:
    return {k: v.detach().clone() for k, v in learner.model.named_parameters()}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_lora_step_on_packed_trees_changes_only_the_adapters(tiny, algorithm, one_torch_thread):
    learner = Learner(tiny, _config(algorithm, ppo_epochs=2))  # 2 epochs: the recompute pass runs too
    optimized = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    names = {id(p): n for n, p in learner.model.named_parameters()}
    assert optimized and all(".lora_A." in names[i] or ".lora_B." in names[i] for i in optimized)
    assert len(optimized) == sum(".lora_" in n for n in names.values())
    before = _named(learner)
    metrics = learner.train_step(_trees(algorithm))
    assert metrics["steps"] == 2 and np.isfinite(metrics["loss"])
    after = _named(learner)
    for name, value in before.items():
        if ".lora_" in name:
            continue
        assert torch.equal(after[name], value), name  # base weights bit-identical
    changed = [n for n in before if ".lora_B." in n and not torch.equal(after[n], before[n])]
    assert changed, "no adapter was trained"
    assert learner.trainable_parameters() < sum(v.numel() for v in before.values()) / 10


def test_merged_export_is_peft_merge_and_unload_and_checkpoint_round_trip(tiny, tmp_path, one_torch_thread):
    from peft import PeftModel

    learner = Learner(tiny, _config(save_merged=True))
    learner.train_step(_trees(seed=1))
    training_copy = _named(learner)
    exported = learner.export_weights()
    for name, value in _named(learner).items():  # exporting merges on copies
        assert torch.equal(value, training_copy[name])
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert exported.keys() == base.state_dict().keys()  # the base model's names, no adapter tensors

    # The packed export (what the engines load) holds the same tensors.
    packed = export_packed(learner.model, "float32", rank=0)
    data = torch.from_numpy(packed.buffer)
    for spec in packed.specs:
        torch.testing.assert_close(view(data, spec), exported[spec.name], atol=0, rtol=0)
    assert packed.nbytes == sum(v.numel() * 4 for v in exported.values())

    # The checkpoint's adapter is peft's: PeftModel loads it on the base model; its merge_and_unload is the export.
    ckpt = tmp_path / "checkpoint-00000001"
    learner.save_checkpoint(ckpt, {"step": 1})
    assert (ckpt / ADAPTER_FILE).is_file() and (ckpt / ADAPTER_CONFIG).is_file()
    assert not (ckpt / "model.safetensors").exists() and unreadable_reason(ckpt) is None
    peft_model = PeftModel.from_pretrained(base, ckpt).eval()
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7]])
    with torch.no_grad():
        adapted_logits = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()
        merged_state = merged.state_dict()
        for k, v in merged_state.items():
            torch.testing.assert_close(exported[k], v, atol=1e-6, rtol=1e-6)
        fresh = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        fresh.load_state_dict(exported)
        torch.testing.assert_close(fresh.eval()(input_ids=ids).logits, adapted_logits, atol=1e-5, rtol=1e-5)
    moved = [k for k in exported if not torch.equal(exported[k], AutoModelForCausalLM.from_pretrained(
        tiny, dtype=torch.float32).state_dict()[k])]
    assert moved, "the merged weights equal the base weights: nothing was trained"

    # The merged model saved on request is a model directory whose tree-packed log-probs are the LoRA learner's.
    full = Learner(ckpt / MERGED_DIR, LearnerConfig())
    batch = _trees(seed=5)
    for a, b in zip(full.compute_logprobs(batch), learner.compute_logprobs(batch)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, atol=1e-5)

    # Resume: a new LoRA learner loads the adapter and optimizer state and takes the same next step.
    resumed = Learner(tiny, _config(save_merged=True))
    assert resumed.load_checkpoint(ckpt) == {"step": 1}
    for name, value in _named(learner).items():
        assert torch.equal(_named(resumed)[name], value), name
    nxt = _trees(seed=2)
    a, b = resumed.train_step(nxt), learner.train_step(_trees(seed=2))
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7)
    for k, v in learner.export_weights().items():
        torch.testing.assert_close(resumed.export_weights()[k], v, atol=1e-6, rtol=0)
    # A full fine-tuning learner refuses the adapter checkpoint (and says why).
    with pytest.raises(ValueError, match="lora_rank"):
        Learner(tiny, LearnerConfig()).load_checkpoint(ckpt)


STEPS = 2


def _fsdp_worker(rank: int, port: int, model_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    learner = Learner(model_path, _config(), rank=rank, world_size=2, master_port=port)
    assert type(learner.strategy) is FSDP2
    metrics = [learner.train_step(shard_trees(_trees(seed=7 + s), rank, 2)) for s in range(STEPS)]
    weights = learner.export_weights()
    packed = export_packed(learner.model, "float32", rank)
    learner.save_checkpoint(f"{out_dir}/checkpoint-00000002", {"step": STEPS})
    if rank == 0:
        torch.save((metrics, weights, packed.specs, torch.from_numpy(packed.buffer).clone()), f"{out_dir}/lora.pt")
    else:
        assert weights == {} and packed is None
    learner.close()


def test_two_fsdp2_ranks_train_lora_like_one_process(tiny, tmp_path):
    run_two_ranks(_fsdp_worker, tiny, str(tmp_path))
    metrics, weights, specs, data = torch.load(tmp_path / "lora.pt", weights_only=False)
    single = Learner(tiny, _config())
    want = [single.train_step(_trees(seed=7 + s)) for s in range(STEPS)]
    for g, w in zip(metrics, want):
        for key in ("loss", "pg_loss", "grad_norm", "tokens"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), key
    reference = single.export_weights()
    assert weights.keys() == reference.keys()
    for k, v in reference.items():
        torch.testing.assert_close(weights[k], v, atol=1e-5, rtol=0)
    for spec in specs:
        torch.testing.assert_close(view(data, spec), reference[spec.name], atol=1e-5, rtol=0)
    # The adapter written by two ranks resumes in one process.
    resumed = Learner(tiny, _config())
    resumed.load_checkpoint(tmp_path / "checkpoint-00000002")
    for k, v in resumed.export_weights().items():
        torch.testing.assert_close(v, reference[k], atol=1e-5, rtol=0)


def test_lora_with_gradient_checkpointing_trains_the_adapters(tiny, one_torch_thread):
    learner = Learner(tiny, _config(gradient_checkpointing=True))
    before = _named(learner)
    learner.train_step(_trees())
    after = _named(learner)
    assert all(torch.equal(after[n], v) for n, v in before.items() if ".lora_" not in n)
    assert any(not torch.equal(after[n], v) for n, v in before.items() if ".lora_B." in n)
