"""The supported torch range and each private-API shim, on the installed torch.

``scripts/compat.sh`` runs this file (with the rendezvous, store, loop, prefork and checkpoint suites) on
the oldest and the newest torch of the range; CI runs it on both.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

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


def test_rendezvous_state_layout_round_trips_through_pickle_with_the_fields_we_rewrite() -> None:
    state = dynamic_rendezvous._RendezvousState()
    node = dynamic_rendezvous._NodeDesc("127.0.0.1", 42, 0)
    state.participants[node] = 0
    state.last_heartbeats[node] = state.deadline = None  # type: ignore[assignment]
    copy = pickle.loads(pickle.dumps(state))
    for field in compat.STATE_FIELDS:
        assert hasattr(copy, field), field
    assert [(n.addr, n.pid) for n in copy.participants] == [("127.0.0.1", 42)]


def test_the_delay_patch_wraps_torchs_function_once_and_passes_other_calls_through() -> None:
    code = """
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from elastic import compat
calls = []
def make(original):
    def delay(seconds):
        calls.append(seconds)
        original(seconds)
    return delay
compat.patch_rendezvous_delay(make)
first = dr._delay
compat.patch_rendezvous_delay(make)
assert dr._delay is first, "patched twice"
dr._delay(seconds=(0, 0.01))
print(calls)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(0, 0.01)]"


def test_handler_from_backend_applies_the_keep_alive_settings_on_this_torch() -> None:
    from elastic.rendezvous.plugin import EtcdV3RendezvousHandler

    class Backend(dynamic_rendezvous.RendezvousBackend):
        name = "test"

        def get_state(self) -> None:
            return None

        def set_state(self, state: bytes, token: object = None) -> None:
            return None

    store = torch.distributed.HashStore()
    handler = compat.handler_from_backend(
        EtcdV3RendezvousHandler, "run", store, Backend(), 1, 2, "127.0.0.1",
        dynamic_rendezvous.RendezvousTimeout(),
        keep_alive_interval=timedelta(seconds=2), keep_alive_max_attempt=4,
    )  # fmt: skip
    assert isinstance(handler, EtcdV3RendezvousHandler)
    assert handler._settings.keep_alive_interval == timedelta(seconds=2)
    assert handler._settings.keep_alive_max_attempt == 4
    assert compat.handler_node(handler).addr == "127.0.0.1"
    assert compat.handler_state(handler).round == 0
    compat.invalidate_cached_state(handler)


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
