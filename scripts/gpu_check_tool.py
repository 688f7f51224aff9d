"""Helpers of ``scripts/gpu_check.sh`` (standard library only: it runs before the bundle is installed).

    python scripts/gpu_check_tool.py install BUNDLE SITE   # the bundle's wheels into SITE (pip --no-deps --target)
    python scripts/gpu_check_tool.py junit FILE            # "3 passed, 0 failed, 1 skipped" from pytest's junit XML
    python scripts/gpu_check_tool.py figure KIND FILE      # a benchmark's key figure from its JSON
    python scripts/gpu_check_tool.py summary OUTDIR        # the table of OUTDIR/steps.tsv, OUTDIR/summary.json

``install`` puts every wheel of ``BUNDLE/wheels`` into ``SITE`` except those whose distribution this interpreter
already has at the same or a newer version (the GPU image's numpy, say, is kept rather than shadowed; the
project's own wheel is always installed, for its entry points). ``GPU_CHECK_INSTALL_ALL=1`` installs them all.
``summary`` exits 1 when a step failed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Any

PROJECT = "elastic-train"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    """A rough ordering of release versions (numbers compared as numbers); enough to tell older from newer."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"[.+-]", version))


def install(bundle: Path, site: Path) -> int:
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if not wheels:
        print(f"no wheels in {bundle / 'wheels'}: run scripts/gpu_bundle.sh where there is network", file=sys.stderr)
        return 1
    chosen, kept = [], []
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if (
            have is not None
            and _canonical(name) != PROJECT
            and not os.environ.get("GPU_CHECK_INSTALL_ALL")
            and _version_key(have) >= _version_key(version)
        ):
            kept.append(f"{name} {have}")
        else:
            chosen.append(wheel)
    if kept:
        print(f"kept this interpreter's: {', '.join(kept)}")
    print(f"installing into {site}: {', '.join(w.name.split('-')[0] + ' ' + w.name.split('-')[1] for w in chosen)}")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--upgrade",
           "--disable-pip-version-check", "--target", str(site), *map(str, chosen)]  # fmt: skip
    rc = subprocess.run(cmd).returncode
    if rc == 0:
        print(f"installed {len(chosen)} wheels, kept {len(kept)} of the interpreter's distributions")
    return rc


def junit(path: Path) -> str:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return f"{passed} passed, {count['failures'] + count['errors']} failed, {count['skipped']} skipped"


def figure(kind: str, path: Path) -> str:
    r = json.loads(path.read_text())
    if kind == "live":
        return (f"recovery {r.get('recovery_s')} s (kill at step {r.get('killed_at_step')}, lost "
                f"{r.get('lost_steps')}), {r.get('committed_steps')}/{r.get('expected_steps')} steps")  # fmt: skip
    if kind == "checkpoint":
        s = r["summary"]
        return (f"blocking {s['blocking_fraction_of_sync_torch_save']:.3f} of torch.save, "
                f"stall {s['stall_fraction_of_step']:.1%} of a step"
                + (f" (device-side {s['stall_fraction_of_step_device_side']:.1%})"
                   if "stall_fraction_of_step_device_side" in s else "")
                + f", {r['state_bytes'] / 2**30:.2f} GiB")  # fmt: skip
    if kind == "overhead":
        out = f"elastic/DDP {r['ratio_median']:.3f}"
        if "live_vs_elastic_ratio" in r:  # the live row (--with-live): live's own all-reduce vs DDP, same loop
            out += f", live/DDP {r['live_vs_elastic_ratio']:.3f}"
        out += f" (step rates, a snapshot every {r['checkpoint_every_steps']} steps)"
        intervals = r.get("by_interval") or {}
        every = intervals.get(str(r["checkpoint_every_steps"])) or {}
        if "0" in intervals and "elastic_fraction_of_no_checkpoint" in every:  # issue 29's goal: >= 0.95
            out += (f"; elastic keeps {every['elastic_fraction_of_no_checkpoint']:.3f} of its no-snapshot rate; "
                    f"elastic/DDP without snapshots {intervals['0']['ratio_median']:.3f}")  # fmt: skip
        attribution = (r.get("attribution") or {}).get(f"elastic/{r['checkpoint_every_steps']}")
        if attribution:  # issue 29, part 3: where the snapshot's cost goes (bench/_attribution.py)
            m = attribution["median"]
            out += (f"; per snapshot {m['loss_ms']:.0f} ms = save's steps {m['near_ms']:.0f} + rest {m['far_ms']:.0f}, "
                    f"GC {m['gc_ms']:+.0f}, bg CPU {m['background_cpu_ms']:+.0f}")  # fmt: skip
        return out
    raise SystemExit(f"unknown figure kind {kind}")


def summary(outdir: Path) -> int:
    rows = []
    for line in (outdir / "steps.tsv").read_text().splitlines():
        step, status, seconds, fig, result = (line.split("\t") + [""] * 5)[:5]
        row: dict[str, Any] = {"step": step, "status": status, "seconds": float(seconds), "figure": fig}
        if result and Path(result).is_file():
            try:
                row["result"] = json.loads(Path(result).read_text())
            except json.JSONDecodeError:
                row["result_file"] = result
        elif result:
            row["result_file"] = result
        rows.append(row)
    failed = [r["step"] for r in rows if r["status"] == "FAIL"]
    (outdir / "summary.json").write_text(json.dumps({"steps": rows, "failed": failed}, indent=2) + "\n")
    width = max([len(r["step"]) for r in rows] + [4])
    print(f"\n{'step':<{width}}  status  seconds  key figure")
    for r in rows:
        print(f"{r['step']:<{width}}  {r['status']:<6}  {r['seconds']:7.1f}  {r['figure']}")
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all steps passed or skipped'}; "
          f"details in {outdir / 'summary.json'}")  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "install":
        return install(Path(argv[1]), Path(argv[2]))
    if len(argv) == 2 and argv[0] == "junit":
        print(junit(Path(argv[1])))
        return 0
    if len(argv) == 3 and argv[0] == "figure":
        print(figure(argv[1], Path(argv[2])))
        return 0
    if len(argv) == 2 and argv[0] == "summary":
        return summary(Path(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
