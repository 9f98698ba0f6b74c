"""`model.sdpa_backends`: which SDPA kernels a run allows, in which order, and which one runs.

The order is process-wide torch state, so each test puts it back as it found it."""

import pytest
import torch
import torch.nn.functional as F

from trainer.errors import ConfigError
from trainer.models.build import new_model
from trainer.models.common import sdpa
from trainer.models.flavors import model_args

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def restore_sdpa_state():
    order = torch._C._get_sdp_priority_order()
    switches = {
        name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")()
        for name in ("flash", "mem_efficient", "math", "cudnn")
    }
    yield
    torch._C._set_sdp_priority_order(order)
    for name, on in switches.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


def test_parse_orders_and_errors():
    assert sdpa.parse("auto") is None
    assert sdpa.parse(" cudnn, flash ,efficient,math") == ("cudnn", "flash", "efficient", "math")
    with pytest.raises(ConfigError, match="'fash' is not a backend"):
        sdpa.parse("flash,fash")
    with pytest.raises(ConfigError, match="names a backend twice"):
        sdpa.parse("flash,flash")


def test_cpu_auto_leaves_torch_order_and_refuses_gpu_only_lists():
    before = torch._C._get_sdp_priority_order()
    assert sdpa.apply("auto", CPU) is None
    assert torch._C._get_sdp_priority_order() == before
    with pytest.raises(ConfigError, match="has no backend the CPU runs"):
        sdpa.resolve("cudnn,efficient", CPU)
    assert sdpa.resolve("cudnn,flash", CPU) == ("cudnn", "flash")


def test_a_list_enables_exactly_its_backends_in_order():
    assert sdpa.apply("math,flash", CPU) == ("math", "flash")
    order = torch._C._get_sdp_priority_order()
    assert order[:2] == [int(sdpa._backend("math")), int(sdpa._backend("flash"))]
    assert sorted(order) == sorted(set(order)) and len(order) == 5  # every backend, once
    assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.backends.cuda.mem_efficient_sdp_enabled()


def test_chosen_names_the_kernel_torch_runs_and_the_line_says_it():
    a = model_args("debugmodel", vocab_size=256, max_seq_len=64)
    assert sdpa.chosen(a, CPU, torch.float32, 64) == "flash"
    line = sdpa.setup("math", a, CPU, "float32", 64)
    assert line == ("SDPA kernel: math (unfused) (order math; model.sdpa_backends = 'math')")
    assert sdpa.chosen(a, CPU, torch.float32, 64) == "math"
    masked = model_args(
        "debugmodel",
        vocab_size=256,
        max_seq_len=64,
        attn_mask_type="block_causal",
        attn_implementation="flex",
    )
    assert sdpa.chosen(masked, CPU, torch.float32, 64) == "flex"


def test_the_model_computes_the_same_under_math_and_flash():
    """A backend order changes the kernel, not the math: the debug model's loss and gradients
    agree within float32 rounding whichever CPU kernel runs."""
    torch.manual_seed(0)
    a = model_args("debugmodel", vocab_size=256, max_seq_len=64)
    model = new_model(a)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 256, (2, 64))
    results = []
    for spec in ("flash", "math"):
        sdpa.apply(spec, CPU)
        model.zero_grad()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (l1, g1), (l2, g2) = results
    assert abs(l1 - l2) < 1e-5
    assert max((x - y).abs().max().item() for x, y in zip(g1, g2, strict=True)) < 1e-4


PROBE = """
import sys, torch, torch.nn.functional as F
from trainer.models.common import sdpa
sdpa.apply(sys.argv[1], torch.device("cpu"))
g = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True) * 2)
q = torch.randn(1, 2, 16, 8)
with torch.profiler.profile() as p:
    g(q)
print("flash" if any("flash" in e.name for e in p.events()) else "math")
"""


def test_a_warm_compile_cache_does_not_serve_another_orders_kernel(tmp_path):
    """The SDPA kernel is traced into the compiled graph and torch's on-disk caches do not key
    on the backend switches: without the order in the cache key, a math-only run, after a
    flash run, was served the cached flash graph."""
    import subprocess

    from tests.helpers import fork_python

    # Two processes forked from the zygote (torch imported, nothing compiled): each compiles
    # afresh in memory, and they share only the on-disk cache, as two fresh interpreters would.
    probe, cache = tmp_path / "probe.py", tmp_path / "cache"
    probe.write_text(PROBE)
    python, env = fork_python({"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    runs = [
        subprocess.run(
            [python, str(probe), spec], env=env, capture_output=True, text=True, timeout=300
        )
        for spec in ("flash", "math")
    ]
    assert [r.stdout.strip().splitlines()[-1] for r in runs] == ["flash", "math"], [
        r.stderr[-2000:] for r in runs
    ]
    assert any(cache.rglob("*.py")), "the runs did not compile into the cache folder given"
