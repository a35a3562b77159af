"""A real Prometheus server for tests: Debian's ``prometheus`` (``make test`` installs it as
root), a generated config scraping the given endpoints, PromQL through its HTTP API, and
``promtool check metrics`` on an endpoint's raw text."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pagedserve.dev.procs import _stop, free_port, wait_until


def available() -> bool:
    return shutil.which("prometheus") is not None and shutil.which("promtool") is not None


def http_get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def promtool_check(text: str) -> tuple[int, str]:
    """``promtool check metrics`` on exposition text (stdin): its exit code and what it said."""
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False, timeout=30
    )
    return out.returncode, (out.stdout + out.stderr).strip()


class PrometheusServer:
    """``prometheus`` on a free loopback port scraping ``jobs`` (job name -> ``host:port`` list)
    every ``interval``, with its TSDB and log under ``workdir``."""

    def __init__(self, jobs: dict[str, list[str]], workdir: Path, interval: str = "1s", timeout: float = 60) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = [t for ts in jobs.values() for t in ts]
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
            ],
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        try:
            wait_until(self.ready, timeout, "prometheus", self.proc)
        except BaseException:
            self.stop()
            raise

    def ready(self) -> bool:
        try:
            return http_get(f"{self.url}/-/ready", timeout=1).startswith(b"Prometheus Server is Ready")
        except (OSError, urllib.error.URLError):
            return False

    def _api(self, path: str, **params: str) -> object:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        body = json.loads(http_get(url))
        assert body["status"] == "success", body
        return body["data"]

    def active_targets(self) -> list[dict]:
        return self._api("targets", state="active")["activeTargets"]  # type: ignore[index]

    def all_up(self) -> bool:
        """Every configured target scraped successfully at least once."""
        up = {t["labels"]["instance"] for t in self.active_targets() if t["health"] == "up"}
        return up >= set(self.targets)

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant vector: (labels, value) per series; a scalar as one series without labels."""
        data = self._api("query", query=promql)
        if data["resultType"] == "scalar":  # type: ignore[index]
            return [({}, float(data["result"][1]))]  # type: ignore[index]
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]  # type: ignore[index]

    def value(self, promql: str) -> float | None:
        """The value of a query that yields at most one series (None: no series)."""
        result = self.query(promql)
        assert len(result) <= 1, f"{promql} yields {len(result)} series: {result}"
        return result[0][1] if result else None

    def settle(
        self, expected: dict[str, object], timeout: float = 30, read: Callable[[str], object] | None = None
    ) -> dict[str, object]:
        """Poll each query until it reads as expected or ``timeout`` passes; what each read last.
        Scrapes of the targets land at different times, so each query gets until the deadline."""
        read = read or self.value
        deadline = time.monotonic() + timeout
        got: dict[str, object] = {}
        while True:
            for q, want in expected.items():
                if q not in got or got[q] != want:
                    got[q] = read(q)
            if got == expected or time.monotonic() > deadline:
                return got
            time.sleep(0.25)

    def stop(self) -> None:
        _stop(self.proc)
