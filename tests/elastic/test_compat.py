"""The supported torch range and each private-API shim, on the installed torch.

``scripts/compat.sh`` runs this file (with the rendezvous, store, loop, prefork and checkpoint suites) on
the oldest and the newest torch of the range; CI runs it on both.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic import compat

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_states_the_same_torch_range_as_the_start_up_check() -> None:
    text = (ROOT / "pyproject.toml").read_text()  # (no tomllib: Python 3.10 is supported)
    torch_dep = re.findall(r'^\s*"(torch[<>=!~ ][^"]*)",', text, re.M)
    assert torch_dep == [compat.TORCH_REQUIREMENT]


def test_the_installed_torch_passes_the_start_up_check() -> None:
    compat.check_torch()
    assert compat.private_api_problems() == []


@pytest.mark.parametrize("version", ["2.5.1", "1.13.1", "2.16.0", "3.0.0.dev20270101"])
def test_a_torch_outside_the_range_is_refused_with_one_line_naming_the_range(version: str) -> None:
    with pytest.raises(compat.UnsupportedTorchError) as info:
        compat.check_torch(version)
    message = str(info.value)
    assert "\n" not in message
    assert version in message and compat.TORCH_REQUIREMENT in message


@pytest.mark.parametrize("version", ["2.6.0", "2.11.0+cu130", "2.15.0", "2.13.0+cpu"])
def test_versions_inside_the_range_are_accepted(version: str) -> None:
    compat.check_torch(version)


def test_parse_version_reads_local_and_dev_builds() -> None:
    assert compat.parse_version("2.13.0+cpu") == (2, 13)
    assert compat.parse_version("2.16.0.dev20261101+cu130") == (2, 16)
    with pytest.raises(compat.TorchCompatError):
        compat.parse_version("nightly")


def test_the_rendezvous_store_info_is_built_on_this_torch() -> None:
    store = torch.distributed.HashStore()
    info = compat.rendezvous_store_info(0, store, "127.0.0.1")
    assert info.master_port > 0 and info.master_addr
    assert compat.rendezvous_store_info(1, store, "127.0.0.2").master_port == info.master_port


def test_the_etcd_v3_handler_implements_every_abstract_method_of_torchs_handler() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler

    assert issubclass(EtcdV3RendezvousHandler, RendezvousHandler)
    assert not getattr(EtcdV3RendezvousHandler, "__abstractmethods__", frozenset())


def test_dcp_fsspec_reader_and_writer_are_found() -> None:
    reader, writer = compat.fsspec_checkpoint_io()
    assert reader.__name__ == "FsspecReader" and writer.__name__ == "FsspecWriter"


def test_importing_the_plugin_module_first_registers_etcd_v3_without_a_warning() -> None:
    code = (
        "import elastic.rendezvous.plugin\n"
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
        "print('etcd-v3' in r._registry)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Exception while registering" not in proc.stderr, proc.stderr
    assert "circular import" not in proc.stderr
    assert proc.stdout.split()[-1] == "True"


def _with_torch_version(version: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter whose torch reports ``version``."""
    prelude = f"import torch\ntorch.__version__ = {version!r}\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=90)


def test_torchrun_on_an_unsupported_torch_stops_with_one_line_and_no_traceback() -> None:
    proc = _with_torch_version(
        "2.5.1",
        "import sys\n"
        "sys.argv = ['torchrun', '--rdzv-backend=etcd-v3', '--rdzv-endpoint=127.0.0.1:9', '--nnodes=1',"
        " '--nproc-per-node=1', '--max-restarts=0', 'train.py']\n"
        "from torch.distributed.run import main\n"
        "main()\n",
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "elastic-train supports" in ln]
    assert lines == [
        f"error: elastic-train supports {compat.TORCH_REQUIREMENT}; the installed torch is 2.5.1: "
        f"install a torch in that range (pip install '{compat.TORCH_REQUIREMENT}')"
    ], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_the_shared_rdzv_store_switch_is_set_once_and_kept_unless_overridden() -> None:
    env: dict[str, str] = {}
    compat.disable_shared_rdzv_store(env)
    assert env == {compat.DISABLE_SHARED_RDZV_STORE: "1"}
    env[compat.DISABLE_SHARED_RDZV_STORE] = "0"
    compat.disable_shared_rdzv_store(env)
    assert env[compat.DISABLE_SHARED_RDZV_STORE] == "0"  # a caller's own choice stands
    compat.disable_shared_rdzv_store(env, override=True)
    assert env[compat.DISABLE_SHARED_RDZV_STORE] == "1"


def test_fsdp2s_module_class_is_found_and_recognises_only_sharded_modules() -> None:
    cls = compat.fsdp_module_class()
    assert cls is not None and cls.__name__ == "FSDPModule"
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not compat.is_sharded_module(plain) and compat.fsdp_modules(plain) == []


# -- the node agent's start-up check, once per installation -------------------------------------------------
_ONCE = (
    "import sys\n"
    "from pathlib import Path\n"
    "from elastic import compat\n"
    "try:\n"
    "    compat.check_torch_once(Path(sys.argv[1]))\n"
    "except compat.TorchCompatError as exc:\n"
    "    print('refused', exc)\n"
    "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
)


def _check_once(cache: Path, pythonpath: Path | None = None) -> str:
    """A fresh interpreter's :func:`compat.check_torch_once` on ``cache``: what it printed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT) if pythonpath is None else f"{pythonpath}:{ROOT}"
    proc = subprocess.run(
        [sys.executable, "-c", _ONCE, str(cache)], capture_output=True, text=True, env=env, timeout=50, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_passed_check_is_recorded_and_the_next_start_on_the_same_torch_skips_importing_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert _check_once(cache) == "torch imported\n"  # checked, and the pass recorded
    records = list(cache.glob("torch-ok-*"))
    assert len(records) == 1 and (cache.stat().st_mode & 0o777) == 0o700
    assert _check_once(cache) == "torch not imported\n"


def test_another_torch_installation_is_checked_again_and_a_refusal_is_never_recorded(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert _check_once(cache) == "torch imported\n"
    fake = tmp_path / "site" / "torch"  # another torch first on the path: one outside the supported range
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '2.16.0'\n")
    (fake / "version.py").write_text("__version__ = '2.16.0'\n")
    for _ in range(2):  # refused each time: the first refusal left no record behind
        out = _check_once(cache, pythonpath=tmp_path / "site")
        assert out.startswith("refused elastic-train supports") and "2.16.0" in out, out
    assert len(list(cache.glob("torch-ok-*"))) == 1


def test_a_record_in_a_directory_others_can_write_is_not_trusted(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert _check_once(cache) == "torch imported\n"
    cache.chmod(0o777)  # anyone could have left the record: the check runs (and nothing is recorded there)
    assert _check_once(cache) == "torch imported\n"
