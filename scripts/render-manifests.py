#!/usr/bin/env python3
"""Writes deploy/ as a release ships it: every image reference pointing at REGISTRY and pinned
by the digest of the image in the release.

    scripts/render-manifests.py --registry R --version V --store-digest HEX --module-digest HEX \
        --native-digest HEX [--native-envoy E] SRC DEST

SRC is deploy/; DEST gets the same tree. In each YAML file, the lines that name an image are
rewritten, and nothing else (comments, order and everything else stay as they are):

    image: <any>/idempotency-store:<V>        -> image: R/idempotency-store@sha256:<store>  # <V>
    url: oci://<any>/idempotency-filter:<V>   -> url: oci://R/idempotency-filter@sha256:<module>  # <V>
                                                 sha256: "<module>"   (a new line: WasmPlugin)
    uri: oci://<any>/idempotency-filter:<V>   -> uri: oci://R/idempotency-filter@sha256:<module>  # <V>
    and the next `sha256: "nil"`              -> sha256: "<module>"   (EnvoyFilter remote code)
    image: <any>/idempotency-native:<V>-envoy<E>
                              -> image: R/idempotency-native@sha256:<native>  # <V>-envoy<E>
                                 (the init container that installs the native module)
    reference: <any>/idempotency-native:<V>-envoy<E>
                              -> reference: R/idempotency-native@sha256:<native>  # <V>-envoy<E>
                                 (the same image as a Kubernetes image volume)

By digest alone, not tag and digest: some image tools refuse references with both (skopeo
and podman of Debian 12, and older CRI-O, all built on containers/image), and the trailing
comment still says the version. For an OCI image Istio compares `sha256` with the digest of
the image's manifest, which is the digest here. Fails if a file names an image another way
(another version included, and with --native-envoy E a native module built for another
Envoy), or if deploy/ names no store image or no module image, so a manifest that changed
shape is noticed rather than shipped with a stale reference. The native image is pinned
wherever it is named, and not required.
Standard library only: `make release` runs it before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

HEX64 = re.compile(r"^[0-9a-f]{64}$")
# The Envoy release lines a native module is for: one (1.40) or a range (1.39-1.40).
ENVOY_LINES = r"[0-9]+\.[0-9]+(?:-[0-9]+\.[0-9]+)?"


def render(text: str, *, registry: str, version: str, store: str, module: str, native: str,
           native_envoy: str | None = None, name: str) -> tuple[str, dict[str, int]]:
    """``text`` with its image lines pinned, and how many of each kind it pinned. The native
    module's tag is ``<version>-envoy<native_envoy>``, any Envoy release line when None."""
    counts = {"store": 0, "module": 0, "native": 0}
    v = re.escape(version)
    envoy = re.escape(native_envoy) if native_envoy is not None else ENVOY_LINES
    native_line = re.compile(rf"^(\s*(?:-\s+)?)(image|reference):\s*\S+/idempotency-native:({v}-envoy{envoy})\s*$")
    store_line = re.compile(rf"^(\s*(?:-\s+)?)image:\s*\S+/idempotency-store:{v}\s*$")
    url_line = re.compile(rf"^(\s*)url:\s*oci://\S+/idempotency-filter:{v}\s*$")
    uri_line = re.compile(rf"^(\s*)uri:\s*oci://\S+/idempotency-filter:{v}\s*$")
    nil_sha = re.compile(r'^(\s*)sha256:\s*"nil"\s*$')
    out: list[str] = []
    pending_nil = False
    for line in text.split("\n"):
        if m := store_line.match(line):
            out.append(f"{m.group(1)}image: {registry}/idempotency-store@sha256:{store}  # {version}")
            counts["store"] += 1
        elif m := url_line.match(line):
            out.append(f"{m.group(1)}url: oci://{registry}/idempotency-filter@sha256:{module}  # {version}")
            out.append(f'{m.group(1)}sha256: "{module}"')
            counts["module"] += 1
        elif m := native_line.match(line):
            out.append(f"{m.group(1)}{m.group(2)}: {registry}/idempotency-native@sha256:{native}  # {m.group(3)}")
            counts["native"] += 1
        elif m := uri_line.match(line):
            out.append(f"{m.group(1)}uri: oci://{registry}/idempotency-filter@sha256:{module}  # {version}")
            counts["module"] += 1
            pending_nil = True
        elif pending_nil and (m := nil_sha.match(line)):
            out.append(f'{m.group(1)}sha256: "{module}"')
            pending_nil = False
        else:
            if re.search(r"idempotency-(store|filter|native)[:@]", line) and not line.lstrip().startswith("#"):
                raise SystemExit(f"{name}: an image reference this script does not know how to pin: {line.strip()}")
            out.append(line)
    if pending_nil:
        raise SystemExit(f'{name}: an oci:// module uri without its sha256: "nil" line')
    return "\n".join(out), counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--store-digest", required=True)
    parser.add_argument("--module-digest", required=True)
    parser.add_argument("--native-digest", required=True)
    parser.add_argument("--native-envoy", help="the Envoy release lines the native module is for, e.g. 1.39-1.40 "
                        "(scripts/images.sh native-envoy); a native image tagged for another one fails")
    parser.add_argument("src", type=Path)
    parser.add_argument("dest", type=Path)
    args = parser.parse_args()
    for digest in (args.store_digest, args.module_digest, args.native_digest):
        if not HEX64.match(digest):
            raise SystemExit(f"not a sha256 digest (64 lower-case hex digits): {digest}")
    if args.native_envoy is not None and not re.fullmatch(ENVOY_LINES, args.native_envoy):
        raise SystemExit(f"not Envoy release lines such as 1.39-1.40 or 1.40: {args.native_envoy}")
    registry = args.registry.rstrip("/")
    if args.dest.exists():
        shutil.rmtree(args.dest)
    shutil.copytree(args.src, args.dest)
    totals = {"store": 0, "module": 0, "native": 0}
    for path in sorted(args.dest.rglob("*.yaml")):
        text, counts = render(
            path.read_text(), registry=registry, version=args.version,
            store=args.store_digest, module=args.module_digest, native_envoy=args.native_envoy,
            native=args.native_digest, name=str(path.relative_to(args.dest)),
        )
        path.write_text(text)
        for kind, n in counts.items():
            totals[kind] += n
    if not totals["store"] or not totals["module"]:
        raise SystemExit(f"{args.src} names no store image or no module image for version {args.version}: {totals}")
    print(f"{args.dest}: {totals['store']} store image line(s), {totals['module']} module reference(s), "
          f"{totals['native']} native module image line(s) pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
