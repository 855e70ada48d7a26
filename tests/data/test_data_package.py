"""The packages' import surface: `import treepo_ray.data` stays light, and rewards/ imports nothing from data/."""

import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    """Names in sys.modules after `statement` runs in a fresh interpreter."""
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    return set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())


def test_data_package_exports_the_loaders_without_torch():
    loaded = _modules_after("from treepo_ray.data import SyntheticTaskConfig, load_records, write_splits")
    assert "torch" not in loaded and "transformers" not in loaded
    assert "treepo_ray.data.pretrain" not in loaded  # imported by its module path when wanted


def test_rewards_is_a_leaf_below_data():
    loaded = _modules_after("import treepo_ray.rewards")
    assert "treepo_ray.rewards.synthetic" in loaded and "treepo_ray.rewards.router" in loaded
    assert not {m for m in loaded if m.startswith("treepo_ray.data")}
