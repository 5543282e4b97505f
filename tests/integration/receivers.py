"""Real Remote-Write receivers on loopback: start, wait, query, scan logs, stop.

The one place that manages Prometheus and VictoriaMetrics processes for the integration tests
(``conftest.py``) and the end-to-end benchmark (``benchmarks/e2e.py``). Each receiver gets a free
127.0.0.1 port, a temporary data directory and a log file; nothing here depends on hfsampler, so
the harness can check the package rather than itself. A hand-rolled Remote-Write encoder (raw
protobuf + snappy) lets the fixtures be verified without the package's encoder.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]

# Where .ci/fetch-prometheus3 unpacks Debian sid's prometheus package (3.x).
_CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
PROMETHEUS3_CACHE = _CACHE_HOME / "hfsampler-ci" / "prometheus3"

# Debian's binaries by default; a path or name in these variables runs another build.
PROMETHEUS_BIN = os.environ.get("HFSAMPLER_PROMETHEUS_BIN", "prometheus")  # bookworm's, 2.42
PROMETHEUS3_BIN = os.environ.get(
    "HFSAMPLER_PROMETHEUS3_BIN", str(PROMETHEUS3_CACHE / "root" / "usr" / "bin" / "prometheus")
)
VICTORIA_METRICS_BIN = os.environ.get("HFSAMPLER_VICTORIA_METRICS_BIN", "victoria-metrics")

# Every receiver the push tests run against, by the name the fixtures give it (and test ids show).
RECEIVER_NAMES = ("prometheus-2", "prometheus-3", "victoria-metrics")


@dataclass(frozen=True)
class PrometheusBuild:
    """One Prometheus major version the Prometheus tests run against."""

    name: str  # in test ids, receiver names and data directory names
    binary: str
    major: int
    how_to_get: str


# Native histograms stored, and scrapes asking for the protobuf format first (2.42 and 3.x alike).
NATIVE_HISTOGRAMS_FLAG = "--enable-feature=native-histograms"

# Prometheus 3 takes Remote-Write 1.0 and 2.0 by default (3.5.3); with this flag, 1.0 only.
ACCEPT_RW1_ONLY_FLAG = (
    "--web.remote-write-receiver.accepted-protobuf-messages=prometheus.WriteRequest"
)

PROMETHEUS_BUILDS = {
    build.name: build
    for build in (
        PrometheusBuild(
            "prometheus-2",
            PROMETHEUS_BIN,
            2,
            "install Debian's prometheus package "
            "(apt-get install --no-install-recommends prometheus) or set HFSAMPLER_PROMETHEUS_BIN",
        ),
        PrometheusBuild(
            "prometheus-3",
            PROMETHEUS3_BIN,
            3,
            "run .ci/fetch-prometheus3 (unpacks Debian sid's prometheus into a cache) "
            "or set HFSAMPLER_PROMETHEUS3_BIN",
        ),
    )
}

# What a receiver logs when it rejects or drops pushed samples (checked case-insensitively):
# Prometheus 2.x logs ``level=warn``, 3.x (log/slog) ``level=WARN``; VictoriaMetrics ``\twarn\t``.
LOG_PROBLEM_RE = re.compile(
    r"out.of.order|out.of.bounds|duplicate|too old|err=|level=(error|warn)|\t(error|warn)\t|error",
    re.IGNORECASE,
)

Labels = tuple[tuple[str, str], ...]  # sorted, without __name__


class ReceiverError(RuntimeError):
    """A receiver did not start, answered an error, or exited early."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def binary_path(name: str) -> str | None:
    """The receiver binary: a path as given, else on PATH or in /usr/bin (Debian's); or None."""
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    debian = f"/usr/bin/{name}"
    return shutil.which(name) or (debian if os.access(debian, os.X_OK) else None)


