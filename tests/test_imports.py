"""No import cycle among loraflow's modules: each contract lives in one place below the stages that use it.

Walks every module's imports with `ast`, those inside functions and under `if TYPE_CHECKING:` too (a
function-level import hides a cycle, it does not break it; a type-only one still ties the two modules together).
Also: only the Dagster layer (loraflow/assets/, definitions.py) imports dagster; a stage folder (stages/<x>/,
training/, validation/) imports another only through contracts/ (`stage_crossings` states the rule); what planning
runs imports no model library (torch, diffusers). Run alone:
`.venv/bin/python -m pytest -q tests/test_imports.py`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.factory import REPO, demo_dict, write_config

PACKAGE = Path(__file__).resolve().parents[1] / "loraflow"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, modules: set[str]) -> set[str]:
    """The loraflow modules one import statement runs (`from pkg import mod` names the module, not pkg)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
        subs = {f"{node.module}.{a.name}" for a in node.names} & modules
        return subs | ({node.module} if len(subs) < len(node.names) else set())
    return set()


def imports_of(tree: ast.AST, modules: set[str]) -> set[str]:
    found: set[str] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        found |= _imported(node, modules)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imports_of(ast.parse(path.read_text()), modules) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (first module repeated at the end), or None; depth-first with an explicit path."""
    done: set[str] = set()
    for start in sorted(graph):
        path, on_path, stack = [], set(), [(start, iter(sorted(graph[start])))]
        path.append(start), on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop(), path.pop(), on_path.discard(node), done.add(node)
            elif child in on_path:
                return path[path.index(child):] + [child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child])))), path.append(child), on_path.add(child)
    return None


def test_the_walk_sees_imports_inside_functions_and_type_checking_blocks() -> None:
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\ndef f():\n    from b import c\n"
    assert imports_of(ast.parse(code), {"a", "b", "b.c"}) == {"a", "b.c"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_loraflow_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_estimates_import_the_training_step_not_the_loop() -> None:
    """`loraflow.estimates` runs one micro-step's loss (training/step.py) on fake tensors; the loop (optimizer,
    checkpoints, launch, renders) is none of its business."""
    estimates = {m: imports for m, imports in import_graph().items() if m.split(".")[:2] == ["loraflow", "estimates"]}
    assert not [m for m, imports in estimates.items() if "loraflow.training.loop" in imports]
    assert any("loraflow.training.step" in imports for imports in estimates.values())


def with_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` plus what Python runs first: importing `a.b.c` runs package `a.b`'s __init__ (loraflow.config's
    imports the whole config model), unless the importer is inside `a.b` already."""
    def inits(importer: str, module: str) -> set[str]:
        parts = module.split(".")
        return {p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if not importer.startswith(p + ".")}
    return {name: (imports | {p for m in imports for p in inits(name, m) if p in graph}) - {name}
            for name, imports in graph.items()}


def test_no_import_cycle_runs_through_a_package_init() -> None:
    planted = {"loraflow.config": {"loraflow.config.fields"}, "loraflow.config.fields": {"loraflow.pipelines"},
               "loraflow.config.dataset": set(), "loraflow.pipelines": {"loraflow.config.dataset"}}
    assert find_cycle(planted) is None  # the plain walk misses it
    assert find_cycle(with_package_inits(planted)) == ["loraflow.config", "loraflow.config.fields",
                                                       "loraflow.pipelines", "loraflow.config"]
    cycle = find_cycle(with_package_inits(import_graph()))
    assert cycle is None, "import cycle through a package __init__: " + " -> ".join(cycle or [])


# What a Dagster step process and `loraflow check --no-estimates` run, in a fresh interpreter: the code location,
# `check`, then the clips stage through Dagster. Neither loads a model, so neither may pay torch's and diffusers'
# import (6-7 s).
LIGHT_STAGES = """
import sys
from dagster import DagsterInstance, materialize
import loraflow.definitions
from loraflow.assets.resources import LoraflowResource
from loraflow.assets.stages import clips
from loraflow.cli import main

config, dataset = sys.argv[1:]
assert main(["check", "--no-estimates", config]) == 0  # the estimates import torch by design
with DagsterInstance.ephemeral() as instance:
    instance.add_dynamic_partitions("datasets", [dataset])
    done = materialize([clips], resources={"loraflow": LoraflowResource(config_path=config)}, instance=instance,
                       partition_key=dataset)
assert done.success
print("heavy:", sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules))
"""


