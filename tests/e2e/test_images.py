"""The images and the release, on real parts: podman builds them with `make image`'s own
script, a loopback registry (Debian's docker-registry) takes them, skopeo reads them back,
the store's image runs under two real Envoys in cluster mode, and the Docker Compose sample's
services run through docker-compose against podman's API.

`make test-images` runs this file (it needs the static binaries, `make static-binaries`, the
native module, `make native`, and podman, skopeo, docker-registry and docker-compose:
scripts/install-deps.sh --test-images).
Podman uses a storage of its own under the test's temporary directory (containers.py), so
nothing here reads or changes the machine's images and containers. Everything listens on
127.0.0.1, on free ports; processes are stopped by PID and containers removed by the names
the tests gave them.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tarfile
import threading
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import yaml

import client
import harness
from cluster import DEMO_TOKEN, Cluster, cluster_plugin_config, post, wait_for_answer
from containers import (
    NAMING_ENV,
    REPO,
    ContainerStore,
    ImageCopy,
    Podman,
    Registry,
    image_names,
    installer_sha256,
    module_sha256,
    native_envoy,
    native_module,
    native_sha256,
    static_binary,
    workspace_version,
)
from helpers import is_replay, new_key, plugin_config, rule, rule_counters, start_envoy, unique_path

OCI_GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
# The cluster tests' callout budget (see test_cluster.py): envoy.yaml's 250 ms is a production
# latency budget, too tight for a busy 2-core machine.
STORE_TIMEOUT_MS = 2000


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    """A podman of the test's own, with the four images `make image` builds (default names),
    on a runtime that runs containers on this machine (runc where crun refuses hybrid cgroups)."""
    static_binary("idempotency-store")
    static_binary("demo-upstream")
    static_binary("install-module")
    native_module()
    engine = Podman(tmp_path_factory.mktemp("podman"))
    try:
        engine.build_images()
        engine.choose_runtime(image_names()["store"], "--version")
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry(tmp_path_factory.mktemp("registry")).start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="module")
def release(podman: Podman, registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`make release REGISTRY=<the loopback registry>/team`'s two scripts (the images named
    for that registry, then the release), into a directory of the test's, then `make push`'s."""
    dist = tmp_path_factory.mktemp("release") / "dist"
    env = {k: v for k, v in podman.env.items() if k not in NAMING_ENV}
    env.update(CONTAINER_ENGINE="podman", REGISTRY=f"{registry.host}/team", DIST=str(dist),
               SKOPEO_FLAGS="--dest-tls-verify=false")
    steps = (["scripts/images.sh", "build"], ["scripts/release.sh"], ["scripts/images.sh", "push", str(dist / "images")])
    for script in steps:
        result = subprocess.run(script, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{script}: {result.stderr}{result.stdout}"
    return {"dist": dist, "registry": f"{registry.host}/team", "push_log": result.stdout}


def elf_interpreter(path: Path) -> bool:
    """Whether an x86_64 ELF binary names a dynamic loader (a PT_INTERP program header)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{path} is not a 64-bit ELF file"
    phoff = int.from_bytes(data[0x20:0x28], "little")
    phentsize = int.from_bytes(data[0x36:0x38], "little")
    phnum = int.from_bytes(data[0x38:0x3A], "little")
    pt_interp = 3
    return any(int.from_bytes(data[phoff + i * phentsize:phoff + i * phentsize + 4], "little") == pt_interp
               for i in range(phnum))


def module_layer(image: ImageCopy) -> dict:
    layers = image.manifest["layers"]
    assert len(layers) == 1, layers
    return layers[0]


NATIVE_IMAGE_FILES = ("install-module", "libidempotency_native.so")


def native_image_files(image: ImageCopy) -> dict[str, str]:
    """The sha256 of each file in the native image's one layer, by path from the root: the
    module and its installer, nothing else (a directory entry for the root aside)."""
    layer = module_layer(image)
    members = {name.strip("/").removeprefix("./"): (name, info) for name, info in image.layer_files(layer).items()}
    assert sorted(set(members) - {"", "."}) == sorted(NATIVE_IMAGE_FILES), sorted(members)
    installer = members["install-module"][1]
    assert installer.isfile() and installer.mode & 0o111, "install-module is an executable file"
    return {path: hashlib.sha256(image.layer_file(layer, name)).hexdigest()
            for path, (name, info) in members.items() if path in NATIVE_IMAGE_FILES}


def native_files_built() -> dict[str, str]:
    """What the native image must hold: the .so `make native` wrote, the installer `make
    static-binaries` built."""
    return {"libidempotency_native.so": native_sha256(), "install-module": installer_sha256()}


def install_out_of(podman: Podman, image: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """``image`` run as the init container runs it: its own entrypoint, command and user
    (65532), ``directory`` mounted at its default target, /modules, as the emptyDir is;
    no network."""
    directory.mkdir(exist_ok=True)
    directory.chmod(0o777)  # as a Kubernetes emptyDir: writable by the container's user
    return podman.run("run", "--rm", "--network=none", "--volume", f"{directory}:/modules", image,
                      timeout=120, check=False)


# --------------------------------------------------------------------------
# the images as built
# --------------------------------------------------------------------------


def test_the_store_image_is_the_static_binary_alone_as_an_unprivileged_user(podman, tmp_path) -> None:
    names = image_names()
    config = podman.inspect("image", names["store"])["Config"]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["/idempotency-store"]
    assert config["Cmd"] == ["--listen=0.0.0.0:8081", "--backend=embedded", "--data-dir=/data"]
    assert set(config["Volumes"]) == {"/data"} and config["WorkingDir"] == "/data"
    assert set(config["ExposedPorts"]) == {"8081/tcp"}
    assert config["Labels"]["org.opencontainers.image.version"] == workspace_version()

    image = ImageCopy(f"containers-storage:{names['store']}", tmp_path / "store", env=podman.env)
    files: dict[str, object] = {}
    for layer in image.manifest["layers"]:
        files.update(image.layer_files(layer))
    # Nothing but the store and its data directory: no shell, no libc, no package manager.
    paths = {name.strip("/").removeprefix("./") for name in files} - {""}
    assert paths == {"idempotency-store", "data"}, paths
    data = next(info for name, info in files.items() if name.strip("/").removeprefix("./") == "data")
    assert data.isdir() and (data.uid, data.gid) == (65532, 65532)
    binary = next(info for name, info in files.items() if name.strip("/").removeprefix("./") == "idempotency-store")
    assert binary.size == static_binary("idempotency-store").stat().st_size

    run = podman.run("run", "--rm", "--network=host", names["store"], "--version", timeout=60)
    assert run.stdout.strip() == f"idempotency-store {workspace_version()}"
    # Without a token the store refuses to start rather than serve unauthenticated.
    refused = podman.run("run", "--rm", "--network=host", names["store"], timeout=60, check=False)
    assert refused.returncode != 0 and "no auth token configured" in refused.stderr + refused.stdout
    # No shell to run.
    shell = podman.run("run", "--rm", "--network=host", "--entrypoint", "/bin/sh", names["store"], "-c", "true",
                       timeout=60, check=False)
    assert shell.returncode != 0


def test_the_module_image_is_one_layer_holding_the_module_make_build_wrote(podman, tmp_path) -> None:
    names = image_names()
    image = ImageCopy(f"containers-storage:{names['module']}", tmp_path / "module", env=podman.env)
    layer = module_layer(image)
    assert list(image.layer_files(layer)) in (["plugin.wasm"], ["/plugin.wasm"], ["./plugin.wasm"])
    name = next(iter(image.layer_files(layer)))
    assert hashlib.sha256(image.layer_file(layer, name)).hexdigest() == module_sha256()
    # The compat variant names itself (podman writes the annotation; Istio does not need it).
    assert image.manifest.get("annotations", {}).get("module.wasm.image/variant") == "compat"


def test_the_native_image_is_one_layer_holding_the_module_make_native_wrote_and_its_installer(podman, tmp_path) -> None:
    """/libidempotency_native.so, byte for byte the one `make native` wrote, and
    /install-module, its entrypoint, as `make static-binaries` built it: one layer, run as an
    unprivileged user, in an image whose tag and description name the Envoy it is built for."""
    names = image_names()
    envoy = native_envoy()
    assert names["native"] == names["store"].replace("idempotency-store:", "idempotency-native:") + f"-envoy{envoy}"
    image = ImageCopy(f"containers-storage:{names['native']}", tmp_path / "native", env=podman.env)
    assert native_image_files(image) == native_files_built()
    config = image.config["config"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "idempotency-native"
    assert labels["org.opencontainers.image.version"] == workspace_version()
    assert f"built for Envoy {envoy}" in labels["org.opencontainers.image.description"]
    assert config["Entrypoint"] == ["/install-module"] and config["Cmd"] == ["/modules"]
    assert config["User"] == "65532:65532"


def test_the_native_image_installs_the_module_as_an_init_container_does(podman, tmp_path) -> None:
    """The native image run with its entrypoint, command and user into a host directory, as
    an init container into an emptyDir: the .so lands there byte for byte as `make native`
    wrote it, mode 0644, and nothing else does; a second run replaces it whole; a directory
    that is not there fails, naming it, with exit status 1."""
    names = image_names()
    target = tmp_path / "dynamic-modules"
    installed = target / "libidempotency_native.so"
    size = native_module().stat().st_size
    for attempt in (1, 2):
        run = install_out_of(podman, names["native"], target)
        assert run.returncode == 0, f"run {attempt}: {run.stderr}{run.stdout}"
        assert run.stdout == (f"installed /modules/libidempotency_native.so ({size} bytes, sha256 {native_sha256()}) "
                              "from /libidempotency_native.so\n"), run.stdout
        assert installed.read_bytes() == native_module().read_bytes()
        assert sorted(p.name for p in target.iterdir()) == ["libidempotency_native.so"]
        assert installed.stat().st_mode & 0o777 == 0o644
        assert installed.stat().st_uid == 65532, "written by the image's user"
        installed.write_bytes(b"an older module")  # which the second run replaces

    missing = podman.run("run", "--rm", "--network=none", names["native"], "/no-such-dir", timeout=60, check=False)
    assert missing.returncode == 1, missing.stderr + missing.stdout
    assert "cannot install into /no-such-dir" in missing.stderr, missing.stderr


# --------------------------------------------------------------------------
# through a registry
# --------------------------------------------------------------------------


def test_pushed_images_read_back_from_the_registry(podman, registry, tmp_path) -> None:
    """`podman push` of what `make image` built, read back with skopeo: what Istio's agent
    reads (one gzip layer holding plugin.wasm, the very module of `make build`), what the
    native module's init container runs (one gzip layer holding the .so of `make native` and
    its installer), and a store image that, pulled back, runs."""
    names = image_names()
    for kind in ("store", "module", "native"):
        remote = f"{registry.host}/direct/{names[kind].split('/', 1)[1]}"
        podman.run("push", "--tls-verify=false", names[kind], f"docker://{remote}", timeout=120)
    module = ImageCopy(f"docker://{registry.host}/direct/{names['module'].split('/', 1)[1]}", tmp_path / "m",
                       flags=["--src-tls-verify=false"])
    layer = module_layer(module)
    assert layer["mediaType"] == OCI_GZIP_LAYER
    assert hashlib.sha256(module.layer_file(layer, next(iter(module.layer_files(layer))))).hexdigest() == module_sha256()
    native = ImageCopy(f"docker://{registry.host}/direct/{names['native'].split('/', 1)[1]}", tmp_path / "n",
                       flags=["--src-tls-verify=false"])
    assert module_layer(native)["mediaType"] == OCI_GZIP_LAYER
    assert native_image_files(native) == native_files_built()

    pulled = f"{registry.host}/direct/{names['store'].split('/', 1)[1]}"
    podman.run("rmi", names["store"], timeout=60)  # so that the run below uses the pulled copy
    try:
        podman.run("pull", "--tls-verify=false", pulled, timeout=120)
        run = podman.run("run", "--rm", "--network=host", pulled, "--version", timeout=60)
        assert run.stdout.strip() == f"idempotency-store {workspace_version()}"
    finally:
        podman.run("tag", pulled, names["store"], timeout=60)


def test_the_release_pins_the_digests_the_registry_answers(release, registry, tmp_path) -> None:
    dist: Path = release["dist"]
    reg = release["registry"]
    version = workspace_version()
    wasm = dist / "idempotency_filter.wasm"
    assert hashlib.sha256(wasm.read_bytes()).hexdigest() == module_sha256()
    assert (dist / "idempotency_filter.wasm.sha256").read_text() == f"{module_sha256()}  idempotency_filter.wasm\n"
    check = subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=dist, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    store_run = subprocess.run([str(dist / "idempotency-store"), "--version"], capture_output=True, text=True, timeout=30)
    assert store_run.stdout.strip() == f"idempotency-store {version}"
    assert not elf_interpreter(dist / "idempotency-store"), "the release's store binary is static"
    # The native module, named for the Envoy it is built for, and its checksum file.
    envoy = native_envoy()
    native_dir = dist / "native" / f"envoy{envoy}"
    assert sorted(p.name for p in (dist / "native").iterdir()) == [f"envoy{envoy}"]
    assert sorted(p.name for p in native_dir.iterdir()) == ["libidempotency_native.so", "libidempotency_native.so.sha256"]
    assert (native_dir / "libidempotency_native.so").read_bytes() == native_module().read_bytes()
    assert (native_dir / "libidempotency_native.so.sha256").read_text() == f"{native_sha256()}  libidempotency_native.so\n"
    check = subprocess.run(["sha256sum", "--check", "libidempotency_native.so.sha256"], cwd=native_dir,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stdout == "libidempotency_native.so: OK\n", check.stdout + check.stderr

    store_digest = registry.digest(f"{reg}/idempotency-store:{version}")
    module_digest = registry.digest(f"{reg}/idempotency-filter:{version}")
    native_digest = registry.digest(f"{reg}/idempotency-native:{version}-envoy{envoy}")
    assert (dist / "images" / "digests").read_text().split() == [
        f"{reg}/idempotency-store:{version}", store_digest, f"{reg}/idempotency-filter:{version}", module_digest,
        f"{reg}/idempotency-native:{version}-envoy{envoy}", native_digest]

    pinned_store = f"{reg}/idempotency-store@{store_digest}"
    pinned_module = f"{reg}/idempotency-filter@{module_digest}"
    deploy = dist / "deploy"
    images = []
    for path in [deploy / "istio" / "store.yaml", deploy / "kubernetes" / "store-on-redis-cluster.yaml"]:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] in ("StatefulSet", "Deployment"):
                images += [c["image"] for c in doc["spec"]["template"]["spec"]["containers"]]
    assert images == [pinned_store, pinned_store]
    plugin = next(d for d in yaml.safe_load_all((deploy / "istio" / "wasmplugin.yaml").read_text()) if d)["spec"]
    assert plugin["url"] == f"oci://{pinned_module}"
    assert plugin["sha256"] == module_digest.removeprefix("sha256:")
    envoyfilter = next(d for d in yaml.safe_load_all((deploy / "istio" / "envoyfilter.yaml").read_text()) if d)
    added = next(p for p in envoyfilter["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG")
    remote = added["patch"]["value"]["typed_config"]["value"]["config"]["vm_config"]["code"]["remote"]
    assert remote["http_uri"]["uri"] == f"oci://{pinned_module}"
    assert remote["sha256"] == module_digest.removeprefix("sha256:")
    # Everything else is deploy/ as it is.
    for path in (REPO / "deploy").rglob("*"):
        if path.is_file() and path.suffix != ".yaml":
            assert (deploy / path.relative_to(REPO / "deploy")).read_bytes() == path.read_bytes()
    # The native image, where a sample names it (an init container's `image:`, or an image
    # volume's `reference:`), pinned as the others.
    image_line = re.compile(r"^\s*(?:-\s+)?(?:image|reference):\s*(.*)$")
    native_lines = []
    for text in (p.read_text() for p in deploy.rglob("*.yaml")):
        assert "localhost:5000" not in text
        native_lines += [m.group(1) for line in text.splitlines()
                         if "idempotency-native" in line and (m := image_line.match(line))]
    assert native_lines, "no sample names the native image"
    assert set(native_lines) == {f"{reg}/idempotency-native@{native_digest}  # {version}-envoy{envoy}"}, native_lines

    install = (dist / "INSTALL.md").read_text()
    assert "@" + "VERSION@" not in install and store_digest in install and module_digest in install
    assert native_digest in install and native_sha256() in install and f"Envoy {envoy}" in install
    assert f"native/envoy{envoy}/libidempotency_native.so" in install
    for archive, tag in (("idempotency-store", version), ("idempotency-filter", version),
                         ("idempotency-native", f"{version}-envoy{envoy}")):
        name = f"images/{archive}-{tag}.oci.tar"
        assert (dist / name).is_file() and f"oci-archive:{name} docker://{reg}/{archive}:{tag}" in install
        # `podman load` names the image after the archive's reference: the image's own name.
        with tarfile.open(dist / name) as tar:
            index = json.load(tar.extractfile("index.json"))
        assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]] == [
            f"{reg}/{archive}:{tag}"]
    assert (dist / "CHANGELOG.md").read_text() == (REPO / "CHANGELOG.md").read_text()

    # The exact references the manifests hold, pulled: the module the agent would load, and a
    # store that runs.
    module = ImageCopy(f"docker://{pinned_module}", tmp_path / "pinned-module", flags=["--src-tls-verify=false"])
    layer = module_layer(module)
    assert layer["mediaType"] == OCI_GZIP_LAYER
    assert hashlib.sha256(module.layer_file(layer, next(iter(module.layer_files(layer))))).hexdigest() == module_sha256()
    store = ImageCopy(f"docker://{pinned_store}", tmp_path / "pinned-store", flags=["--src-tls-verify=false"])
    assert store.config["config"]["User"] == "65532:65532"
    native = ImageCopy(f"docker://{reg}/idempotency-native@{native_digest}", tmp_path / "pinned-native",
                       flags=["--src-tls-verify=false"])
    assert module_layer(native)["mediaType"] == OCI_GZIP_LAYER
    assert native_image_files(native) == native_files_built()


def test_envoy_loads_the_native_module_out_of_the_released_image(
        podman, release, registry, procs, tmp_path, monkeypatch) -> None:
    """The native module's image as the release pins it, pulled from the registry and run
    as the init container runs it, into a directory of the test's (the emptyDir); the Envoy
    the module is built for (the suite's, ENVOY_NEWEST, the newest line NATIVE_ENVOY names) loads
    it from there and replays a retried write."""
    reg, version, envoy_line = release["registry"], workspace_version(), native_envoy()
    pinned = f"{reg}/idempotency-native@{registry.digest(f'{reg}/idempotency-native:{version}-envoy{envoy_line}')}"
    podman.run("pull", "--tls-verify=false", pinned, timeout=120)
    volume = tmp_path / "dynamic-modules"
    run = install_out_of(podman, pinned, volume)
    assert run.returncode == 0, run.stderr + run.stdout
    assert (volume / "libidempotency_native.so").read_bytes() == native_module().read_bytes()
    monkeypatch.setenv("IDEMPOTENCY_NATIVE_DIR", str(volume))

    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, plugin_config(rule("orders", prefixes=["/orders"])), build="native",
                        name="envoy-native-image")
    running = subprocess.run([str(harness.envoy_binary()), "--version"], capture_output=True, text=True, timeout=30).stdout
    assert f"/{envoy_line.split('-')[-1]}." in running, running
    assert f"idempotency-filter {version} loaded (native build)" in envoy.log_text()
    path, key = unique_path(), new_key()
    first = post(envoy, path, key)
    assert first.status_code == 201 and not is_replay(first), first.text
    again = post(envoy, path, key)
    assert (again.status_code, is_replay(again), again.content) == (201, True, first.content)
    assert upstream.executions(path) == 1


# --------------------------------------------------------------------------
# the store's image in cluster mode
# --------------------------------------------------------------------------


def test_two_envoys_share_the_store_container_and_its_volume_outlives_it(
        podman, registry, release, procs, tmp_path, monkeypatch) -> None:
    """The store's image as the release pins it, pulled from the registry and run with podman
    (embedded backend, /data on a named volume, the token as a mounted file), under two Envoys
    from envoy/envoy.yaml that load the module taken out of the module's image: a claim on one
    turns the other away while it runs, both replay it; after the container is stopped and a
    new one started on the same volume, a fresh Envoy replays it from the store."""
    reg, version = release["registry"], workspace_version()
    store_image = f"{reg}/idempotency-store@{registry.digest(f'{reg}/idempotency-store:{version}')}"
    module_image = f"docker://{reg}/idempotency-filter@{registry.digest(f'{reg}/idempotency-filter:{version}')}"
    podman.run("pull", "--tls-verify=false", store_image, timeout=120)
    module = ImageCopy(module_image, tmp_path / "module", flags=["--src-tls-verify=false"])
    layer = module_layer(module)
    wasm = tmp_path / "plugin.wasm"
    wasm.write_bytes(module.layer_file(layer, next(iter(module.layer_files(layer)))))
    monkeypatch.setenv("IDEMPOTENCY_FILTER_WASM", str(wasm))

    volume = f"store-data-{uuid.uuid4().hex[:8]}"
    store = procs.add(ContainerStore(podman, tmp_path, image=store_image, token=DEMO_TOKEN, volume=volume))
    store.start()
    status = Path(f"/proc/{store.store_pid()}/status").read_text()
    assert "\nUid:\t65532\t" in status, "the store runs as the image's user"

    plugin = cluster_plugin_config(timeout_ms=STORE_TIMEOUT_MS)
    cluster = Cluster(procs=procs, upstream=procs.upstream(), store=store, envoys=[])
    a = cluster.add_envoy("envoy-a", plugin)
    b = cluster.add_envoy("envoy-b", plugin)
    for envoy in (a, b):
        assert f"idempotency-filter {version} loaded" in envoy.log_text()

    path, key = unique_path(), new_key()
    answers: dict[str, client.Response] = {}
    slow = threading.Thread(target=lambda: answers.update(first=post(a, path, key, headers={"x-demo-delay-ms": "1500"}, timeout=30)))
    slow.start()
    harness.wait_until(lambda: cluster.upstream.executions(path) == 1, timeout=10, what="the first write upstream")
    busy = post(b, path, key)
    slow.join(timeout=30)
    assert busy.status_code == 409 and busy.json()["type"].endswith("request-in-flight"), busy.text
    first = answers["first"]
    assert first.status_code == 201 and not is_replay(first), first.text
    for envoy in (a, b):
        replay, _ = wait_for_answer(lambda: post(envoy, path, key), timeout=10)
        assert (replay.status_code, is_replay(replay), replay.content) == (201, True, first.content)
    harness.wait_until(lambda: cluster.store_completions() >= 1, timeout=10, what="the completion at the store")
    assert cluster.upstream.executions(path) == 1

    # A new container on the same volume: the record is still there, for an Envoy that has
    # no local copy of it.
    assert store.stop() == 0, store.log_text()
    data = podman.run("volume", "inspect", volume, "--format", "{{.Mountpoint}}", timeout=30).stdout.strip()
    database = Path(data) / "idempotency.redb"
    assert database.is_file() and (database.stat().st_uid, database.stat().st_gid) == (65532, 65532)
    store.start()
    fresh = cluster.add_envoy("envoy-fresh", plugin)
    again = post(fresh, path, key)
    assert (again.status_code, is_replay(again), again.content) == (201, True, first.content)
    assert rule_counters(fresh, "orders")["replayed"] == 1
    # And the restarted store takes new claims.
    other = unique_path()
    assert post(b, other, new_key()).status_code == 201
    assert cluster.upstream.executions(path) == 1 and cluster.upstream.executions(other) == 1
    store.stop()
    podman.run("volume", "rm", volume, timeout=60)


# --------------------------------------------------------------------------
# the Docker Compose sample
# --------------------------------------------------------------------------


def store_completions(port: int) -> float:
    """The store's count of recorded completions, from its /metrics."""
    text = client.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("idempotency_store_operations_total{")
               and 'operation="complete"' in line and 'outcome="completed"' in line)


