"""The YAML loader of the EPP's own files (the pool file, the scheduler config).

It is PyYAML's safe loader (libyaml's when present: several times faster) with one change:
integers that cannot be printed are refused. PyYAML types a plain scalar by its look, then
builds it, and for some scalars it cannot build (a 13th month, an offset past a day, a decimal
integer of more digits than ``int()`` reads, ``!!bool maybe``) its constructors raise one of
``VALUE_ERRORS`` rather than a ``YAMLError``: callers catch both. Hexadecimal, octal and binary
integers have no digit limit, so ``0x`` and 5,000 digits would build, and then raise
``ValueError`` in whichever error message quotes them: ``Loader`` refuses those when built.
"""

from __future__ import annotations

from typing import Any

import yaml

VALUE_ERRORS = (ValueError, TypeError, LookupError, AttributeError, OverflowError)

_BASE: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Loader(_BASE):  # type: ignore[misc]  # PyYAML's loaders are untyped
    """``yaml.safe_load``'s loader whose integers all print."""


def _construct_int(loader: Any, node: yaml.ScalarNode) -> int:
    value: int = loader.construct_yaml_int(node)
    str(value)  # ValueError past int()'s digit limit, as for a decimal literal of that length
    return value


Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