def test_check_and_the_clips_stage_import_no_model_library(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", demo_dict(tiny_k5, demo_data, tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DAGSTER_HOME", None)  # no dead-run guard thread: this instance is ephemeral
    done = subprocess.run([sys.executable, "-c", LIGHT_STAGES, str(config), "demo-videos"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bucket plan" in done.stdout  # check ran to its table
    assert done.stdout.strip().splitlines()[-1] == "heavy: []"


# Two more layering rules, read from the same `ast` walk. A stage folder is one step of the DAG:
STAGE_FOLDERS = ("loraflow.stages.clips", "loraflow.stages.latents", "loraflow.stages.text", "loraflow.stages.teacher",
                 "loraflow.training", "loraflow.validation")


# The crossings that stand today, each with why; the test fails when one goes too, so this list stays true.
KNOWN_CROSSINGS = {
    # train_lora computes the teacher features the store lacks before rank 0 trains, as `python -m
    # loraflow.train_main` runs without the teacher_features asset; goes when the caller hands the features in.
    "loraflow.training.loop -> loraflow.stages.teacher.teacher_features",
}


def stage_folder(module: str) -> str | None:
    return next((f for f in STAGE_FOLDERS if module == f or module.startswith(f + ".")), None)


def stage_crossings(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one stage folder into another. A stage folder may import `loraflow.contracts` (what the stages
    hand each other: reports, rows, hold-out, render settings, text sets) and the shared lower layers (media, kernels,
    pipelines, store, keys, config), never another stage folder: a stage is read, tested and changed on its own, and
    what two stages share is a contract, so it lives in contracts/. `stages/shard_worker.py` and `assets/` stand above
    the stage folders and may call several."""
    return sorted(f"{module} -> {imported}" for module, imports in graph.items() for imported in imports
                  if stage_folder(module) and stage_folder(imported) not in (None, stage_folder(module)))


def top_packages(tree: ast.AST) -> set[str]:
    """The top-level package of every absolute import in a module, inside functions too."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def dagster_importers() -> list[str]:
    """Modules below loraflow/ that import dagster: only the Dagster layer (assets/, definitions.py) may, so the
    stages, the CLI's planning and `python -m loraflow.train_main` run without it."""
    return [name for name, path in sorted((module_name(p), p) for p in PACKAGE.rglob("*.py"))
            if not (name == "loraflow.definitions" or name.split(".")[:2] == ["loraflow", "assets"])
            and "dagster" in top_packages(ast.parse(path.read_text()))]


# demo/ (the demo dataset, `build_tiny`, the tiny world) stands on the pipelines: the CLI calls it, nothing below
# imports it. A family's tiny checkpoint is built by its own folder's tiny.py, from pipelines/tiny_parts.py.
DEMO_CALLERS = ("loraflow.cli",)


def demo_importers(graph: dict[str, set[str]]) -> list[str]:
    def in_demo(module: str) -> bool:
        return module == "loraflow.demo" or module.startswith("loraflow.demo.")
    return sorted(f"{module} -> {imported}" for module, imports in graph.items() for imported in imports
                  if in_demo(imported) and not in_demo(module) and module not in DEMO_CALLERS)


def test_the_rules_see_a_planted_import() -> None:
    graph = {"loraflow.training.loop": {"loraflow.stages.latents.latents", "loraflow.contracts.reports"},
             "loraflow.stages.shard_worker": {"loraflow.stages.clips.clips"}}
    assert stage_crossings(graph) == ["loraflow.training.loop -> loraflow.stages.latents.latents"]
    assert top_packages(ast.parse("def f():\n    from dagster._core import x\n")) == {"dagster"}
    assert demo_importers({"loraflow.pipelines.kandinsky5.video.family": {"loraflow.demo.tiny"},
                           "loraflow.demo.tiny": {"loraflow.demo.tiny_world"}}) == [
        "loraflow.pipelines.kandinsky5.video.family -> loraflow.demo.tiny"]


def test_only_the_dagster_layer_imports_dagster() -> None:
    assert dagster_importers() == [], "import dagster only in loraflow/assets/ (the Dagster layer)"


def test_nothing_below_the_demo_imports_it() -> None:
    assert demo_importers(import_graph()) == [], "build tiny checkpoints in the family's tiny.py, not in loraflow/demo/"


def test_stage_folders_meet_only_through_contracts() -> None:
    assert stage_crossings(import_graph()) == sorted(KNOWN_CROSSINGS), "move what two stages share into contracts/"


# Context resolved once: the entries (assets/, the CLI, `python -m loraflow.train_main`) resolve a config's family
# (`get_family`) and model source (`model_source`, which may download from the Hugging Face Hub) and hand them down;
# everything in stages/ (the fan-out worker too: the CLI and the fan-out op resolve for it), training/, validation/,
# contracts/ and the estimates (`loraflow check` and the assets call them) takes them as arguments, so nothing below
# the entries contacts the Hub.
CONTEXT_RESOLVERS = ("get_family", "model_source")
BELOW_THE_ENTRIES = ("loraflow.stages", "loraflow.training", "loraflow.validation", "loraflow.contracts",
                     "loraflow.estimates")


def context_calls(tree: ast.AST) -> list[str]:
    """The calls to a context resolver in one module, by plain name or as an attribute (`sources.model_source(`)."""
    return [name for node in ast.walk(tree) if isinstance(node, ast.Call)
            for name in [getattr(node.func, "id", None) or getattr(node.func, "attr", None)]
            if name in CONTEXT_RESOLVERS]


def rederivations() -> list[str]:
    return sorted(f"{name}: {call}" for name, path in ((module_name(p), p) for p in PACKAGE.rglob("*.py"))
                  if any(name == f or name.startswith(f + ".") for f in BELOW_THE_ENTRIES)
                  for call in context_calls(ast.parse(path.read_text())))


def test_the_context_rule_sees_a_planted_call() -> None:
    tree = ast.parse("def f(config):\n    family = get_family(config)\n    return sources.model_source(config)\n")
    assert context_calls(tree) == ["get_family", "model_source"]


def test_the_stages_are_handed_their_family_and_model() -> None:
    assert rederivations() == [], (
        "resolve get_family / model_source in the entry (assets/, the CLI, train_main) and pass it down")
