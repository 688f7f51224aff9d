"""The checkpoint benchmark's report (bench/checkpoint_bench.py): its table, its goals' lines and the summary
figures its JSON keeps, from the measurements it took."""

from __future__ import annotations

import statistics
from typing import Any

from _workload import MiB

__all__ = ["print_report", "print_stall", "stall_rows", "stall_summary"]


def stall_summary(r: dict[str, Any]) -> dict[str, Any]:
    """Issue 29's figures of a run: the stall of the steps after a save (straight to the host, device-side) as a
    share of a step, and the warmed first save's blocking time over its second's."""
    med = statistics.median
    step_s = med(r["overlap"]["step_s"])
    stall = med(r["overlap"]["overlap_with_optimizer"]["stall_s"]) / step_s
    dev_stall = med(r["overlap"]["overlap_device_side"]["stall_s"]) / step_s
    warmed = r["warmed_first_save"]
    return {
        "stall_fraction_of_step": stall,
        "goal_stall_le_5pct_of_step": stall <= 0.05,
        "stall_fraction_of_step_device_side": dev_stall,
        "goal_stall_device_side_le_5pct_of_step": dev_stall <= 0.05,
        "first_save_warmed_fraction_of_its_second": warmed["first_blocking_s"] / warmed["second_blocking_s"],
    }


