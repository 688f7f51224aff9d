"""Regenerate docs/img/dashboard.png: the dashboard's page of a running job that lost a node.

Starts a whole service on this machine (etcd, a controller with tokens, three agents; LocalServiceCluster, as
the tests do), submits examples/demo_job.py on 2..3 nodes, SIGKILLs one agent once the job trains at world size
3, waits until it trains on at world size 2, then opens the job's page in headless Chromium signed in with a read
token (its charts start at the job's first report: the controller keeps the series) and saves a screenshot of
the page. Paths of this machine (the repository, the cluster's work directory) are shown as ``/opt/etrain`` and
``/shared`` in the picture. About a minute and a half on 2 cores.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png] [--keep-workdir]

Needs Playwright (``pip install -e .[dev]``) and Debian's Chromium at /usr/bin/chromium (``scripts/setup.sh``);
it never downloads a browser.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic.testing.wait import wait_for  # noqa: E402
from service.client import ApiClient, ApiError  # noqa: E402
from service.testing.cluster import LocalServiceCluster  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
SPEC: dict[str, Any] = {
    "name": "resnet-demo",
    "entrypoint": "demo_job.py",
    "working_dir": str(REPO / "examples"),
    "args": ["--steps", "2000", "--checkpoint-every", "100", "--step-time", "0.05"],
    "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
    "min_nodes": 2,
    "max_nodes": 3,
    "rendezvous": {"last_call_timeout": 1},
    "restart_policy": {"backoff_initial": 1},
}


#: the page's text with each [path, shown as] replaced, now and after each refresh of the page (an observer)
_HIDE_PATHS = """(pairs) => {
  const hide = () => {
    const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    for (let node = walk.nextNode(); node; node = walk.nextNode()) {
      let text = node.nodeValue;
      for (const [path, shown] of pairs) text = text.split(path).join(shown);
      if (text !== node.nodeValue) node.nodeValue = text;
    }
  };
  hide();
  new MutationObserver(hide).observe(document.body, { subtree: true, childList: true, characterData: true });
}"""


def start_controller(cluster: LocalServiceCluster, admin: str, reader: str) -> ApiClient:
    """The cluster's controller with a tokens file: an admin and a read token."""
    return cluster.start_controller(tokens={admin: "admin", reader: "read"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "dashboard.png")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--keep-workdir", action="store_true", help="keep the cluster's logs and checkpoints")
    args = parser.parse_args()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("playwright is not installed: pip install -e .[dev]", file=sys.stderr)
        return 2
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: apt-get install chromium (scripts/setup.sh does)", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="etrain-dashboard-"))
    admin, reader = secrets.token_hex(16), secrets.token_hex(16)
    cluster = LocalServiceCluster(workdir)
    try:
        api = start_controller(cluster, admin, reader)
        for name in ("node-1", "node-2", "node-3"):
            cluster.start_agent(name)
        wait_for(lambda: len(api.nodes()) == 3, 60, 0.5, what="3 nodes", retry_on=(ApiError,))
        job_id = api.submit(SPEC)["id"]
        print(f"job {job_id} submitted; dashboard at {cluster.url}/ui/#/jobs/{job_id}")

        def at(size: int, steps: int) -> bool:
            job = api.job(job_id)
            return job["world_size"]["current"] == size and (job["progress"]["step"] or 0) >= steps

        wait_for(lambda: at(3, 150), 120, 0.5, what="world size 3 and 150 steps", retry_on=(ApiError,))
        victim = api.job(job_id)["nodes"][-1]
        cluster.kill_agent(victim)
        print(f"killed the agent of {victim}")
        wait_for(lambda: api.job(job_id)["state"] == "running" and at(2, 0), 90, 0.5,
                 what="the job to train on at world size 2", retry_on=(ApiError,))  # fmt: skip
        time.sleep(12)  # a few more reports at world size 2
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = browser.new_page(viewport={"width": args.width, "height": 1000}, device_scale_factor=1)
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{cluster.url}/ui/#/jobs/{job_id}")  # opened now: the charts still start at the job's start
            page.fill("#token-input", reader)
            page.click("#token-submit")
            page.wait_for_selector("#job-head h1")
            page.wait_for_function("() => document.querySelector('#world-size-current')?.textContent === '2'")
            page.wait_for_function("() => Number(document.querySelector('#svg-loss')?.dataset.points) >= 20")
            time.sleep(4.5)  # two more refreshes: the logs and events in place
            page.evaluate(_HIDE_PATHS, [[str(workdir.resolve()), "/shared"], [str(workdir), "/shared"],
                                        [str(REPO), "/opt/etrain"]])  # fmt: skip
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out), full_page=True)
            browser.close()
        print(f"wrote {args.out}" + (f"; console errors: {errors}" if errors else ""))
        return 1 if errors else 0
    finally:
        cluster.stop()
        if args.keep_workdir:
            print(f"cluster files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