# --------------------------------------------------------------------------------------------
# Minimal Remote-Write 1.0 encoder (prometheus/prompb types.proto, remote.proto), for self-tests.


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 as two's complement, like protobuf
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_write_request(
    series: Iterable[tuple[str, Mapping[str, str], Sequence[tuple[int, float]]]],
) -> bytes:
    """Protobuf ``WriteRequest`` for ``(name, labels, [(timestamp_ms, value), ...])`` series."""
    out = bytearray()
    for name, labels, samples in series:
        ts = bytearray()
        for key, text in sorted({"__name__": name, **labels}.items()):
            label = _len_field(1, key.encode()) + _len_field(2, text.encode())
            ts += _len_field(1, label)
        for timestamp_ms, number in samples:
            sample = b"\x09" + struct.pack("<d", number) + b"\x10" + _varint(timestamp_ms)
            ts += _len_field(2, sample)
        out += _len_field(1, bytes(ts))
    return bytes(out)


def snappy_block(data: bytes) -> bytes:
    """Snappy block format, as Remote-Write requires (not the framed stream format)."""
    import snappy

    compressed: bytes = snappy.compress(data)
    return compressed


# --------------------------------------------------------------------------------------------
# HTTP


def http_get_json(
    url: str,
    params: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
    timeout_s: float = 10.0,
) -> Any:
    """GET ``url`` with query ``params`` and return the parsed JSON body; raise on non-2xx."""
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            body = exc.read().decode(errors="replace")
        raise ReceiverError(f"GET {url}: HTTP {exc.code}: {body[:500]}") from None