def stall_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's rows of :func:`stall_summary`'s measurements."""
    med = statistics.median
    ov, dev = r["overlap"]["overlap_with_optimizer"], r["overlap"]["overlap_device_side"]
    warmed = r["warmed_first_save"]
    step_s, steps = med(r["overlap"]["step_s"]), r["overlap"]["stall_steps"]
    stall_s, dev_stall_s = med(ov["stall_s"]), med(dev["stall_s"])
    return [
        ("ours async, blocking (1st save, warmed)", f"{warmed['first_blocking_s'] * 1e3:8.1f} ms"),
        (
            "  (its 2nd save; warm-up in the background)",
            f"{warmed['second_blocking_s'] * 1e3:.1f} ms; {warmed['warm_up_s'] * 1e3:.1f} ms",
        ),
        (
            "  (until the device is idle: 1st, 2nd)",
            f"{warmed['first_device_s'] * 1e3:.1f} ms, {warmed['second_device_s'] * 1e3:.1f} ms",
        ),
        ("ours overlap_with=optimizer, blocking", f"{med(ov['blocking_s']) * 1e3:8.1f} ms"),
        (
            "  (save call + optimizer.step wait)",
            f"{med(ov['save_call_s']) * 1e3:.1f} + {med(ov['optimizer_wait_s']) * 1e3:.1f} ms",
        ),
        ("a training step without a save", f"{step_s * 1e3:8.1f} ms"),
        (f"{steps} training steps without a save", f"{med(r['overlap']['steps_alone_s']) * 1e3:8.1f} ms"),
        (f"capture + save + next {steps} steps", f"{med(ov['step_with_save_s']) * 1e3:8.1f} ms"),
        ("stall of the steps after a save", f"{stall_s * 1e3:8.1f} ms ({stall_s / step_s * 100:.1f} % of a step)"),
        ("ours overlap_with=optimizer, device-side", f"{med(dev['blocking_s']) * 1e3:8.1f} ms"),
        (
            f"capture + save + next {steps} steps (device-side)",
            f"{med(dev['step_with_save_s']) * 1e3:8.1f} ms ({dev['device_staged_bytes'] / MiB:.0f} MiB on device)",
        ),
        (
            "stall of the steps after a save (device-side)",
            f"{dev_stall_s * 1e3:8.1f} ms ({dev_stall_s / step_s * 100:.1f} % of a step)",
        ),
    ]


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _stall_line(summary: dict[str, Any]) -> str:
    return (
        f"stall = {summary['stall_fraction_of_step'] * 100:.1f} % of a step, device-side "
        f"{summary['stall_fraction_of_step_device_side'] * 100:.1f} % (goal <= 5 %: "
        f"{_met(summary['goal_stall_le_5pct_of_step'])}, device-side "
        f"{_met(summary['goal_stall_device_side_le_5pct_of_step'])})"
    )


def print_stall(r: dict[str, Any]) -> dict[str, Any]:
    """``--parts stall``: print its rows and the goal; return the summary figures."""
    summary = stall_summary(r)
    for name, value in stall_rows(r):
        print(f"  {name:<42} {value}")
    print(
        f"{_stall_line(summary)}; the warmed first save blocks "
        f"{summary['first_save_warmed_fraction_of_its_second']:.2f}x its second"
    )
    return summary


def print_report(r: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Print the table and the goals; return the summary figures."""
    med = statistics.median
    ours, ov, ld = r["ours"], r["overlap"]["overlap_with_optimizer"], r["load"]
    sync_s, blocking_s, dd_bps = med(r["torch_save"]["blocking_s"]), med(ours["blocking_s"]), med(r["dd_bytes_per_s"])
    write_bps, full_bps = med(ours["write_bytes_per_s"]), med(ours["write_verify_bytes_per_s"])
    load_frac = med(ld["load_fraction_of_read"])
    summary = {
        "blocking_fraction_of_sync_torch_save": blocking_s / sync_s,
        "overlapped_blocking_fraction_of_sync_torch_save": med(ov["blocking_s"]) / sync_s,
        "write_fraction_of_dd": write_bps / dd_bps,
        "write_verify_fraction_of_dd": full_bps / dd_bps,
        "load_verify_fraction_of_read": load_frac,
        **stall_summary(r),
        "first_save_warmed_fraction_of_later": r["warmed_first_save"]["first_blocking_s"] / blocking_s,
        "goal_write_verify_ge_80pct_dd": full_bps / dd_bps >= 0.80,
        "goal_load_verify_ge_80pct_read": load_frac >= 0.80,
    }
    rows = [
        ("dd conv=fsync (write)", f"{dd_bps / MiB:8.0f} MiB/s"),
        ("torch.save sync, blocking", f"{sync_s * 1e3:8.1f} ms"),
        ("torch.save + fsync, blocking", f"{med(r['torch_save']['blocking_with_fsync_s']) * 1e3:8.1f} ms"),
        ("ours async, blocking", f"{blocking_s * 1e3:8.1f} ms"),
        ("  (until the device is idle)", f"{med(ours['blocking_device_s']) * 1e3:8.1f} ms"),
        ("ours async, blocking (1st save)", f"{ours['first_blocking_s'] * 1e3:8.1f} ms"),
    ]
    if r["pinned_copy_s"]:
        rows.append(("pinned device->host copy, same bytes", f"{med(r['pinned_copy_s']) * 1e3:8.1f} ms"))
    if r["device_copy_s"]:
        rows.append(("device->device copy, same bytes", f"{med(r['device_copy_s']) * 1e3:8.1f} ms"))
    rows += stall_rows(r)
    rows += [
        ("ours background write (data + commit)", f"{write_bps / MiB:8.0f} MiB/s"),
        (f"ours verify after write ({ours['verify_mode']})", f"{med(ours['verify_s']) * 1e3:8.1f} ms"),
        ("ours write + verify", f"{full_bps / MiB:8.0f} MiB/s ({full_bps / dd_bps * 100:.0f} % of dd)"),
        ("ours blocking=True save", f"{ours['blocking_save_s'] * 1e3:8.1f} ms"),
        ("dd read of the snapshot's files", f"{ld['bytes'] / med(ld['dd_read_s']) / MiB:8.0f} MiB/s"),
        (
            "ours load + verify to device",
            f"{ld['bytes'] / med(ld['load_verify_s']) / MiB:8.0f} MiB/s ({load_frac * 100:.0f} % of dd)",
        ),
        ("  then load_state_dict (model + optimizer)", f"{med(ld['apply_s']) * 1e3:8.1f} ms"),
        ("dcp.async_save, blocking", f"{med(r['dcp_async_save']['blocking_s']) * 1e3:8.1f} ms"),
        ("dcp.async_save, until done", f"{med(r['dcp_async_save']['total_s']) * 1e3:8.1f} ms"),
        ("GIL-bound loop during save", f"{r['interference']['ratio'] * 100:8.0f} % of its rate alone"),
    ]
    s3 = r["s3"]
    if s3 is not None:
        rows += [
            ("S3 raw s3fs PUT", f"{med(s3['raw_put_bytes_per_s']) / MiB:8.0f} MiB/s"),
            ("S3 ours save", f"{med(s3['save_bytes_per_s']) / MiB:8.0f} MiB/s"),
            ("S3 ours async, blocking", f"{med(s3['blocking_s']) * 1e3:8.1f} ms"),
            ("S3 ours load (verify + decode)", f"{s3['load_bytes_per_s'] / MiB:8.0f} MiB/s"),
        ]
    for name, value in rows:
        print(f"  {name:<42} {value}")
    print(
        f"medians over {repeats} interleaved rounds; load average at the end: {r['machine']['load_average_after']:.1f}"
    )
    print(
        f"{_stall_line(summary)}; write + verify = "
        f"{summary['write_verify_fraction_of_dd'] * 100:.0f} % of dd (goal >= 80 %: "
        f"{_met(summary['goal_write_verify_ge_80pct_dd'])}); load + verify = {load_frac * 100:.0f} % of the read "
        f"(goal >= 80 %: {_met(summary['goal_load_verify_ge_80pct_read'])})"
    )
    return summary