class PodmanService:
    """`podman system service` on a socket in ``tmpdir``: the Docker API docker-compose talks
    to. Stopped by PID."""

    def __init__(self, podman: Podman, tmpdir: Path) -> None:
        self.socket = tmpdir / "podman.sock"
        self.process = harness.ManagedProcess(
            podman.argv("system", "service", "--time=0", f"unix://{self.socket}"),
            name="podman-service", log_dir=tmpdir, env=podman.env)

    def start(self) -> "PodmanService":
        self.process.start()
        harness.wait_until(lambda: harness._check_alive(self.process, "the API socket") or self.socket.exists(),
                           timeout=30, what="podman's API socket")
        return self

    def stop(self) -> int | None:
        return self.process.stop()


def test_the_compose_sample_runs_its_store_and_upstream_images(podman, procs, tmp_path) -> None:
    """envoy/docker-compose.yaml's store and upstream services, as they are but for their ports
    (free ones instead of envoy.yaml's), brought up by docker-compose through podman's Docker
    API; then an Envoy from envoy/envoy.yaml on those ports replays a retried write. The
    official envoyproxy/envoy image cannot be pulled here, so the Envoy is the same release from
    PyPI, run by the harness (test_deploy_manifests.py checks the service's command). A `down`
    and an `up` keep the store's named volume, and with it the record."""
    compose = yaml.safe_load((REPO / "envoy" / "docker-compose.yaml").read_text())
    store_port, upstream_port = harness.free_port(), harness.free_port()
    services = compose["services"]
    del services["envoy"]
    services["store"]["command"] = [
        f"127.0.0.1:{store_port}" if arg == "127.0.0.1:8081" else arg for arg in services["store"]["command"]]
    services["upstream"]["command"] = [
        f"127.0.0.1:{upstream_port}" if arg == "127.0.0.1:8080" else arg for arg in services["upstream"]["command"]]
    assert f"127.0.0.1:{store_port}" in services["store"]["command"]
    assert f"127.0.0.1:{upstream_port}" in services["upstream"]["command"]
    file = tmp_path / "docker-compose.yaml"
    file.write_text(yaml.safe_dump(compose))

    service = procs.add(PodmanService(podman, tmp_path).start())
    project = f"compose{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in podman.env.items() if k not in ("REGISTRY", "VERSION")}
    env["DOCKER_HOST"] = f"unix://{service.socket}"

    def compose_cmd(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["docker-compose", "--project-name", project, "--file", str(file), *args],
                                env=env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, f"docker-compose {' '.join(args)}: {result.stderr}{result.stdout}"
        return result

    class Down:
        def stop(self) -> None:
            subprocess.run(["docker-compose", "--project-name", project, "--file", str(file), "down", "--volumes",
                            "--timeout", "10"], env=env, capture_output=True, text=True, timeout=180)

    procs.add(Down())  # stopped before the API service, which the group stops last
    compose_cmd("up", "--detach", "--no-build")
    harness.wait_for_http(f"http://127.0.0.1:{store_port}/healthz", timeout=60)
    harness.wait_for_tcp(upstream_port, timeout=60)

    upstream = harness.Upstream(harness.ManagedProcess(["true"], name="compose-upstream", log_dir=tmp_path), upstream_port)
    plugin = cluster_plugin_config(timeout_ms=STORE_TIMEOUT_MS)
    envoy = start_envoy(procs, upstream, plugin, store_port=store_port, name="envoy-compose")
    path, key = unique_path(), new_key()
    first = post(envoy, path, key)
    assert first.status_code == 201 and not is_replay(first), first.text
    retry, _ = wait_for_answer(lambda: post(envoy, path, key), timeout=10)
    assert (retry.status_code, is_replay(retry), retry.content) == (201, True, first.content)
    assert upstream.executions(path) == 1
    harness.wait_until(lambda: rule_counters(envoy, "orders")["executed"] == 1, timeout=10, what="the execution count")

    # The completion goes to the store after the response: wait until it landed.
    harness.wait_until(lambda: store_completions(store_port) >= 1, timeout=10, what="the completion at the store")
    compose_cmd("down", "--timeout", "10")  # containers gone, the named volume kept
    compose_cmd("up", "--detach", "--no-build")
    harness.wait_for_http(f"http://127.0.0.1:{store_port}/healthz", timeout=60)
    harness.wait_for_tcp(upstream_port, timeout=60)
    fresh = start_envoy(procs, upstream, plugin, store_port=store_port, name="envoy-compose-fresh")
    again = post(fresh, path, key)
    assert (again.status_code, is_replay(again), again.content) == (201, True, first.content)
    # The upstream restarted too (its counters with it): nothing ran it again.
    assert upstream.executions(path) == 0
