"""The policy's schema checks, one of each: the loader, the `secrets:` and `upstream_proxy:` entries,
a rule's mapping form and the importers all read documents through `Reader`, so every check (a
mapping with known keys, a list, true or false, a port, a positive number) and its message exist
once, and every error names the file, the full key path (``allow[2]``, ``profiles.ci.ports[0]``) and
the bad entry. Standard library only: a policy is read before the child starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["NO_ENTRY", "PolicyError", "Reader", "item", "join", "type_name"]

NO_ENTRY = object()


class PolicyError(ValueError):
    """A policy that cannot be loaded; ``str()`` reads ``file: key: 'entry': message``."""

    def __init__(self, file: str, key: str | None, entry: object = NO_ENTRY, message: str = "") -> None:
        self.file = file
        self.key = key
        self.has_entry = entry is not NO_ENTRY
        self.entry: object | None = entry if self.has_entry else None
        self.message = message
        super().__init__(self._text())

    def located(self) -> str:
        """``key: 'entry': message``: for a reader whose caller names the file (or the rule) itself."""
        parts = []
        if self.key:
            parts.append(self.key)
        if self.has_entry:
            parts.append(repr(self.entry))
        parts.append(self.message)
        return ": ".join(parts)

    def _text(self) -> str:
        return f"{self.file}: {self.located()}"

    def __str__(self) -> str:
        return self._text()


def type_name(value: object) -> str:
    """How a message names what was written instead (YAML's words, not Python's)."""
    if value is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def join(key: str | None, name: str) -> str:
    """The key path of `name` inside the mapping at `key`."""
    return f"{key}.{name}" if key else name


def item(key: str, index: int) -> str:
    """The key path of the `index`th item of the list at `key`."""
    return f"{key}[{index}]"


class Reader:
    """Typed accessors that raise PolicyError with the full key path; null means "not given"
    wherever a default exists, and a boolean is never a number (YAML's `true` is not port 1)."""

    __slots__ = ("source",)

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str | None, message: str, entry: object = NO_ENTRY) -> PolicyError:
        return PolicyError(self.source, key, entry, message)

    def document(self, data: object) -> Mapping[Any, Any]:
        """The whole document: a mapping."""
        if not isinstance(data, Mapping):
            raise self.fail(None, f"a policy must be a mapping, not {type_name(data)}")
        return data

    def mapping(
        self,
        value: object,
        key: str,
        allowed: Sequence[str] | None,
        *,
        what: str = "",
        required: bool = False,
        echo: bool = True,
    ) -> dict[Any, Any]:
        """A mapping whose keys are all in `allowed` (None: any key, e.g. profile names); null is
        empty unless `required`. `what` describes the expected shape; `echo=False` keeps a value
        out of the message (an upstream proxy's URL may carry credentials)."""
        if value is None and not required:
            return {}
        if not isinstance(value, Mapping):
            message = f"must be a mapping{what}, not {type_name(value)}"
            raise self.fail(key, message, value) if echo else self.fail(key, message)
        if allowed is not None:
            for name in value:
                if not isinstance(name, str) or name not in allowed:
                    raise self.fail(
                        join(key, str(name)), f"unknown key (expected one of: {', '.join(allowed)})"
                    )
        return dict(value)

    def list(self, value: object, key: str, *, what: str = "") -> list[Any]:
        """A list; null is empty."""
        if value is None:
            return []
        if not isinstance(value, list | tuple):
            raise self.fail(key, f"must be a list{what}, not {type_name(value)}", value)
        return list(value)

    def items(self, value: object, key: str, *, what: str = "") -> Iterator[tuple[str, Any]]:
        """(key path, item) for each item of the list at `key`."""
        for index, entry in enumerate(self.list(value, key, what=what)):
            yield item(key, index), entry

    def bool(self, value: object, key: str, default: bool) -> bool:
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, not {type_name(value)}", value)
        return value

    def choice(self, value: object, key: str | None, choices: Sequence[str]) -> str:
        """One of `choices`, exactly as written (null is not one of them)."""
        if not isinstance(value, str) or value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}", value)
        return value

    def text(self, value: object, key: str, *, required: bool = True) -> str:
        """A string: non-blank if `required`, else null reads as ""."""
        if value is None and not required:
            return ""
        if not isinstance(value, str) or (required and not value.strip()):
            raise self.fail(key, "must be a non-empty string" if required else "must be a string", value)
        return value

    def file_path(self, value: object, key: str) -> str:
        if not isinstance(value, str) or not value or "\0" in value:
            raise self.fail(key, "must be a file path", value)
        return value

    def integer(self, value: object, key: str, minimum: int = 1, unit: str = "") -> int:
        """An integer of at least `minimum` (null is not one)."""
        if minimum == 1:
            need = "must be a positive integer"
        else:
            need = f"must be an integer of at least {minimum}" + (f" ({unit})" if unit else "")
        return self._integer(value, key, minimum, need)

    def count(self, value: object, key: str) -> int | None:
        """A positive integer, or null for "no limit"."""
        if value is None:
            return None
        return self._integer(value, key, 1, "must be a positive integer or null")

    def _integer(self, value: object, key: str, minimum: int, need: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, need, value)
        return value

    def port(self, value: object, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"port must be an integer, not {type_name(value)}", value)
        if not 1 <= value <= 65535:
            raise self.fail(key, "port out of range 1-65535", value)
        return value

    def ports(self, value: object, key: str) -> tuple[int, ...]:
        """A list of ports, each once, in the order written."""
        return tuple(dict.fromkeys(self.port(entry, where) for where, entry in self.items(value, key)))

    def positive(self, value: object, key: str, default: float) -> float:
        """A positive number that is finite as a float (seconds, a rate); null is `default`."""
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, not {type_name(value)}", value)
        try:
            finite = float(value) < float("inf")  # an int past float's range overflows here
        except OverflowError:
            finite = False
        if not value > 0 or not finite:  # NaN is neither > 0 nor < inf
            raise self.fail(key, "must be a positive, finite number", value)
        return value
