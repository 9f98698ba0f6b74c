"""The family rule (docs/architecture.md#where-new-things-go): a model family that is a package
under trainer/models/ is reached from the rest of the trainer only through the registry
(trainer/models/registry.py) and the family contract (trainer/models/hooks.py): no module
outside the package imports it, and none tests for the family. Checked on the source, for
every family the registry holds as a package, and against planted violations."""

import re

import pytest

from tests.test_layout import import_graph, modules
from trainer.models import registry
from trainer.models.hooks import DecoderHooks

# What only a family's own modules may say: its model.name as a literal, and a test on the
# shape it adds to ModelArgs. trainer/models/args.py hands ModelArgs.hybrid and .mla their
# questions through the family's own types (the one place those fields are read outside
# their families); trainer/models/common/mla.py is the MLA layer the DeepSeek family builds.
MARKERS = {
    # The plain decoder: the contract's defaults are its answers, so the shared code has
    # nothing to test for (its name is also Llama 3.1's RoPE type, a literal that stays).
    "llama3": [r"\bLlamaHooks\b"],
    "deepseek_v3": [
        r"""["']deepseek_v3["']""",
        r"\bmla\s+is\s+(not\s+)?None",
        r"\bif\s+(not\s+)?[\w.]*\bmla\b",
        r"\bmla\s+else\b",
        r"\bDeepSeek[A-Z]\w*",
        r"""(hasattr|getattr)\([^)]*["']w(kv|q)_[ab]["']""",  # MLA's own weights, by name
    ],
    "qwen3_next": [
        r"""["']qwen3_next["']""",
        r"\bhybrid\s+is\s+(not\s+)?None",
        r"\bif\s+[\w.]*\bhybrid\b",
        r"\bQwen3Next\b",
        r"\bGatedDeltaNet\b",
    ],
    "gpt_oss": [
        r"""["']gpt_oss["']""",
        r"\bGptOss\w*",
        r"""(hasattr|getattr)\([^)]*["']sinks["']""",  # its attention's sinks, by name
        r"\.sliding_window\b",  # its windows, read off the args
    ],
}
DISPATCH = {"trainer.models.args", "trainer.models.registry", "trainer.models.common.mla"}


def family_packages() -> dict[str, str]:
    """model.name -> the package of each family the registry holds as a package."""
    return {f.name: f.hooks.rpartition(".")[0] for f in registry.PACKAGES}


def foreign_imports(graph: dict[str, set[str]], package: str) -> list[str]:
    """Modules outside `package` that import it or one of its modules (the registry may
    import the package itself, the family's registration)."""
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if not (name == package or name.startswith(package + "."))
        for target in targets
        if (target == package or target.startswith(package + "."))
        and not (name == "trainer.models.registry" and target == package)
    )


def family_branches(sources: dict[str, str], family: str, package: str) -> list[str]:
    """Lines outside `package` (module name -> source) that test for `family`."""
    found = []
    for name, text in sources.items():
        if name == package or name.startswith(package + ".") or name in DISPATCH:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern in MARKERS[family]:
                if re.search(pattern, code):
                    found.append(f"{name}:{no}: {line.strip()}")
    return found


def _sources() -> dict[str, str]:
    return {name: open(path).read() for name, path in modules().items()}


def test_every_registered_family_is_a_package_with_markers():
    packages = family_packages()
    assert packages, "the registry holds no family package"
    mods = modules()
    for name, package in packages.items():
        assert mods[package].endswith("__init__.py"), package
        assert f"{package}.hooks" in mods, f"{package} has no hooks module"
        assert name in MARKERS, f"say what only {name}'s modules may test for (MARKERS)"
        assert name in registry.names()


def test_no_module_outside_a_family_imports_it():
    graph = import_graph(modules())
    for package in family_packages().values():
        assert foreign_imports(graph, package) == []


def test_no_module_outside_a_family_tests_for_it():
    sources = _sources()
    for family, package in family_packages().items():
        assert family_branches(sources, family, package) == []


@pytest.mark.parametrize(
    "family, line",
    [
        ("qwen3_next", "    if args.hybrid is not None:"),
        ("qwen3_next", "    return Qwen3Next(args) if ok else None"),
        ("qwen3_next", "    if cfg.model.name == 'qwen3_next':"),
        ("qwen3_next", "    if a.hybrid:"),
        ("deepseek_v3", "    if args.mla is not None:"),
        ("deepseek_v3", "    if not a.mla:"),
        ("deepseek_v3", "    return DeepSeekHF() if ok else None"),
        ("deepseek_v3", "    x = 1 if a.mla else 2"),
        ("deepseek_v3", "    if cfg.model.name == 'deepseek_v3':"),
        ("deepseek_v3", '    if hasattr(module, "wkv_b"):'),
        ("gpt_oss", "    if cfg.model.name == 'gpt_oss':"),
        ("gpt_oss", "    return GptOssHF() if ok else None"),
        ("gpt_oss", '    if getattr(block.attention, "sinks", None) is not None:'),
        ("gpt_oss", "    w = a.hybrid.sliding_window"),
    ],
)
def test_a_planted_branch_is_found(family, line):
    """A branch on the family planted in parallel/ is found."""
    planted = {"trainer.parallel.planted": f"def f(args, a, cfg, ok):\n{line}\n    return 1\n"}
    assert family_branches(planted, family, f"trainer.models.{family}") != []


def test_a_planted_import_is_found():
    graph = {
        "trainer.parallel.planted": {"trainer.models.qwen3_next.model"},
        "trainer.models.registry": {"trainer.models.qwen3_next"},
    }
    assert foreign_imports(graph, "trainer.models.qwen3_next") == [
        "trainer.parallel.planted imports trainer.models.qwen3_next.model"
    ]


def test_each_familys_hooks_answer_the_whole_contract():
    """A family's hooks are the decoder's with overrides: every question has an answer."""
    contract = {n for n in dir(DecoderHooks) if not n.startswith("_")}
    for f in registry.PACKAGES:
        hooks = registry._hooks(f.hooks)
        assert isinstance(hooks, DecoderHooks)
        assert contract <= set(dir(hooks))
        overridden = {
            n for n in contract if getattr(type(hooks), n) is not getattr(DecoderHooks, n)
        }
        assert "build" in overridden, f.name
