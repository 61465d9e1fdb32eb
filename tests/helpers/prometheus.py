"""A real Prometheus server for tests: scrape given targets every second, query over HTTP."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from helpers.processes import free_port


class PrometheusServer:
    def __init__(self, targets: dict[str, str], workdir: Path) -> None:
        """targets: job-instance name -> host:port of a /metrics endpoint."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (apt-get install prometheus)")
        config = workdir / "prometheus.yml"
        scrape = [{"job_name": "tandem", "scrape_interval": "1s", "scrape_timeout": "1s",
                   "static_configs": [{"targets": [address], "labels": {"process": name}}
                                      for name, address in targets.items()]}]
        config.write_text(json.dumps({"global": {"scrape_interval": "1s",
                                                 "evaluation_interval": "1s"},
                                      "scrape_configs": scrape}))
        self.port = free_port()
        self.log_path = workdir / "prometheus.log"
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 60.0) -> list[dict]:
        """Poll until the query returns a non-empty result (first scrapes take seconds)."""
        deadline = time.monotonic() + timeout
        last_error = None
        while time.monotonic() < deadline:
            try:
                result = self.query(expr)
                if result:
                    return result
            except OSError as exc:  # not listening yet
                last_error = exc
            time.sleep(0.5)
        raise AssertionError(f"no result for {expr!r} after {timeout} s ({last_error}); "
                             f"prometheus log:\n{self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
