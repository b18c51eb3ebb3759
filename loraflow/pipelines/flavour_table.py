"""docs/families.md's flavour table, made from the flavours themselves: per flavour its repository, size (what
validation renders at by default), sampling steps, guidance, render shift, training shift, attention and text
length, each number with a reference to its citation (`Flavour.sources`; the attention's from the released
transformer file where the flavour sets no mode), listed below the table. tests/test_docs.py holds the page to it;
`python -m loraflow.pipelines.flavour_table` prints it.
"""

from __future__ import annotations

from loraflow.pipelines.flavours import Flavour
from loraflow.pipelines.registry import family_specs

COLUMNS = ("size", "steps", "guidance", "flow_shift", "training_shift", "attention", "text_tokens")
HEADER = ("family", "flavour", "repository (diffusers layout)", "size (WxH)", "steps", "guidance", "render shift",
          "training shift", "attention", "text tokens", "musubi-tuner task")


def attention(flavour: Flavour) -> tuple[str, str]:
    """(the attention the flavour runs, its citation): its mode's, else its released transformer file's."""
    from loraflow.pipelines.released import FLAVOURS, released_file

    if flavour.name not in FLAVOURS:
        return "", ""
    data = released_file(flavour.name, "transformer")
    config = flavour.configured(data["config"])
    kind = config.get("attention_type", "dense")
    if kind == "nabla":
        kind = (f"NABLA P {config['attention_P']}, wT/wW/wH {config['attention_wT']}/{config['attention_wW']}/"
                f"{config['attention_wH']}")
    if flavour.source("attention"):
        return kind, flavour.source("attention")
    cited = next((g["from"] for g in data["source"]["values"] if "attention_type" in g["keys"]), "")
    if not cited:  # HunyuanVideo 1.5: diffusers' dense attention, no attention key in its config
        cited = next(g["from"] for g in data["source"]["values"] if "_class_name" in g["keys"])
    return kind, cited


def flavour_table() -> str:
    """The markdown table and, below it, the numbered citations its cells refer to."""
    notes: dict[str, int] = {}

    def ref(value: object, citation: str) -> str:
        number = notes.setdefault(citation, len(notes) + 1)
        return f"{value} [{number}]"

    rows = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for spec in family_specs():
        for flavour in spec.flavours:
            cells = []
            for column in COLUMNS:
                value, citation = attention(flavour) if column == "attention" else (
                    getattr(flavour, column), flavour.source(column))
                if column == "size":
                    value = f"{value[1]}x{value[0]}"
                cells.append(ref(value, citation))
            musubi = ", ".join(flavour.peer_names)
            rows.append("| " + " | ".join([spec.name, flavour.name, flavour.repo or "none published", *cells,
                                            musubi]) + " |")
    sources = [f"{number}. {citation}" for citation, number in notes.items()]
    return "\n".join(rows) + "\n\n" + "\n".join(sources) + "\n"


if __name__ == "__main__":
    print(flavour_table(), end="")
