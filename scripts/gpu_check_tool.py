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
import statistics
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


def _bundle_mismatch(bundle: Path) -> str | None:
    """Why the bundle cannot serve this interpreter (built for another Python), or None; its commit is printed."""
    manifest = bundle / "MANIFEST.txt"
    if not manifest.is_file():
        return None
    text = manifest.read_text(errors="replace")
    commit = re.search(r"^commit: (.*)$", text, re.M)
    print(f"bundle of commit {commit.group(1) if commit else 'unknown'}")
    built = re.search(r"^python: (\d+\.\d+)", text, re.M)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if built and built.group(1) != here:
        return (f"the bundle in {bundle} was built for Python {built.group(1)}, this interpreter is {here}: "
                f"rebuild it with scripts/gpu_bundle.sh --python-version {here}")  # fmt: skip
    return None


def install(bundle: Path, site: Path) -> int:
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if not wheels:
        print(f"no wheels in {bundle / 'wheels'}: run scripts/gpu_bundle.sh where there is network", file=sys.stderr)
        return 1
    mismatch = _bundle_mismatch(bundle)
    if mismatch:
        print(mismatch, file=sys.stderr)
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
        out = f"stall {s['stall_fraction_of_step']:.1%} of a step"
        if "blocking_fraction_of_sync_torch_save" in s:  # the full run (not --parts stall)
            out = f"blocking {s['blocking_fraction_of_sync_torch_save']:.3f} of torch.save, " + out
        if "stall_fraction_of_step_device_side" in s:
            out += f" (device-side {s['stall_fraction_of_step_device_side']:.1%})"
        step = (r.get("overlap") or {}).get("step_s")
        if step:
            out += f" of {statistics.median(step) * 1e3:.1f} ms"
        warmed = r.get("warmed_first_save")
        if warmed:
            out += (f"; 1st save warmed {warmed['first_blocking_s'] * 1e3:.1f} ms, its 2nd "
                    f"{warmed['second_blocking_s'] * 1e3:.1f} ms")  # fmt: skip
        return out + f", {_size(r['state_bytes'])}"
    if kind == "overhead":
        out = f"elastic/DDP {r['ratio_median']:.3f}"
        if "live_vs_elastic_ratio" in r:  # the live row (--with-live): live's own all-reduce vs DDP, same loop
            out += f", live/DDP {r['live_vs_elastic_ratio']:.3f}"
        out += f" (step rates, a snapshot every {r['checkpoint_every_steps']} steps)"
        intervals = r.get("by_interval") or {}
        if "0" in intervals:  # issue 29's goal: >= 0.95 of the loop's own rate without snapshots
            kept = [f"{row['elastic_fraction_of_no_checkpoint']:.3f} every {row.get('every', label)}"
                    + ("" if "disk_absorbs" not in row else " (absorbed)" if row["disk_absorbs"] else " (not absorbed)")
                    for label, row in intervals.items() if label != "0"]  # fmt: skip
            if kept:
                out += f"; elastic keeps {', '.join(kept)} of its no-snapshot rate"
            out += f"; elastic/DDP without snapshots {intervals['0']['ratio_median']:.3f}"
        attribution = (r.get("attribution") or {}).get(f"elastic/{r['checkpoint_every_steps']}")
        if attribution:  # issue 29, part 3: where the snapshot's cost goes (bench/_attribution.py)
            m = attribution["median"]
            out += (f"; per snapshot {m['loss_ms']:.0f} ms = save's steps {m['near_ms']:.0f} + rest {m['far_ms']:.0f}, "
                    f"GC {m['gc_ms']:+.0f}, bg CPU {m['background_cpu_ms']:+.0f}")  # fmt: skip
        return out
    raise SystemExit(f"unknown figure kind {kind}")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 / 4 else f"{nbytes / 2**20:.1f} MiB"


#: the first save "blocks no longer than later ones" within this factor (one save's run-to-run spread)
FIRST_SAVE_TOLERANCE = 1.10


def goals(results: dict[str, Any]) -> list[str]:
    """Issue 29's goals as this run measured them (lines to print), from the stall step's results (else the
    checkpoint step's) and the overhead step's."""
    lines: list[str] = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    ck = results.get("stall") or results.get("checkpoint")  # the stall step runs at issue 29's size
    if ck and "summary" in ck:
        s, step_ms = ck["summary"], statistics.median(ck["overlap"]["step_s"]) * 1e3
        size = f"{_size(ck['state_bytes'])}, a {step_ms:.1f} ms step"
        if "stall_fraction_of_step_device_side" in s:
            dev = s["stall_fraction_of_step_device_side"]
            lines.append(f"next-step stall, device-side ({size}): {dev:.1%} of a step (goal <= 5 %: "
                         f"{verdict(s['goal_stall_device_side_le_5pct_of_step'])}); staged straight to the host: "
                         f"{s['stall_fraction_of_step']:.1%}")  # fmt: skip
        w = ck.get("warmed_first_save")
        if w:
            ratio = w["first_blocking_s"] / w["second_blocking_s"]
            lines.append(f"first save, warmed: blocks {w['first_blocking_s'] * 1e3:.1f} ms, a later one "
                         f"{w['second_blocking_s'] * 1e3:.1f} ms ({ratio:.2f}x; goal no longer, within "
                         f"{FIRST_SAVE_TOLERANCE:.2f}x: {verdict(ratio <= FIRST_SAVE_TOLERANCE)})")  # fmt: skip
    lo = results.get("overhead")
    intervals = (lo or {}).get("by_interval") or {}
    if "0" in intervals:
        disk = lo.get("disk")
        for label, row in intervals.items():
            if label == "0":
                continue
            kept, absorbed = row["elastic_fraction_of_no_checkpoint"], row.get("disk_absorbs")
            where = "" if not disk else (f", {_size(disk['state_bytes'])}, dd "
                                         f"{disk['dd_write_bytes_per_s'] / 2**20:.0f} MiB/s")  # fmt: skip
            if absorbed is None or "goal_met" not in row:
                tail = ""
            elif absorbed:
                tail = f"; the disk absorbs it: goal >= 0.95: {verdict(row['goal_met'])}"
            else:
                tail = "; the disk does not absorb it: reported beside, the goal is about an interval it absorbs"
            lines.append(f"a snapshot every {row.get('every', label)} steps{where}: the elastic loop keeps {kept:.3f} "
                         f"of its no-snapshot rate{tail}")  # fmt: skip
    return lines


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
    goal_lines = goals({r["step"]: r["result"] for r in rows if isinstance(r.get("result"), dict)})
    (outdir / "summary.json").write_text(
        json.dumps({"steps": rows, "failed": failed, "goals": goal_lines}, indent=2) + "\n"
    )
    width = max([len(r["step"]) for r in rows] + [4])
    print(f"\n{'step':<{width}}  status  seconds  key figure")
    for r in rows:
        print(f"{r['step']:<{width}}  {r['status']:<6}  {r['seconds']:7.1f}  {r['figure']}")
    if goal_lines:
        print("\nissue 29's goals, as measured here:")
        for line in goal_lines:
            print(f"  {line}")
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
