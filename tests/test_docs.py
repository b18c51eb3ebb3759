"""The README and docs/ against the code: the two commands first, then a quick start for one's own videos whose
commands, keys, paths, checkpoint and loaders are the code's, and relative links that lead somewhere."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
FIRST_SCREEN = 60  # lines: what a terminal or GitHub shows before one scrolls much


def without_blocks(text: str) -> str:
    """The text without fenced blocks: a `# comment` in a shell block is not a heading."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def outside_code(text: str) -> str:
    """The text without fenced blocks and inline code: `[a](b)` inside backticks is not a link."""
    return re.sub(r"`[^`\n]*`", "", without_blocks(text))


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def quick_start() -> str:
    """The README section whose heading says "your own", up to the next heading of its level."""
    text = README.read_text()
    start = re.search(r"^## .*your own.*$", text, flags=re.M | re.I)
    assert start, "README.md has no '## ... your own ...' section"
    end = text.find("\n## ", start.end())
    return text[start.start():end if end >= 0 else None]


def snippet() -> dict:
    (block,) = fenced(quick_start(), "yaml")
    return yaml.safe_load(block)


def anchors(doc: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped (not `-` or `_`), spaces to `-`, repeats numbered."""
    ids, count = set(), {}
    for heading in re.findall(r"^#+ (.+)$", without_blocks(doc.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count[slug] = count.get(slug, -1) + 1
        ids.add(slug if count[slug] == 0 else f"{slug}-{count[slug]}")
    return ids


def test_first_screen_is_the_two_commands_then_a_quick_start_for_your_own_videos() -> None:
    lines = README.read_text().split("\n")[:FIRST_SCREEN]
    screen = "\n".join(lines)
    first = fenced(README.read_text(), "bash")[0]  # .ci/run and benchmarks/bench_demo.py run these two
    assert [line.split("#")[0].strip() for line in first.strip().split("\n")] == ["make demo", "make test"]
    assert first in screen
    heading = [i for i, line in enumerate(lines) if re.match(r"## .*your own", line, flags=re.I)]
    assert heading, f"no '## ... your own ...' heading in the first {FIRST_SCREEN} lines"
    later = "\n".join(lines[heading[0]:])
    for step in ("```yaml", "loraflow check", "loraflow partitions", "-j cache_dataset", "-j train_and_validate"):
        assert step in later, f"the quick start's {step!r} is not on the first screen"
    # which LoRA file goes where, before the quick start: diffusers' loader, ComfyUI's models/loras
    from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE
    from loraflow.training.checkpoints import LORA_FILE

    before = "\n".join(lines[:heading[0]])
    for name in (LORA_FILE, "load_lora_weights", COMFYUI_LORA_FILE, "models/loras"):
        assert name in before, f"the first screen does not say {name!r}"
    assert before.index(LORA_FILE) < before.index("load_lora_weights") < before.index(COMFYUI_LORA_FILE) < \
        before.index("models/loras")


def test_every_relative_link_of_readme_and_docs_resolves() -> None:
    checked = 0
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", outside_code(doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.is_file(), f"{doc.relative_to(REPO)}: link {target!r}: no file {file}"
            if anchor:
                assert anchor in anchors(file), f"{doc.relative_to(REPO)}: link {target!r}: no such heading"
            checked += 1
    assert checked > 10  # the table of docs/ alone has six


def test_every_loraflow_command_and_job_the_docs_name_exists() -> None:
    from loraflow.assets.fanout import cache_latents_fanout
    from loraflow.assets.jobs import JOBS
    from loraflow.cli import build_parser

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]
    jobs = {job.name for job in [*JOBS, cache_latents_fanout]}
    checked = {"subcommand names": 0, "loraflow command lines": 0, "job lines": 0}
    for doc in DOCS:
        text = doc.read_text()
        for name in re.findall(r"(?:`|bin/)loraflow ([a-z][\w-]*)", text):
            assert name in subparsers.choices, f"{doc.relative_to(REPO)}: `loraflow {name}` is no subcommand"
            checked["subcommand names"] += 1
        # whole command lines: those of shell blocks, and `.venv/bin/loraflow ...` in the text
        lines = [*"\n".join(fenced(text, "bash")).split("\n"), *re.findall(r"`(\.venv/bin/loraflow [^`]+)`", text)]
        for line in lines:
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("bin/loraflow"):
                try:
                    parser.parse_args(words[1:])
                except SystemExit:  # argparse's answer to an unknown option or a missing argument
                    pytest.fail(f"{doc.relative_to(REPO)}: the CLI refuses {line!r}")
                checked["loraflow command lines"] += 1
            if words[:3] == [".venv/bin/dagster", "job", "execute"]:
                assert words[words.index("-j") + 1] in jobs, f"{doc.relative_to(REPO)}: {line}"
                checked["job lines"] += 1
    # at least today's counts: a doc reworded out of these patterns fails here instead of being checked no more (one
    # that drops a command on purpose lowers its count here)
    today = {"subcommand names": 35, "loraflow command lines": 9, "job lines": 5}
    assert all(checked[kind] >= count for kind, count in today.items()), checked


def test_quick_start_config_loads_with_the_flavours_released_checkpoint(tmp_path: Path) -> None:
    from loraflow.config import load_config
    from loraflow.pipelines import family_spec

    data = snippet()
    data["output_dir"], data["cache_dir"] = str(tmp_path / "output"), str(tmp_path / "cache")
    for dataset in data["datasets"]:
        if "instance_data_dir" in dataset:
            dataset["instance_data_dir"] = str(tmp_path / dataset["id"])
            (tmp_path / dataset["id"]).mkdir()
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    config = load_config(tmp_path / "mine.yaml")
    released = family_spec(config.model_family).flavour(config.model_flavour).repo
    assert config.pretrained_model_name_or_path == released  # "the flavour's default"
    text = quick_start()
    (python,) = fenced(text, "python")
    assert f'from_pretrained("{released}"' in python
    # the partition the stage command names is the snippet's dataset
    media = [d.id for d in config.training_datasets]
    assert re.findall(r'"dagster/partition": "([^"]+)"', text) == media


def test_each_key_value_the_quick_start_names_is_a_valid_setting() -> None:
    """`lora_format: comfyui`, `base_model_precision: fp8-layerwise`, ...: a config key, and a value it takes."""
    from pydantic import TypeAdapter

    from loraflow.config import LoraflowConfig

    pairs = re.findall(r"`([a-z][a-z0-9_]*): ([^`]+)`", quick_start())
    assert pairs
    for key, value in pairs:
        assert key in LoraflowConfig.model_fields, f"`{key}` is no config key"
        TypeAdapter(LoraflowConfig.model_fields[key].annotation).validate_python(yaml.safe_load(value))


def test_the_quick_starts_paths_and_loaders_are_the_codes(tmp_path: Path) -> None:
    import dataclasses

    import diffusers

    from loraflow.config import LoraflowConfig, parse_config
    from loraflow.contracts.reports import LoraReport
    from loraflow.pipelines.comfyui import COMFYUI_LORA_FILE
    from loraflow.training.checkpoints import LORA_FILE
    from loraflow.training.run import run_dir

    text = quick_start()
    config = parse_config(snippet())
    run = run_dir(config, {})
    assert f"{config.output_dir}/runs/<key>/{LORA_FILE}" in text
    assert run.parent == Path(config.output_dir) / "runs"
    assert f"`{COMFYUI_LORA_FILE}`" in text
    # every other snake_case name in backticks is a config key or what the `lora` asset reports
    named = set(re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`", text))
    known = set(LoraflowConfig.model_fields) | {f.name for f in dataclasses.fields(LoraReport)}
    assert named and named <= known, named - known
    (python,) = fenced(text, "python")
    classes = re.findall(r"\b(\w+Pipeline)\b", python)
    assert classes and all(hasattr(getattr(diffusers, name), "load_lora_weights") for name in classes)
    # HunyuanVideo 1.5: the pipeline has no loader, its transformer has one
    assert not hasattr(diffusers.HunyuanVideo15Pipeline, "load_lora_weights")
    assert "pipe.transformer.load_lora_adapter(" in text
    assert hasattr(diffusers.HunyuanVideo15Transformer3DModel, "load_lora_adapter")


def test_the_quick_starts_diffusers_snippet_loads_a_lora_written_as_training_writes_it(tiny_k5: Path,
                                                                                        tmp_path: Path) -> None:
    """The README's Python, run as written, with the tiny checkpoint for the released one and a run folder holding an
    adapter written as training writes it (`export_lora`: at unit scale): the pipeline ends up with those LoRA
    weights, lora_alpha / r = 8 / 4 in lora_B."""
    import torch
    from diffusers import Kandinsky5Transformer3DModel
    from peft import LoraConfig, get_peft_model_state_dict

    from loraflow.pipelines import load_family
    from loraflow.training.checkpoints import LoraExport, adapter_config, export_lora

    config = snippet()
    family = load_family(config["model_family"], config["model_flavour"])
    trained = Kandinsky5Transformer3DModel.from_pretrained(tiny_k5 / "transformer")
    trained.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=family.lora_targets(False)))
    with torch.no_grad():  # lora_B starts at zero: random values, so a LoRA that is not loaded shows
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
    run = tmp_path / "runs" / "key"
    run.mkdir(parents=True)
    export_lora(run, get_peft_model_state_dict(trained), LoraExport(adapter_config(trained), family, True))
    (python,) = fenced(quick_start(), "python")
    python = python.replace(f'"{config["pretrained_model_name_or_path"]}"', repr(str(tiny_k5)))
    python = python.replace(f'"{config["output_dir"]}/runs/<key>"', repr(str(run)))
    scope: dict = {}
    exec(compile(python, "README.md", "exec"), scope)  # the README's own code, paths substituted
    loaded = scope["pipe"].transformer
    ((adapter, lora_config),) = loaded.peft_config.items()
    assert lora_config.lora_alpha == lora_config.r == 4  # the header's LoraConfig: unit scale
    weights = get_peft_model_state_dict(loaded, adapter_name=adapter)
    assert weights.keys() == get_peft_model_state_dict(trained).keys()
    for name, param in get_peft_model_state_dict(trained).items():
        # the pipeline's copy of each trained weight (lora_B times the scale 2, exact) in its dtype: one rounding
        assert torch.equal(weights[name], (param * (2 if "lora_B" in name else 1)).to(loaded.dtype)), name


def test_the_flavour_table_is_the_flavours() -> None:
    """docs/families.md's released-checkpoint table is made from the flavours and their citations: a number changed in
    a spec (or a citation) without the page changes fails here (`python -m loraflow.pipelines.flavour_table`)."""
    from loraflow.pipelines.flavour_table import flavour_table

    text = (REPO / "docs" / "families.md").read_text()
    shown = re.search(r"<!-- flavour table: .*? -->\n(.*?)<!-- end of the flavour table -->", text, flags=re.S)
    assert shown, "docs/families.md lost its flavour table markers"
    assert shown.group(1) == flavour_table()


def test_every_table_and_number_from_a_results_json_is_its_json() -> None:
    """The marked tables of docs/benchmarks.md (`<!-- table:NAME -->`) and the marked numbers of its text
    (`<!-- value:NAME -->TEXT<!-- /value -->`) are what benchmarks/tables.py writes from benchmarks/results/: a number
    edited by hand, or a JSON rerun without `benchmarks/tables.py`, fails."""
    import sys

    sys.path.insert(0, str(REPO))
    from benchmarks import tables

    marked = {path.name: [m.group(2) for m in tables.MARKED.finditer(path.read_text())] for path in tables.DOCS}
    assert all(marked.values()), f"a file without marked tables: {marked}"
    assert set(tables.TABLES) == {name for names in marked.values() for name in names}, "a table in no file"
    stale = {path.name: tables.differing(path) for path in tables.DOCS}  # a broken or unknown marker raises here
    assert not any(stale.values()), f"tables or values differing from their JSON (run benchmarks/tables.py): {stale}"
    valued = {m.group(2) for path in tables.DOCS for m in tables.VALUE.finditer(path.read_text())}
    assert set(tables.values()) == valued, f"values in no file: {set(tables.values()) - valued}"
