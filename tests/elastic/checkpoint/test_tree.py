"""The one walker of state trees: containers by exact type, rebuilt as the same type, leaves in order."""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import pytest
import torch

from elastic.checkpoint.tree import iter_leaves, map_leaves


@pytest.mark.timeout(10)
def test_containers_are_rebuilt_with_their_type_and_every_leaf_mapped_in_order() -> None:
    t = torch.ones(2)
    state = {"model": OrderedDict(w=t, b=3), "opt": [(1, "x"), {"lr": 0.1}]}
    seen: list[object] = []
    out = map_leaves(state, lambda x: seen.append(x) or ("leaf", x))
    assert seen == [t, 3, 1, "x", 0.1] == list(iter_leaves(state))
    assert type(out["model"]) is OrderedDict and type(out["opt"][0]) is tuple
    assert out["model"]["b"] == ("leaf", 3) and out["opt"][1] == {"lr": ("leaf", 0.1)}


@pytest.mark.timeout(10)
def test_subclasses_of_containers_are_leaves_and_is_leaf_selects_containers() -> None:
    d = defaultdict(int, a=1)
    assert list(iter_leaves({"d": d})) == [d]
    ref = {"__ref__": 0}
    out = map_leaves([ref, {"k": 1}], lambda x: "T" if x is ref else x, is_leaf=lambda x: x is ref)
    assert out == ["T", {"k": 1}]
