"""``load_quotas``: the controller's ``--quotas`` file (YAML or JSON), and what it refuses, in one line each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.core.config import ConfigError, load_quotas
from service.core.view import Quotas, SubmitLimits

pytestmark = pytest.mark.timeout(10)


def _write(tmp_path: Path, data: Any, name: str = "quotas.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return path


def test_a_yaml_quotas_file_gives_user_queue_and_default_limits(tmp_path: Path) -> None:
    quotas = load_quotas(
        _write(tmp_path, {"users": {"alice": 4, "ci-bot": 0}, "queues": {"team-a": 6}, "default_user": 8})
    )
    assert quotas == Quotas(users={"alice": 4, "ci-bot": 0}, queues={"team-a": 6}, default_user=8)
    assert (quotas.user_limit("alice"), quotas.user_limit("bob"), quotas.queue_limit("team-a")) == (4, 8, 6)
    assert quotas.queue_limit("team-b") is None and quotas.queue_limit(None) is None


def test_a_json_quotas_file_reads_the_same(tmp_path: Path) -> None:
    assert load_quotas(_write(tmp_path, {"queues": {"q1": 2}}, "quotas.json")) == Quotas(queues={"q1": 2})


@pytest.mark.parametrize("data", [{}, {"users": None, "queues": {}, "default_user": None}])
def test_every_part_is_optional(tmp_path: Path, data: dict[str, Any]) -> None:
    quotas = load_quotas(_write(tmp_path, data))
    assert quotas == Quotas() and quotas.user_limit("anyone") is None


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"user": {"alice": 4}}, "unknown key(s) user (expected users, queues, default_user, limits)"),
        ({"users": {"alice": -1}}, "users.alice must be a whole number of nodes >= 0, got -1"),
        ({"users": {"alice": 2.5}}, "users.alice must be a whole number of nodes >= 0, got 2.5"),
        ({"users": {"alice": True}}, "users.alice must be a whole number of nodes >= 0, got True"),
        ({"users": {"alice": "4"}}, "users.alice must be a whole number of nodes >= 0, got '4'"),
        ({"default_user": -3}, "default_user must be a whole number of nodes >= 0, got -3"),
        ({"users": ["alice"]}, "users must be a mapping of name to a number of nodes"),
        ({"queues": {"Team_A": 1}}, "queues.Team_A: not a queue name a job can give"),
        ({"users": {7: 1}}, "users: the name 7 is not a non-empty string"),
        (["users"], "expected a mapping with users, queues and/or default_user"),
        (None, "expected a mapping with users, queues and/or default_user"),
    ],
    ids=[
        "unknown-key",
        "negative",
        "fraction",
        "bool",
        "string",
        "default-negative",
        "users-list",
        "queue-name",
        "numeric-user",
        "list",
        "empty-file",
    ],
)
def test_a_bad_quotas_file_is_refused_in_one_line_naming_the_key(tmp_path: Path, data: Any, words: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_quotas(path)
    message = str(info.value)
    assert words in message and message.startswith(str(path)) and "\n" not in message


def test_a_missing_or_unparsable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the quotas file"):
        load_quotas(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("users: {alice: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML/JSON"):
        load_quotas(bad)


def test_limits_bound_what_user_tokens_submit_each_unset_one_taken_from_the_default(tmp_path: Path) -> None:
    quotas = load_quotas(
        _write(
            tmp_path,
            {
                "limits": {
                    "default": {"max_priority": 0, "max_pending": 10},
                    "users": {"alice": {"max_priority": 100, "queues": ["team-a"]}, "bob": {"max_pending": 1}},
                }
            },
        )
    )
    assert quotas.submit_limits("alice") == SubmitLimits(max_priority=100, queues=frozenset({"team-a"}), max_pending=10)
    assert quotas.submit_limits("bob") == SubmitLimits(max_priority=0, queues=None, max_pending=1)
    assert quotas.submit_limits("carol") == SubmitLimits(max_priority=0, max_pending=10)
    assert load_quotas(_write(tmp_path, {})).submit_limits("anyone") == SubmitLimits()  # none: no limit


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"default": {"max_priority": 2000}}, "limits.default.max_priority must be a whole number from -1000 to 1000"),
        ({"users": {"a": {"queues": ["Team A"]}}}, "limits.users.a.queues must be a list of queue names"),
        ({"users": {"a": {"max_pending": -1}}}, "limits.users.a.max_pending must be a whole number >= 0"),
        ({"users": {"a": {"priority": 1}}}, "limits.users.a: unknown key(s) priority"),
        ({"alice": {"max_priority": 1}}, "limits must be a mapping with default and/or users"),
    ],
)
def test_a_bad_limit_is_refused_in_one_line_naming_it(tmp_path: Path, limits: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_quotas(_write(tmp_path, {"limits": limits}))
    assert message in str(err.value) and "\n" not in str(err.value)