def http_get_text(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    """GET ``url``; return (status, body). Connection errors raise ``OSError``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode(errors="replace")


def wait_http(
    url: str,
    timeout_s: float = 30.0,
    proc: subprocess.Popen[bytes] | None = None,
) -> str:
    """Poll ``url`` until it answers 200 and return the body (e.g. a spawned CLI's /metrics).

    Raises ``ReceiverError`` on timeout, or at once if ``proc`` (the server) exits first.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if proc is not None and proc.poll() is not None:
            raise ReceiverError(f"{url}: the server exited with {proc.returncode} first")
        try:
            status, body = http_get_text(url, timeout_s=1.0)
            if status == 200:
                return body
            last = f"HTTP {status}"
        except OSError as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise ReceiverError(f"{url} not answering 200 after {timeout_s:g} s ({last})")
        time.sleep(0.05)


def push(write_url: str, body: bytes, timeout_s: float = 10.0) -> tuple[int, str]:
    """POST an uncompressed ``WriteRequest`` the way Remote-Write 1.0 senders do."""
    req = urllib.request.Request(
        write_url,
        data=snappy_block(body),
        method="POST",
        headers={
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "User-Agent": "hfsampler-tests",
            "X-Prometheus-Remote-Write-Version": "0.1.0",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode(errors="replace")


# --------------------------------------------------------------------------------------------
# Receivers


@dataclass
class Receiver:
    """A running receiver process: its URLs, query helpers and log."""

    name: str
    port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    # Subclasses set these.
    ready_path: str = "/"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def write_url(self) -> str:
        """Where Remote-Write requests go."""
        return f"{self.base_url}/api/v1/write"

    # -- lifecycle ------------------------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the process and wait until it answers its readiness endpoint."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            start_new_session=True,  # a Ctrl-C in the terminal is the harness's to forward
        )
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise ReceiverError(
                    f"{self.name} exited with {code} before it was ready; log:\n"
                    + self.log_text()[-3000:]
                )
            try:
                status, _ = http_get_text(self.base_url + self.ready_path, timeout_s=1.0)
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ReceiverError(
                    f"{self.name} not ready after {timeout_s:.0f} s; log:\n"
                    + self.log_text()[-3000:]
                )
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and close the log. Idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Receiver:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- log --------------------------------------------------------------------------------------

    def log_text(self) -> str:
        """Everything the process has written to stdout and stderr so far."""
        if self._log_file is not None:
            self._log_file.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_problems(self, since: int = 0) -> list[str]:
        """Log lines (from byte-ish offset ``since`` of ``log_text()``) reporting rejected data."""
        return [
            line for line in self.log_text()[since:].splitlines() if LOG_PROBLEM_RE.search(line)
        ]

    # -- queries ----------------------------------------------------------------------------------

    def api(
        self,
        path: str,
        params: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        timeout_s: float = 10.0,
    ) -> Any:
        """GET ``base_url + path`` and return the parsed JSON (Prometheus API envelope checked)."""
        body = http_get_json(self.base_url + path, params, timeout_s)
        if isinstance(body, dict) and body.get("status") not in (None, "success"):
            raise ReceiverError(f"{self.name} {path} {params}: {body}")
        return body

    def query(self, promql: str, time_s: float | None = None) -> list[dict[str, Any]]:
        """``/api/v1/query``: the ``data.result`` list."""
        params: dict[str, Any] = {"query": promql}
        if time_s is not None:
            params["time"] = f"{time_s:.3f}"
        result: list[dict[str, Any]] = self.api("/api/v1/query", params)["data"]["result"]
        return result

    def query_range(
        self, promql: str, start_s: float, end_s: float, step_s: float
    ) -> list[dict[str, Any]]:
        """``/api/v1/query_range``: the ``data.result`` list."""
        params = {
            "query": promql,
            "start": f"{start_s:.3f}",
            "end": f"{end_s:.3f}",
            "step": f"{step_s:g}",
        }
        result: list[dict[str, Any]] = self.api("/api/v1/query_range", params)["data"]["result"]
        return result

    def series(
        self, match: str | Sequence[str], start_s: float | None = None, end_s: float | None = None
    ) -> list[dict[str, str]]:
        """``/api/v1/series``: one label dict (with ``__name__``) per matching series."""
        matches = [match] if isinstance(match, str) else list(match)
        params: list[tuple[str, Any]] = [("match[]", m) for m in matches]
        if start_s is not None:
            params.append(("start", f"{start_s:.3f}"))
        if end_s is not None:
            params.append(("end", f"{end_s:.3f}"))
        result: list[dict[str, str]] = self.api("/api/v1/series", params)["data"]
        return result

    def raw_samples(
        self, selector: str, start_s: float, end_s: float, keep_stale: bool = False
    ) -> dict[Labels, list[tuple[int, float]]]:
        """Every stored sample of ``selector`` in ``(start_s, end_s]``, exact ms timestamps.

        Keys are the series' labels, sorted, with ``__name__`` included; samples are sorted by time.
        Uses a range-vector selector evaluated at ``end_s``, which returns raw samples. Staleness
        markers are left out (Prometheus never returns them here; ``keep_stale`` is for VM, which
        can, as NaN).
        """
        self.flush()
        window_s = max(1, int(end_s - start_s + 0.999))
        result = self.query(f"{selector}[{window_s}s]", time_s=end_s)
        out: dict[Labels, list[tuple[int, float]]] = {}
        for item in result:
            key = tuple(sorted(item["metric"].items()))
            samples = [(round(float(ts) * 1000), float(v)) for ts, v in item["values"]]
            out[key] = sorted(s for s in samples if s[0] > start_s * 1000)
        return out

    def flush(self) -> None:
        """Make everything accepted so far visible to queries."""

    def wait_for(
        self,
        promql: str,
        timeout_s: float = 15.0,
        min_results: int = 1,
        time_s: float | None = None,
    ) -> list[dict[str, Any]]:
        """Poll an instant query until it returns at least ``min_results`` series."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.flush()
            result = self.query(promql, time_s)
            if len(result) >= min_results or time.monotonic() > deadline:
                return result
            time.sleep(0.1)


@dataclass
class Prometheus(Receiver):
    """Prometheus 2.x or 3.x with the Remote-Write receiver on and no scrape jobs (unless given).

    The flags below mean the same in both. Differences a test may meet: 3.x logs with log/slog
    (``time=... level=WARN msg=...``), limits a decoded Remote-Write body to 32 MiB, allows UTF-8
    metric and label names, and its range selectors leave out a sample exactly on the left edge.
    """

    scrape_configs: list[dict[str, Any]] = field(default_factory=list)
    ready_path: str = "/-/ready"
    binary: str = PROMETHEUS_BIN
    extra_flags: list[str] = field(default_factory=list)
    rule_files: list[str] = field(default_factory=list)  # evaluated every second

    def command(self) -> list[str]:
        config = self.data_dir / "prometheus.yml"
        settings: dict[str, Any] = {"scrape_interval": "15s"}
        if self.rule_files:
            settings["evaluation_interval"] = "1s"
        # JSON is YAML: no dependency needed to write the config.
        config.write_text(
            json.dumps(
                {
                    "global": settings,
                    "rule_files": self.rule_files,
                    "scrape_configs": self.scrape_configs,
                }
            )
        )
        return [
            binary_path(self.binary) or self.binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-remote-write-receiver",
            "--storage.tsdb.retention.time=1d",
            "--log.level=info",
            *self.extra_flags,
        ]

    def version(self) -> str:
        """The running server's version, from ``/api/v1/status/buildinfo`` (e.g. ``3.5.3+ds1``)."""
        version: str = self.api("/api/v1/status/buildinfo")["data"]["version"]
        return version


@dataclass
class VictoriaMetrics(Receiver):
    """Single-node VictoriaMetrics, with the newest data visible at once."""

    ready_path: str = "/health"
    binary: str = VICTORIA_METRICS_BIN

    def command(self) -> list[str]:
        return [
            binary_path(self.binary) or self.binary,
            f"-httpListenAddr=127.0.0.1:{self.port}",
            f"-storageDataPath={self.data_dir / 'storage'}",
            "-retentionPeriod=1d",
            "-search.latencyOffset=0s",  # default 30 s hides the newest samples
            "-search.disableCache",
            "-memory.allowedPercent=20",
        ]

    def flush(self) -> None:
        # Recently ingested rows become searchable after about a second; force it instead.
        status, body = http_get_text(self.base_url + "/internal/force_flush")
        if status != 200:
            raise ReceiverError(f"{self.name} force_flush: HTTP {status}: {body[:200]}")

    def raw_samples(
        self, selector: str, start_s: float, end_s: float, keep_stale: bool = False
    ) -> dict[Labels, list[tuple[int, float]]]:
        """As ``Receiver.raw_samples``, through ``/api/v1/export`` (exact raw rows)."""
        self.flush()
        url = (
            self.base_url
            + "/api/v1/export?"
            + urllib.parse.urlencode(
                {"match[]": selector, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}"}
            )
        )
        with urllib.request.urlopen(url, timeout=10.0) as resp:
            lines = resp.read().decode().splitlines()
        out: dict[Labels, list[tuple[int, float]]] = {}
        for line in lines:
            if not line.strip():
                continue
            item = json.loads(line)
            key = tuple(sorted(item["metric"].items()))
            samples = [
                (int(ts), math.nan if v is None else float(v))  # null: a staleness marker
                for ts, v in zip(item["timestamps"], item["values"], strict=True)
                if start_s * 1000 < ts <= end_s * 1000 and (keep_stale or v is not None)
            ]
            out.setdefault(key, []).extend(samples)
        return {k: sorted(v) for k, v in out.items()}


def _start(receiver: Receiver, attempts: int = 3) -> None:
    """Start ``receiver``; if another process took its free port meanwhile, try another."""
    for attempt in range(attempts):
        try:
            receiver.start()
            return
        except ReceiverError as exc:
            if "address already in use" not in str(exc) or attempt == attempts - 1:
                raise
            receiver.port = free_port()


def fast_rules(dest: Path) -> list[str]:
    """deploy/rules/*.rules.yml copied into ``dest`` with every group evaluated each second,
    for a short test; their paths."""
    out = []
    for path in sorted((REPO_ROOT / "deploy" / "rules").glob("*.rules.yml")):
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            group["interval"] = "1s"
        target = dest / path.name
        target.write_text(yaml.safe_dump(doc))
        out.append(str(target))
    return out


def start_prometheus(
    root: Path,
    scrape_configs: list[dict[str, Any]] | None = None,
    port: int | None = None,
    *,
    name: str = "prometheus",
    binary: str = PROMETHEUS_BIN,
    extra_flags: Sequence[str] = (),
    rule_files: Sequence[str] = (),
) -> Prometheus:
    """Start a Prometheus under ``root`` (its config, data and log live there)."""
    root.mkdir(parents=True, exist_ok=True)
    prom = Prometheus(
        name=name,
        port=port or free_port(),
        data_dir=root,
        log_path=root / "prometheus.log",
        scrape_configs=scrape_configs or [],
        binary=binary,
        extra_flags=list(extra_flags),
        rule_files=list(rule_files),
    )
    _start(prom)
    return prom


def start_victoria_metrics(root: Path, port: int | None = None) -> VictoriaMetrics:
    """Start a VictoriaMetrics under ``root`` (its data and log live there)."""
    root.mkdir(parents=True, exist_ok=True)
    vm = VictoriaMetrics(
        name="victoria-metrics",
        port=port or free_port(),
        data_dir=root,
        log_path=root / "victoria-metrics.log",
    )
    _start(vm)
    return vm


# --------------------------------------------------------------------------------------------
# The CLI, run as a user would


@dataclass(frozen=True)
class CliRun:
    """One finished ``python -m hfsampler`` run."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    started_ns: int  # wall clock just before the process started
    ended_ns: int  # wall clock just after it exited

    def check(self) -> CliRun:
        """Raise with the output if the run failed."""
        if self.returncode != 0:
            raise AssertionError(
                f"hfsampler {' '.join(self.args)} exited {self.returncode}\n"
                f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"
            )
        return self


def hfsampler_env() -> dict[str, str]:
    """The environment the CLI runs in: ours, with the repo importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


FAKE_NVML_SITE = Path(__file__).resolve().parent / "fake_nvml_site"


def fake_nvml_env(scenario: Mapping[str, object]) -> dict[str, str]:
    """``hfsampler_env`` with the fake libnvidia-ml under pynvml in every process of the run
    (``fake_nvml_site/sitecustomize.py``), scripted by ``scenario``."""
    env = hfsampler_env()
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_NVML_SITE), env["PYTHONPATH"]])
    env["HFSAMPLER_FAKE_NVML"] = json.dumps(dict(scenario))
    return env


