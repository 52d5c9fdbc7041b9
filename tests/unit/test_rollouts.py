import torch

from grpo_lightning.algorithm.rollouts import collate_rollouts, position_ids_from_mask
from grpo_lightning.types import Rollout


def _rollout(prompt, completion, group_id=0, branch_point=0, reward=1.0, advantage=0.5):
    return Rollout(
        prompt_ids=prompt,
        completion_ids=completion,
        gen_logprobs=[-0.1 * (i + 1) for i in range(len(completion))],
        reward=reward,
        group_id=group_id,
        truncated=False,
        advantage=advantage,
        branch_point=branch_point,
    )


def test_collate_left_pads_prompts_and_right_pads_completions():
    batch = collate_rollouts(
        [_rollout([5, 6, 7], [8, 9]), _rollout([3], [4, 2, 1], group_id=1, branch_point=1, advantage=-0.5)],
        pad_token_id=0,
    )
    # Written by hand: P = 3, C = 3.
    assert batch.prompt_len == 3
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 3, 4, 2, 1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.completion_ids.tolist() == [[8, 9, 0], [4, 2, 1]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [0, 1, 1]]  # branch point 1 masks the first token
    assert batch.sequence_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert torch.allclose(batch.gen_logprobs, torch.tensor([[-0.1, -0.2, 0.0], [-0.1, -0.2, -0.3]]))
    assert batch.advantages.tolist() == [0.5, -0.5]
    assert batch.group_ids.tolist() == [0, 1]
    assert batch.branch_points.tolist() == [0, 1]
    assert batch.old_logprobs is None


def test_position_ids_count_only_real_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_to_moves_every_tensor_and_keeps_scalars():
    batch = collate_rollouts([_rollout([1, 2], [3])], pad_token_id=0)
    moved = batch.to("cpu")
    assert moved.prompt_len == batch.prompt_len
    assert torch.equal(moved.input_ids, batch.input_ids)
