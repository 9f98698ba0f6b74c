"""The package layout of docs/architecture.md holds: no import circle, every module imports on
its own in a fresh interpreter, small modules, few at the top, and a loop that does not know
which parallelisms are on."""

import ast
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(REPO, "trainer")
MAX_LINES = 600  # lines of a module as `ruff format` writes it
MAX_TOP_LEVEL = 10


def modules() -> dict[str, str]:
    """Dotted name -> path, for every module and package of trainer/."""
    found = {}
    for folder, _, files in os.walk(TRAINER):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], REPO).replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def import_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """Who imports whom, module to module, from the source (function-level imports too).
    Importing `a.b.c` runs `a.b`'s __init__ first: that edge is in the graph as well."""
    graph = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        edges = set()
        for t in targets:
            parts = t.split(".")
            for i in range(2, len(parts) + 1):  # the target and the packages it runs on the way
                p = ".".join(parts[:i])
                if p in mods and p != name and not name.startswith(p + "."):
                    edges.add(p)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_a_circle_and_the_package_edge():
    """The checker itself: a circle through a package's __init__ is found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    mods = modules()
    graph = import_graph(mods)
    assert "trainer.config.job" in graph["trainer.train"]
    assert "trainer.health" in graph["trainer.train"]  # `from trainer.health import faults`


def test_no_import_circle():
    cycle = find_cycle(import_graph(modules()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each module is imported first, alone, in a process with no trainer module loaded: an
    import that works only after another module was imported shows up here. (Forked from one
    that imported torch, dynamo, DCP, FSDP and DTensor: 5 s instead of 28 s in the suite.)"""
    names = sorted(n for n in modules() if not n.endswith("__main__"))
    script = textwrap.dedent("""
        import os, sys, importlib, traceback
        # heavy third-party imports, shared by the forks
        import numpy, torch, torch._dynamo, torch.distributed
        import torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor
        failed = []
        for name in sys.argv[1:]:
            pid = os.fork()
            if pid == 0:
                try:
                    importlib.import_module(name)
                    os._exit(0)
                except BaseException:
                    traceback.print_exc()
                    os._exit(1)
            _, status = os.waitpid(pid, 0)
            if status:
                failed.append(name)
        print("FAILED", " ".join(failed))
        sys.exit(1 if failed else 0)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script, *names],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_modules_are_small_and_few_at_the_top():
    mods = modules()
    long = {n: sum(1 for _ in open(p)) for n, p in mods.items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}
    top = sorted(f for f in os.listdir(TRAINER) if f.endswith(".py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_the_loop_does_not_know_the_parallelisms():
    """train.py, loop.py and step.py reach FSDP, TP, CP, PP and loss parallel only through the
    parallelize step and the step's seam (trainer/parallel/microbatches.py)."""
    graph = import_graph(modules())
    specific = {
        "trainer.parallel.fsdp",
        "trainer.parallel.tp",
        "trainer.parallel.loss_parallel",
        "trainer.parallel.context_parallel",
        "trainer.parallel.pipeline",
        "torch.distributed.fsdp",
        "torch.distributed.tensor.parallel",
        "torch.distributed.pipelining",
    }
    for name in ("trainer.train", "trainer.loop", "trainer.step"):
        source = open(modules()[name]).read()
        assert not graph[name] & specific, name
        for word in ("set_requires_gradient_sync", "fully_shard", "parallelize_module"):
            assert word not in source, (name, word)


# docs/architecture.md's "Who may import whom": a module imports only modules of its layer or
# below (package __init__ files, which only document or re-export, are not counted).
LAYER_0 = ("trainer.errors", "trainer.config.base", "trainer.health.faults")
LAYER_1 = (
    "trainer.config.sections",
    "trainer.checkpoint.config",
    "trainer.data.config",
    "trainer.evals.config",
    "trainer.parallel.dims",
    "trainer.parallel.float8",
    "trainer.parallel.pp_layout",
    "trainer.models.args",
    "trainer.models.flavors",
    "trainer.models.family",
    "trainer.models.registry",
    "trainer.models.deepseek_v3.args",
    "trainer.models.deepseek_v3.flavors",
    "trainer.models.llama3.flavors",
    "trainer.models.qwen3_next.args",
    "trainer.models.qwen3_next.flavors",
    "trainer.models.gpt_oss.args",
    "trainer.models.gpt_oss.flavors",
    "trainer.models.common.rope",
    "trainer.models.common.sdpa",
    "trainer.models.config",
    "trainer.optim.batch_schedule",
    "trainer.optim.lr_schedule",
    "trainer.observe.wandb_logger",
    "trainer.device",
)
TOP = ("trainer.step", "trainer.loop", "trainer.train", "trainer.launch")
CLI = (
    "trainer.config.__main__",
    "trainer.plan.__main__",
    "trainer.plan.report",
    "trainer.plan.trace",
    "trainer.convert",
    "trainer.generate",
)


def layer(name: str) -> float:
    if name in LAYER_0:
        return 0
    if name in LAYER_1:
        return 1
    if name == "trainer.config.job":
        return 2
    if name in TOP:
        return 4 + TOP.index(name) / 10
    return 5 if name in CLI else 3


def test_imports_follow_the_layers():
    mods = modules()
    packages = {n for n, p in mods.items() if p.endswith("__init__.py")}
    wrong = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in import_graph(mods).items()
        for b in targets
        if b not in packages and layer(b) > layer(a)
    ]
    assert wrong == []
