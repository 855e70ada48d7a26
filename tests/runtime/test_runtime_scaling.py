"""The generator pool's scaling policy (job/scaling.py) as a plain class fed measured numbers: when it scales up and
down, its hysteresis and cool-down, and that it stays between runtime.num_engines and runtime.elastic.max_engines."""

import pytest

from treepo_ray.job.config import ElasticConfig
from treepo_ray.job.scaling import ScalingPolicy, StepMeasure

ELASTIC = ElasticConfig(max_engines=3, autoscale=True, scale_up_wait=0.25, scale_down_wait=0.05, idle_busy=0.3,
                        patience=2, cooldown_s=10.0)
STARVED = StepMeasure(wait_share=0.6, queued=0, busy_share=0.9)  # rollout is the bottleneck
AHEAD = StepMeasure(wait_share=0.0, queued=2, busy_share=0.5)  # every slot of the queue (max_staleness 2) full


def feed(policy: ScalingPolicy, measures: list, t0: float = 0.0, dt: float = 1.0, joined: bool = True) -> list:
    """The target after each measure, one step every `dt` seconds from `t0`."""
    out = []
    for i, m in enumerate(measures):
        policy.observe(m, t0 + i * dt, joined)
        out.append(policy.target)
    return out


def test_scales_up_while_the_learner_waits_and_down_once_rollout_is_ahead():
    policy = ScalingPolicy(1, 3, ELASTIC, max_staleness=2, warmup=0)
    # Patience 2: the second starved step decides; the cool-down (10 s) holds the next decision back.
    assert feed(policy, [STARVED] * 12) == [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]
    assert feed(policy, [AHEAD] * 12, t0=100.0) == [3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1]
    assert (policy.scale_ups, policy.scale_downs) == (2, 2)


def test_stays_between_the_floor_and_the_ceiling():
    policy = ScalingPolicy(2, 3, ELASTIC, max_staleness=2, warmup=0)
    assert feed(policy, [STARVED] * 40, dt=20.0)[-1] == 3
    assert feed(policy, [AHEAD] * 40, t0=1000.0, dt=20.0)[-1] == 2
    assert (policy.scale_ups, policy.scale_downs) == (1, 1)


def test_one_odd_step_changes_nothing():
    policy = ScalingPolicy(1, 3, ELASTIC, max_staleness=2, warmup=0)
    between = StepMeasure(wait_share=0.15, queued=0, busy_share=0.9)  # between the two thresholds
    assert feed(policy, [STARVED, between, STARVED, AHEAD, STARVED, AHEAD], dt=20.0) == [1] * 6
    assert feed(policy, [between] * 10, dt=20.0) == [1] * 10


def test_idle_engines_are_given_back_and_never_added():
    policy = ScalingPolicy(1, 3, ELASTIC, max_staleness=0, warmup=0)  # synchronous: no batch is ever queued
    idle_wait = StepMeasure(wait_share=0.6, queued=0, busy_share=0.1)  # the learner waits on something else
    assert feed(policy, [idle_wait] * 5, dt=20.0) == [1] * 5
    policy.target = 2
    idle = StepMeasure(wait_share=0.02, queued=0, busy_share=0.1)
    assert feed(policy, [idle] * 3, t0=100.0, dt=20.0) == [2, 1, 1]


def test_no_engine_is_added_while_the_last_ones_have_not_joined():
    policy = ScalingPolicy(1, 3, ELASTIC, max_staleness=2, warmup=0)
    assert feed(policy, [STARVED] * 4, dt=20.0, joined=False) == [1] * 4
    assert feed(policy, [STARVED], t0=100.0) == [2]  # the signal held all along: it acts once they have joined
    policy2 = ScalingPolicy(1, 3, ELASTIC, max_staleness=2, warmup=0)
    policy2.target = 3
    assert feed(policy2, [AHEAD] * 2, dt=20.0, joined=False) == [3, 2]  # giving back needs no joins


def test_the_pipeline_filling_at_the_start_is_not_measured():
    policy = ScalingPolicy(1, 3, ELASTIC, max_staleness=2)  # the first 3 steps wait for the queue to fill
    assert feed(policy, [STARVED] * 5, dt=20.0) == [1, 1, 1, 1, 2]


def test_decisions_say_why():
    policy = ScalingPolicy(1, 3, ELASTIC, max_staleness=2, warmup=0)
    policy.observe(STARVED, 0.0)
    decision = policy.observe(STARVED, 1.0)
    assert decision.target == 2
    assert decision.line(1) == ("pool: target 1 -> 2 engines (the learner waited 60% of each of 2 steps for a "
                                "batch, none waiting, engines busy 90%)")


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="scale_down_wait"):
        ElasticConfig(scale_up_wait=0.1, scale_down_wait=0.2)
    with pytest.raises(ValueError, match="patience"):
        ElasticConfig(patience=0)
