"""Each starting config (treepo_ray/configs/) loads and its actors' resources are granted on the hardware its header
names: a local Ray advertising those CPUs, GPUs and custom resources reserves, all at once, the placement groups the
run would ask for (learner ranks, engines, verifiers). Planning only: nothing runs on the GPUs."""

import pytest

from treepo_ray.job.config import CONFIG_DIR, config_names, load_config, resolve_config

# The paper configs' cluster (cluster/ray-cluster.yaml): one 8-GPU learner node, two 4-GPU generator nodes.
PAPER_CLUSTER = dict(num_cpus=96 + 2 * 48, num_gpus=8 + 2 * 4, resources={"learner_gpu": 8, "generator_gpu": 8})
HARDWARE = {
    "cpu": dict(num_cpus=2),
    "catpo_cpu": dict(num_cpus=2),
    "smollm2_cpu": dict(num_cpus=2),
    "gsm8k_1gpu": dict(num_cpus=8, num_gpus=1),
    "gsm8k_8gpu": dict(num_cpus=32, num_gpus=8),
    **{name: PAPER_CLUSTER for name in config_names() if name.endswith("_paper")},
}


def test_every_packaged_config_has_its_hardware_here():
    assert sorted(HARDWARE) == config_names()


def test_configs_are_found_by_name_or_path(tmp_path, monkeypatch):
    from treepo_ray.config import UserError

    monkeypatch.chdir(tmp_path)  # names resolve in the package, wherever the command runs
    assert resolve_config("treepo_paper") == resolve_config("treepo_paper.yaml") == CONFIG_DIR / "treepo_paper.yaml"
    (tmp_path / "mine.yaml").write_text("trainer: {steps: 3}\n")
    assert load_config(resolve_config("mine.yaml")).trainer.steps == 3
    with pytest.raises(UserError) as err:
        resolve_config("treepo")
    assert "\n" not in str(err.value) and "treepo_paper, treerpo_paper" in str(err.value)
    with pytest.raises(UserError):
        resolve_config("elsewhere/cpu.yaml")  # a path that is not there is not taken for a name


def test_paper_configs_write_to_the_shared_mount():
    for name in HARDWARE:
        if name.endswith("_paper"):
            assert load_config(resolve_config(name)).trainer.storage_path == "/runs", name  # cluster/: /runs


def _plan(cfg) -> list:
    """The placement groups a run reserves: as runtime/learner.py's LearnerGroup, runtime/pool.py's EngineSpec (a
    tensor-parallel engine: runtime/engine.py's engine_placement) and the verifiers' CPUs."""
    from ray.util.placement_group import placement_group

    from treepo_ray.runtime.engine import engine_placement, tensor_parallel_size
    from treepo_ray.runtime.pool import EngineSpec

    rt = cfg.runtime
    learner = {k: float(v) for k, v in {"CPU": rt.learner_cpus, "GPU": rt.learner_gpus,
                                        **rt.learner_resources}.items() if v}
    groups = [placement_group([dict(learner)] * rt.learner_ranks, strategy="PACK")]
    spec = EngineSpec.of(cfg, "")
    tp = tensor_parallel_size(cfg.model.engine, cfg.model.engine_kwargs)
    for _ in range(rt.num_engines):
        groups.append(engine_placement(tp, rt.engine_cpus, rt.engine_resources) if tp > 1
                      else placement_group([spec.demand()]))
    if rt.verifier_cpus:
        groups.append(placement_group([{"CPU": float(rt.verifier_cpus)}] * rt.num_verifiers))
    return groups


def _hardware_groups() -> dict:
    """Configs by the hardware they plan on (one local Ray for each kind of hardware)."""
    groups: dict[tuple, list[str]] = {}
    for name, hardware in sorted(HARDWARE.items()):
        groups.setdefault(tuple(sorted((k, str(v)) for k, v in hardware.items())), []).append(name)
    return {",".join(names): names for names in groups.values()}


@pytest.mark.slow
@pytest.mark.parametrize("names", list(_hardware_groups().values()), ids=list(_hardware_groups()))
def test_starting_configs_plan_on_their_hardware(names):
    import ray
    from ray.util.placement_group import remove_placement_group

    hardware = HARDWARE[names[0]]
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **hardware)
    try:
        for name in names:
            groups = _plan(load_config(resolve_config(name)))
            ready = [g.wait(timeout_seconds=30) for g in groups]
            assert all(ready), f"{name}: {ready.count(False)} of {len(groups)} resource requests not granted on {hardware}"
            if name.startswith("gsm8k_"):  # sized for its GPUs: every one of them in use
                assert ray.available_resources().get("GPU", 0.0) == 0.0, ray.available_resources()
            for g in groups:
                remove_placement_group(g)
    finally:
        ray.shutdown()
