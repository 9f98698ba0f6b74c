import importlib.util
import os

# Two xdist workers share the cores with the ranks they launch, so thread pools oversubscribe
# them. An idle OpenMP thread (libgomp, torch's intra-op pool) spins by default: under
# oversubscription it burns the core another process is waiting for. Passive waiting changes
# no result and no solo timing; two concurrent 1-rank runs went from 17 s to 7 s here
# (docs/development.md). Set before torch is imported, so the workers and every launch inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# And one intra-op thread per process: the launcher gives a 1-rank run both cores
# (trainer/launch.py), which under the suite's two workers only oversubscribes them (a 1-rank
# MoE run: ~7.8 CPU-s with 2 threads, ~7.0 with 1, the same wall time). Every launch inherits it,
# through the zygote too (tests/helpers.py), so every run of a comparison uses the same count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# The suite's time budget (tests/budget.py): the run fails when one test or the whole session is
# slower than pyproject's budget_per_test / budget_total, scaled to this machine's speed.
# TRAINER_TEST_BUDGET=off switches it off. The shared corpus, tokenizer and store fixtures
# (tests/data_fixtures.py) are available to every test module without an import.
pytest_plugins = ["tests.budget", "tests.data_fixtures"]


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (`python -m pytest`, or the tests folder named) runs on one xdist worker
    per core, a test file per worker at a time (module fixtures are shared within a file; a
    launch's serial phase, the launcher importing torch, leaves a core idle that the other
    worker uses). A file or a test named on the command line runs plainly in this process.
    An explicit `-n` or `--dist` wins either way. Not in a worker itself: it runs the tests
    it is given, and workers of its own would multiply without end."""
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if config.option.numprocesses is not None or config.option.dist != "no":
        return
    tests = os.path.dirname(os.path.abspath(__file__))
    named = {os.path.abspath(str(a).split("::")[0]) for a in config.args}
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS or named == {tests}:
        config.option.numprocesses = "auto"
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


# The GPU machines have no Hugging Face `datasets`: what reads text/json/hub data through it skips
# there (marked needs_datasets); everything else runs.
HAS_DATASETS = importlib.util.find_spec("datasets") is not None

# The longest files first, so that under xdist (pyproject's addopts) they overlap the many
# short ones instead of running alone at the end: ordered by the larger of their wall and CPU
# seconds in a whole suite on the 2-core EPYC (.pytest_cache/trainer-durations.json:
# test_moe.py 275 s ... test_evals_e2e.py 39 s); test_default_run.py trains 100 steps where
# .ci/run has not already (TRAINER_TEST_DEFAULT_RUN).
LONGEST_FIRST = [
    "test_moe.py",
    "test_deepseek.py",
    "test_default_run.py",
    "test_multinode.py",
    "test_pipeline.py",
    "test_optim_resume.py",
    "test_plan_trace.py",
    "test_object_store_faults.py",
    "test_qwen3_next_train.py",
    "test_mix_e2e.py",
    "test_tp.py",
    "test_slurm.py",
    "test_muon.py",
    "test_train_e2e.py",
    "test_faults.py",
    "test_heal.py",
    "test_context_parallel.py",
    "test_plan.py",
    "test_object_store.py",
    "test_ep_dispatch.py",
    "test_bad_inputs.py",
    "test_deepseek_recipe.py",
    "test_sdpa.py",
    "test_device.py",
    "test_fsdp_options.py",
    "test_hf.py",
    "test_evals_e2e.py",
]


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
    if not HAS_DATASETS:
        skip = pytest.mark.skip(reason="needs Hugging Face `datasets`, not installed here")
        for item in items:  # json_cfg (and the stores built from it) reads jsonl through it
            if "needs_datasets" in item.keywords or "json_cfg" in getattr(item, "fixturenames", ()):
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _offline_caches(tmp_path_factory):
    """No downloads and no writes to the user's caches: HF and the data cache live in tmp."""
    root = tmp_path_factory.mktemp("caches")
    os.environ["HF_HOME"] = str(root / "hf")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
