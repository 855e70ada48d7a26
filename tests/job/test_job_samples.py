"""samples.jsonl (job/logs.py answer_samples): what the model wrote, as text, from the logged tree records (no Ray)."""

from treepo_ray.job.logs import answer_samples
from treepo_ray.tree import Tree


def test_each_answer_is_the_text_of_its_path_with_its_reward_and_finish():
    t = Tree(prompt_ids=[1, 2], query_id="gsm8k#7")
    a = t.add_node(0, [3, 4], [-0.1, -0.2])
    t.trajectories = [t.add_node(a, [5], [-0.3], "eos"), t.add_node(a, [6], [-0.4], "max_length"),
                      t.add_node(0, [7], [-1.0], "eos")]
    t.set_trajectory_rewards([0.0, 0.0, 0.0])
    rec = {**t.to_dict(), "prompt_text": "Q: 2+2?\n", "texts": ["", "Let me think.\n", "4", "5", "four"],
           "trained": False}
    (row,) = answer_samples(3, [rec], per_tree=2)
    assert row == {"step": 3, "query_id": "gsm8k#7", "trained": False, "prompt": "Q: 2+2?\n",
                   "answers": [{"text": "Let me think.\n4", "reward": 0.0, "finish": "eos"},
                               {"text": "Let me think.\n5", "reward": 0.0, "finish": "max_length"}]}
    assert len(answer_samples(3, [rec])[0]["answers"]) == 3
