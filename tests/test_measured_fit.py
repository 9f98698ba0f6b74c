"""trainer/plan/measured.py: the largest batch by a measured peak (what a compiled step keeps)."""

from trainer.config.job import load_config
from trainer.plan.measured import describe, measured_fit, split
from trainer.plan.memory import GIB, device_need, largest_local_batch, memory_plan

ONE_B = [
    "--job.config_file",
    "configs/llama3_1b.toml",
    "--data.dataset",
    "synthetic",
    "--training.global_batch_size",
    "-1",
    "--training.local_batch_size",
    "7",
]


def test_a_peak_equal_to_the_plan_gives_the_plans_answer():
    cfg = load_config(ONE_B)
    plan = memory_plan(cfg, 1)["total"]
    fit = measured_fit(cfg, 1, plan, 79.1)
    assert abs(fit["share"] - 1) < 1e-9
    assert fit["largest"] == fit["plan_largest"] == largest_local_batch(cfg, 1, 79.1)


def test_a_smaller_peak_scales_only_the_batch_part():
    cfg = load_config(ONE_B)
    fixed, per_sample = split(cfg, 1)
    assert fixed > 20 * GIB and per_sample > 1 * GIB  # 1B: ~20 GiB of fp32 state; GiBs a sample
    peak = int(fixed + 0.6 * 7 * per_sample)  # compile keeps 60% of the eager activations
    fit = measured_fit(cfg, 1, peak, 79.1)
    assert abs(fit["share"] - 0.6) < 1e-6
    # the largest batch's predicted peak fits with the plan's margins, one more does not
    b = fit["largest"]
    assert b > fit["plan_largest"]
    assert device_need(fit["predicted_peak"]) <= 79.1 * GIB
    one_more = fixed + 0.6 * (b + 1) * per_sample
    assert device_need(int(one_more)) > 79.1 * GIB
    line = describe(cfg, 2, peak, 79.1, fit)
    assert f"the largest local_batch_size that fits 79 GiB is {b} " in line
    assert "keeps 60% of the plan's activations" in line
