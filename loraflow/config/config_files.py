"""Reading a config file (YAML or JSON) and the JSON files its keys name, bounded before anything is validated.

A file over `MAX_CONFIG_BYTES` is refused unread past that size (a config holds settings and prompts; a text encoder
reads a prompt's first few hundred tokens), and YAML whose aliases (`*name`) expand to more than `MAX_CONFIG_VALUES`
values is refused before it is built: a dozen lines of nested aliases (the "billion laughs") expand to gigabytes,
which validating, or printing in an error, never finishes. Each problem is a ValueError naming the file.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

MAX_CONFIG_BYTES = 1 << 20  # 1 MiB: the seed guides' configs are a few KB, a dataset list of a thousand entries 0.5 MB
MAX_CONFIG_VALUES = 100_000  # a config of a hundred datasets holds a few thousand


def not_a_file(path: Path) -> str:
    """What `path` is, where a file was wanted ("" when it is a file; a link: what it leads to): "does not exist",
    "is a folder", "is a FIFO (a named pipe)", ... (a FIFO or a device was said not to exist)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "is a link that leads nowhere" if path.is_symlink() else "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    kinds = ((stat.S_ISREG, ""), (stat.S_ISDIR, "is a folder, not a file"),
             (stat.S_ISFIFO, "is a FIFO (a named pipe), not a file"), (stat.S_ISCHR, "is a device, not a file"),
             (stat.S_ISBLK, "is a device, not a file"), (stat.S_ISSOCK, "is a socket, not a file"))
    return next((said for test, said in kinds if test(mode)), "is not a regular file")


def read_config_text(path: Path, what: str) -> str:
    """The text of a config file (`what`: how the message names it), refused past `MAX_CONFIG_BYTES`."""
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{what} {path} is {path.stat().st_size / 2**20:.1f} MiB; a config file is at most 1 MiB "
                         "(settings and prompts: a text encoder reads a prompt's first few hundred tokens): check "
                         "that it is the right file, and shorten what it holds")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not UTF-8 text ({exc.reason}); re-save it as UTF-8") from None


def read_json_file(path: Path, key: str, instead: str) -> Any:
    """The JSON file a config key names (`dataset_backend_config`, `user_prompt_library`, ...); `instead`: what to
    give when there is no such file."""
    if problem := not_a_file(path):
        raise ValueError(f"`{key}` file {path} {problem}; {instead}")
    try:
        return json.loads(read_config_text(path, f"`{key}` file"))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"`{key}` file {path} is not valid JSON: {exc}") from None


def read_yaml_file(path: Path) -> Any:
    """A YAML (or JSON) config file as Python values, its aliases' expansion counted before it is built."""
    loader = yaml.SafeLoader(read_config_text(path, "config file"))
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        values = _expanded_values(node, {}, set())
        if values > MAX_CONFIG_VALUES:
            raise ValueError(f"{path} holds {values} values once its YAML aliases (*name) are expanded; a config "
                             f"holds at most {MAX_CONFIG_VALUES} values (an alias bomb?): write the values out, or "
                             "use fewer aliases")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path} nests its values too deeply to be a config") from None
    finally:
        loader.dispose()


def _expanded_values(node: Node, counted: dict[int, int], open_nodes: set[int]) -> int:
    """How many values `node` holds with every alias expanded; each node is counted once (aliases share nodes)."""
    if isinstance(node, ScalarNode):
        return 1
    if id(node) in counted:
        return counted[id(node)]
    if id(node) in open_nodes:
        raise ValueError(f"line {node.start_mark.line + 1}: a YAML alias is used inside itself (its value would be "
                         "endless); write the value out")
    open_nodes.add(id(node))
    children = [n for pair in node.value for n in pair] if isinstance(node, MappingNode) else node.value
    counted[id(node)] = 1 + sum(_expanded_values(child, counted, open_nodes) for child in children)
    open_nodes.discard(id(node))
    return counted[id(node)]