def run_cli(
    args: Sequence[str], timeout_s: float = 60.0, env: Mapping[str, str] | None = None
) -> CliRun:
    """Run ``python -m hfsampler ARGS`` to completion, capturing stdout and stderr.

    The CLI runs in its own process group; on timeout the whole group (the sampler process
    included) is killed and ``subprocess.TimeoutExpired`` is raised with the output so far.
    """
    started = time.time_ns()
    with subprocess.Popen(
        [sys.executable, "-m", "hfsampler", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else hfsampler_env(),
        cwd=REPO_ROOT,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(exc.cmd, timeout_s, out, err) from None
        finally:
            if proc.poll() is None:  # an exception other than the timeout
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    ended = time.time_ns()
    return CliRun(
        tuple(args),
        proc.returncode,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        started,
        ended,
    )


def spawn_cli(
    args: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``python -m hfsampler ARGS`` in its own process group, output to ``log_path``.

    Stop it with ``stop_cli``, which signals the whole group (the sampler process included).
    """
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "hfsampler", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else hfsampler_env(),
            cwd=REPO_ROOT,
            start_new_session=True,
        )


def stop_cli(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> int:
    """SIGINT the CLI's process group (as Ctrl-C would), then SIGKILL; return its exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def sim_run_args(
    write_urls: Sequence[str],
    listen: str = "",
    gpus: int = 2,
    window: str = "1s",
    duration: str = "8s",
    labels: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``run --source sim ...`` arguments for a push run (and /metrics on ``listen``; by default
    none, so that runs in parallel never compete for dcgm-exporter's port)."""
    args = ["run", "--source", "sim", "--gpus", str(gpus), "--window", window]
    args += ["--duration", duration, "--listen", listen]
    for url in write_urls:
        args += ["--remote-write", url]
    for key, value in (labels or {}).items():
        args += ["--label", f"{key}={value}"]
    return [*args, *extra]


def temp_root(prefix: str = "hfsampler-it-") -> Path:
    """A fresh temporary directory (the caller removes it)."""
    return Path(tempfile.mkdtemp(prefix=prefix))
