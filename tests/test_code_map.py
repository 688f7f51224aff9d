"""README's code map names every module of ``elastic/`` and ``service/``, and no module that is gone; and what it
says of the ``ETRAIN_*`` names holds: each is written once, in ``elastic/contract/env.py`` (those the service and
the workers share) or in ``service/cli`` (the variables of ``etrain``'s own flags).

The map is the README's code block after "Code layout". A line at column 0 opens a root (``elastic/``,
``service/``); a line at column 2 is an entry of that root: a package (``checkpoint/``) or a module
(``compat.py``); deeper-indented lines continue the entry. A module ``<root>/<pkg>/.../<name>.py`` is named when
its package's entry says ``<name>.py``; a module at the root is an entry of its own. Packages' ``__init__.py`` and
``__main__.py`` are named by their package.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("elastic", "service")
_PY = re.compile(r"(?<![\w/.])(\w+)\.py\b")


def code_map(readme: str) -> dict[str, dict[str, str]]:
    """``root -> entry -> its text`` (``"checkpoint/"`` or ``"compat.py"`` -> the words after it)."""
    lines = readme.split("Code layout", 1)[1].split("```", 2)[1].splitlines()
    roots: dict[str, dict[str, str]] = {}
    root: dict[str, str] | None = None
    entry = ""
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent == 0:
            root = roots.setdefault(line.split()[0].rstrip("/"), {})
            entry = ""
        elif root is not None and indent == 2:
            entry, _, rest = line.strip().partition(" ")
            root[entry] = rest.strip()
        elif root is not None and entry:
            root[entry] += " " + line.strip()
    return roots


def _modules(root: str) -> list[Path]:
    return sorted(p.relative_to(REPO / root) for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts)


def unnamed(roots: dict[str, dict[str, str]]) -> list[str]:
    """The modules the map does not name, as paths."""
    out = []
    for root in ROOTS:
        entries = roots.get(root, {})
        for rel in _modules(root):
            if rel.name in ("__init__.py", "__main__.py"):
                named = len(rel.parts) == 1 or f"{rel.parts[0]}/" in entries
            elif len(rel.parts) == 1:
                named = rel.name in entries
            else:
                named = rel.stem in _PY.findall(entries.get(f"{rel.parts[0]}/", ""))
            if not named:
                out.append(f"{root}/{rel}")
    return out


def stale(roots: dict[str, dict[str, str]]) -> list[str]:
    """The map's modules and packages that are not in the tree."""
    out = []
    for root in ROOTS:
        tree = {str(p) for p in _modules(root)}
        for entry, text in roots.get(root, {}).items():
            if entry.endswith(".py"):
                if entry not in tree:
                    out.append(f"{root}/{entry}")
                continue
            package = entry.rstrip("/")
            if not (REPO / root / package).is_dir():
                out.append(f"{root}/{entry}")
                continue
            names = {Path(p).name for p in tree if p.startswith(package + "/")}
            out += [f"{root}/{package}/.../{m}.py" for m in _PY.findall(text) if f"{m}.py" not in names]
    return out


@pytest.mark.timeout(60)
def test_the_map_reader_finds_packages_modules_and_their_continuation_lines() -> None:
    text = "Code layout:\n\n```\nelastic/   x\n  a/        one.py, two.py\n            three.py\n  b.py      y\n```\n"
    assert code_map(text) == {"elastic": {"a/": "one.py, two.py three.py", "b.py": "y"}}


@pytest.mark.timeout(60)
def test_readme_code_map_names_every_module_of_elastic_and_service() -> None:
    roots = code_map((REPO / "README.md").read_text())
    assert len(roots["elastic"]) > 5 and len(roots["service"]) > 5  # the map was read
    assert unnamed(roots) == []


@pytest.mark.timeout(60)
def test_readme_code_map_names_no_module_that_is_not_in_the_tree() -> None:
    assert stale(code_map((REPO / "README.md").read_text())) == []


#: Where an ``ETRAIN_*`` name may be written (README's code map, ``contract/``'s line).
ETRAIN_HOMES = ("elastic/contract/env.py", "service/cli/servers.py", "service/cli/main.py")


@pytest.mark.timeout(60)
def test_every_etrain_name_is_written_once_in_its_home() -> None:
    written: Counter[str] = Counter()
    elsewhere = []
    for root in ROOTS:
        for rel in _modules(root):
            path = f"{root}/{rel}"
            for node in ast.walk(ast.parse((REPO / path).read_text())):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and re.fullmatch(r"ETRAIN_[A-Z0-9_]+", node.value)
                ):
                    written[node.value] += 1
                    if path not in ETRAIN_HOMES:
                        elsewhere.append(f"{path}: {node.value}")
    assert len(written) > 40  # the tree was read
    assert elsewhere == []
    assert [name for name, n in written.items() if n > 1] == []
