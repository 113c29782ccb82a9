"""The YAML a policy file is read with: PyYAML's safe loader without YAML 1.1 surprises.

Its own module so that PyYAML (slow to import) loads only when a policy file is read, not when
egressd runs on its built-in default policy.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml import YAMLError

__all__ = ["YAMLError", "load"]


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1 surprises (``off`` → False) and with duplicate keys refused."""


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)  # `[a]: 1` or `? {a: 1}`: YAML allows it, a policy does not
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be a scalar, not {type(key).__name__}", key_node.start_mark
            ) from None
        if key in result:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        result[key] = loader.construct_object(value_node, deep=True)
    return result


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load(text: str) -> object:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
