"""The engine in one process (the inline backend, world size 1): contracts that need no launcher."""

from __future__ import annotations

import pytest
import torch

from podium import ClassWithInitArgs, DataProto, ResourcePool, WorkerGroup
from podium.engines.fsdp import EngineConfig, LMConfig, TrainingWorker, per_sample_uniforms

CFG = LMConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)


@pytest.fixture(scope="module")
def wg() -> WorkerGroup:
    config = EngineConfig(model=CFG, seed=2, lr=1e-2, kl_coef=0.1, micro_batch_size=3)
    group = WorkerGroup(
        ResourcePool([1], use_gpu=False),
        ClassWithInitArgs(TrainingWorker, config),
        backend="inline",
    )
    group.init_model()
    yield group
    group.shutdown()


def _prompts(index: torch.Tensor, step: int = 1) -> DataProto:
    prompts = torch.stack([torch.arange(4) + int(i) % 5 for i in index])
    return DataProto.from_dict(
        {"prompts": prompts, "sample_index": index}, meta_info={"step": step, "max_new_tokens": 6}
    )


def test_sampling_depends_on_the_sample_index_not_on_its_position_in_the_batch(
    wg: WorkerGroup,
) -> None:
    index = torch.arange(8)
    a = wg.generate(_prompts(index)).batch["responses"]
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    b = wg.generate(_prompts(index[perm])).batch["responses"]
    assert torch.equal(a[perm], b)
    c = wg.generate(_prompts(index, step=2)).batch["responses"]
    assert not torch.equal(a, c)  # another step, other random numbers
    assert a.shape == (8, 6) and int(a.max()) < 16


def test_per_sample_uniforms_are_fixed_by_seed_step_and_index() -> None:
    u = per_sample_uniforms(1, 2, torch.tensor([3, 4]), 5)
    assert torch.equal(u[1], per_sample_uniforms(1, 2, torch.tensor([4]), 5)[0])
    assert not torch.equal(u[0], per_sample_uniforms(1, 3, torch.tensor([3]), 5)[0])


def test_training_with_micro_batches_makes_rewarded_samples_more_likely(wg: WorkerGroup) -> None:
    # Reward responses for small tokens: advantages from a fixed batch.
    gen = wg.generate(_prompts(torch.arange(8)))
    ids, resp = gen.batch["input_ids"], gen.batch["responses"]
    ref = wg.compute_log_prob(DataProto.from_dict({"input_ids": ids, "responses": resp})).batch[
        "log_probs"
    ]
    adv = (resp < 8).float().mean(1)
    batch = DataProto.from_dict(
        {"input_ids": ids, "responses": resp, "advantages": adv - adv.mean(), "ref_log_probs": ref}
    )
    first = wg.train_batch(batch)[0]
    assert first["kl"] == 0.0 and first["tokens"] == 8 * 6 and first["grad_norm"] > 0
    for _ in range(3):
        last = wg.train_batch(batch)[0]
    assert last["kl"] > 0
    after = wg.compute_log_prob(DataProto.from_dict({"input_ids": ids, "responses": resp})).batch[
        "log_probs"
    ]
    weights = (adv - adv.mean())[:, None]
    assert float((after * weights).sum()) > float((ref * weights).sum())  # good samples more likely


def test_micro_batches_give_the_gradient_of_the_whole_batch(wg: WorkerGroup) -> None:
    gen = wg.generate(_prompts(torch.arange(8), step=7))
    adv = (gen.batch["responses"] < 8).float().mean(1)
    batch = DataProto.from_dict(
        {
            "input_ids": gen.batch["input_ids"],
            "responses": gen.batch["responses"],
            "advantages": adv - adv.mean(),
        }
    )
    norms = []
    for micro in (None, 3):
        config = EngineConfig(model=CFG, seed=4, micro_batch_size=micro)
        with WorkerGroup(
            ResourcePool([1], use_gpu=False),
            ClassWithInitArgs(TrainingWorker, config),
            backend="inline",
        ) as other:
            other.init_model()
            norms.append(other.train_batch(batch)[0]["grad_norm"])
    assert norms[0] > 0
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_bad_input_is_a_clear_error(wg: WorkerGroup) -> None:
    with pytest.raises(KeyError, match="advantages"):
        wg.train_batch(
            DataProto.from_dict(
                {"input_ids": torch.zeros(2, 4, dtype=torch.long), "responses": torch.zeros(2, 2)}
            )
        )
    with pytest.raises(KeyError, match="max_new_tokens"):
        wg.generate(
            DataProto.from_dict(
                {"prompts": torch.zeros(2, 3, dtype=torch.long), "sample_index": torch.arange(2)},
                meta_info={"step": 0},
            )
        )
    with pytest.raises(ValueError, match="d_model 30 must be a multiple of n_heads 4"):
        LMConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="tp=3 must divide the model's n_heads=4"):
        EngineConfig(model=LMConfig(n_heads=4), tp=3)
    with pytest.raises(ValueError, match="micro_batch_size"):
        EngineConfig(micro_batch_size=0)


def test_a_hugging_face_causal_lm_from_a_local_config_trains() -> None:
    pytest.importorskip("transformers")
    from podium.engines.fsdp import HFCausalLM

    factory = HFCausalLM(
        "llama",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    config = EngineConfig(model_factory=factory, seed=0, lr=1e-2)
    with WorkerGroup(
        ResourcePool([1], use_gpu=False),
        ClassWithInitArgs(TrainingWorker, config),
        backend="inline",
    ) as hf:
        hf.init_model()
        gen = hf.generate(_prompts(torch.arange(4)))
        ids, resp = gen.batch["input_ids"], gen.batch["responses"]
        before = hf.compute_log_prob(DataProto.from_dict({"input_ids": ids, "responses": resp}))
        adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
        metrics = hf.train_batch(
            DataProto.from_dict({"input_ids": ids, "responses": resp, "advantages": adv})
        )[0]
        after = hf.compute_log_prob(DataProto.from_dict({"input_ids": ids, "responses": resp}))
    assert resp.shape == (4, 6) and metrics["grad_norm"] > 0
    moved = (after.batch["log_probs"] - before.batch["log_probs"]).sum(1)
    assert float((moved * adv).sum()) > 0  # rewarded samples became more likely
