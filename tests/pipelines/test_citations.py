"""Every released number carries its source (loraflow/pipelines/citations.py): each flavour's numbers
(`Flavour.sources`) and each key of each released config file (`source.values` in loraflow/pipelines/released/*.json).
A number without a citation, a citation of an unknown source, or a file key cited twice or not at all fails here."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loraflow.pipelines import family_specs, released
from loraflow.pipelines.citations import SOURCES, citation_problem, cite

# The numbers of a flavour that carry a citation (docs/families.md's table shows them); `attention` where the flavour
# sets its mode's attention over the checkpoint's (`transformer_config`), else the released file cites it.
CITED = ("fps", "num_frames", "size", "flow_shift", "training_shift", "guidance", "steps", "text_tokens",
         "conditioning_frames")
FLAVOURS = [f for spec in family_specs() for f in spec.flavours]
FILES = sorted(released.FOLDER.glob("*.json"))


def leaves(config: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of a config's entries, nested configs (Qwen's text_config) entry by entry."""
    paths = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        paths += leaves(value, f"{path}.") if isinstance(value, dict) else [path]
    return paths


def test_a_citation_names_a_known_source_and_a_place_in_it() -> None:
    assert citation_problem(cite("kandinsky-5", "configs/k5_lite_t2v_5s_sft_sd.yaml")) == ""
    assert "unknown source" in citation_problem("recalled: somewhere")
    assert "not a citation" in citation_problem("50 steps")
    assert "not a citation" in citation_problem(None)
    assert "no place" in citation_problem("kandinsky-5:  ")
    with pytest.raises(ValueError, match="unknown source"):
        cite("a blog", "somewhere")
    assert all(SOURCES.values())


@pytest.mark.parametrize("flavour", FLAVOURS, ids=lambda f: f.name)
def test_every_number_of_a_flavour_is_cited(flavour: Any) -> None:
    wanted = set(CITED) | ({"attention"} if flavour.transformer_config else set())
    cited = dict(flavour.sources)
    assert set(cited) == wanted, f"missing {wanted - set(cited)}, not a number {set(cited) - wanted}"
    assert {f: problem for f in cited if (problem := citation_problem(cited[f]))} == {}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_key_of_a_released_config_is_cited_once(path: Any) -> None:
    data = json.loads(path.read_text())
    groups = data["source"]["values"]
    assert {g["from"]: problem for g in groups if (problem := citation_problem(g["from"]))} == {}
    keys = [k for g in groups for k in g["keys"]]
    assert len(keys) == len(set(keys)), "a key cited twice"
    paths = leaves(data["config"])
    uncovered = [p for p in paths if not any(p == k or p.startswith(f"{k}.") for k in keys)]
    unknown = [k for k in keys if not any(p == k or p.startswith(f"{k}.") for p in paths)]
    assert (uncovered, unknown) == ([], [])
