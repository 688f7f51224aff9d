"""Walking a state tree: nested dicts, ordered dicts, lists and tuples around tensors and plain values.

One walker for every place that splits a state into its structure and its tensors, or puts it back together
(the checkpoint stager and codec, the live group's state broadcast). Containers are recognised by their exact
type (``dict``, ``OrderedDict``, ``list``, ``tuple``) and rebuilt as the same type; anything else, a subclass
of one of them included, is a leaf, handed whole to the caller's function.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["iter_leaves", "map_leaves"]

_MAPPINGS = (dict, OrderedDict)
_SEQUENCES = (list, tuple)


def map_leaves(obj: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``obj`` with its containers rebuilt and every leaf ``x`` replaced by ``fn(x)``, depth first, in order
    (dict items in insertion order). ``is_leaf``: a container it selects is a leaf too (handed to ``fn``)."""

    def visit(o: Any) -> Any:
        if is_leaf is not None and is_leaf(o):
            return fn(o)
        kind = type(o)
        if kind in _MAPPINGS:
            out = kind()
            for key, value in o.items():
                out[key] = visit(value)
            return out
        if kind is list:
            return [visit(v) for v in o]
        if kind is tuple:
            return tuple(visit(v) for v in o)
        return fn(o)

    return visit(obj)


def iter_leaves(obj: Any) -> Iterator[Any]:
    """Every leaf of ``obj`` in the order :func:`map_leaves` visits them."""
    kind = type(obj)
    if kind in _MAPPINGS:
        for value in obj.values():
            yield from iter_leaves(value)
    elif kind in _SEQUENCES:
        for value in obj:
            yield from iter_leaves(value)
    else:
        yield obj
