"""Read a YAML file from a stranger: bounded in size, UTF-8, no duplicate keys, no alias bombs.

A scenario file is untrusted input. ``yaml.safe_load`` runs no code, but it happily expands
``&a [*b, *b, …]`` anchors into billions of objects (memory grows before any check can run) and
lets a repeated key silently win. Here the file is composed into PyYAML's node graph first, where
an alias is one shared node, so the expanded size can be counted without expanding anything.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_FILE_BYTES = 1_000_000  # the largest study in scenarios/ is under 3 kB
MAX_EXPANDED_NODES = 100_000  # nodes after alias expansion: a sweep of thousands of values fits
MAX_DEPTH = 50


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a number (YAML 1.2; YAML 1.1 makes it a string, which
    strict validation would then refuse as 'not a number')."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


class YamlInputError(ValueError):
    """The text is not acceptable YAML; ``field`` is the dotted path where that was found (or '')."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def decode_text(data: bytes) -> str:
    """The file's bytes as text: UTF-8 only, bounded size."""
    if len(data) > MAX_FILE_BYTES:
        raise YamlInputError(f"file is larger than {MAX_FILE_BYTES:,} bytes (the limit)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise YamlInputError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with the limits above; raises YamlInputError naming where."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise YamlInputError(f"text is longer than {MAX_FILE_BYTES:,} bytes")
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise YamlInputError(f"not valid YAML: {exc}".replace("\n", " ")) from None
    if node is None:
        return None
    _check_node(node, {}, path="", depth=0)
    loader = _Loader("")
    try:
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise YamlInputError(f"not valid YAML: {exc}".replace("\n", " ")) from None
    finally:
        loader.dispose()


def _check_node(node: yaml.Node, sizes: dict[int, int], *, path: str, depth: int) -> int:
    """The node's size once every alias is expanded (memoised per shared node, so a bomb costs
    one visit per distinct node); raises on a duplicate key, too deep nesting, or too many nodes."""
    if id(node) in sizes:
        if sizes[id(node)] < 0:
            raise YamlInputError("an alias refers to the value that contains it (recursive)", path)
        return sizes[id(node)]
    if depth > MAX_DEPTH:
        raise YamlInputError(f"nested deeper than {MAX_DEPTH} levels", path)
    sizes[id(node)] = -1  # in progress: reaching it again is a recursive alias
    size = 1
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else id(key_node)
            where = f"{path}.{key}" if path else str(key)
            if key == "<<":
                raise YamlInputError("merge keys (<<) are not supported in scenario files", path)
            if key in seen:
                raise YamlInputError("duplicate key (each key may appear once)", where)
            seen.add(key)
            size += 1 + _check_node(value_node, sizes, path=where, depth=depth + 1)
            _check_size(size, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            size += _check_node(item, sizes, path=f"{path}[{i}]", depth=depth + 1)
            _check_size(size, f"{path}[{i}]")
    sizes[id(node)] = size
    return size


def _check_size(size: int, where: str) -> None:
    if size > MAX_EXPANDED_NODES:
        raise YamlInputError(
            f"expands to more than {MAX_EXPANDED_NODES:,} values (anchors/aliases included)", where
        )
