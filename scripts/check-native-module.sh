#!/usr/bin/env bash
# Checks a build of the native module (libidempotency_native.so) is one Envoy's images can
# load: `scripts/check-native-module.sh PATH` exits 1 saying what is wrong. `make release`
# runs it on what it ships, and tests/e2e/test_native_manifests.py on `make native`'s build.
set -euo pipefail
module=${1:?usage: scripts/check-native-module.sh PATH}
[[ -f $module ]] || { echo "$module does not exist" >&2; exit 1; }

# An ELF shared object that exports the hook Envoy calls when it loads a dynamic module
# (readelf: binutils, which the Rust toolchain links with).
command -v readelf >/dev/null || { echo "readelf is missing (Debian package binutils)" >&2; exit 1; }
elf_header=$(readelf -h "$module" 2>&1) || true
dyn_syms=$(readelf --dyn-syms -W "$module" 2>&1) || true
if ! grep -Eq '^ *Type: +DYN ' <<<"$elf_header" \
    || ! grep -Eq ' FUNC +GLOBAL +DEFAULT +[0-9]+ envoy_dynamic_module_on_program_init$' <<<"$dyn_syms"; then
    echo "$module is not an ELF shared object exporting envoy_dynamic_module_on_program_init" >&2
    exit 1
fi
# It needs nothing but glibc, and no glibc newer than Debian 12's 2.36: what Envoy's
# distroless images (and Istio's proxy) hold of the C runtime, and all Envoy itself needs.
# A module that needs more fails to load there.
glibc_libraries=" libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 ld-linux-x86-64.so.2 "
needed=$(readelf --dynamic -W "$module" | sed -n 's/.*(NEEDED).*Shared library: \[\(.*\)\]$/\1/p')
extra=()
for library in $needed; do
    [[ $glibc_libraries == *" $library "* ]] || extra+=("$library")
done
if ((${#extra[@]})); then
    hint=
    [[ " ${extra[*]} " == *" libgcc_s.so.1 "* ]] \
        && hint=" (built without make native's linker? scripts/link-static-unwind.sh links gcc's unwinder in)"
    echo "$module needs ${extra[*]}, which Envoy's distroless images lack: only glibc's libraries may be needed$hint" >&2
    exit 1
fi
newest_glibc=$(grep -o '@GLIBC_[0-9][0-9.]*' <<<"$dyn_syms" | sed 's/^@GLIBC_//' | sort -uV | tail -1)
if [[ -z $newest_glibc ]]; then
    echo "$module names no glibc symbol version: not a module built against glibc?" >&2
    exit 1
fi
if [[ $(printf '%s\n' "$newest_glibc" 2.36 | sort -V | tail -1) != 2.36 ]]; then
    symbols=$(grep -o "[^ ]*@GLIBC_$newest_glibc\b" <<<"$dyn_syms" | sed 's/@.*//' | sort -u | tr '\n' ' ')
    echo "$module needs glibc $newest_glibc (${symbols% }), newer than Debian 12's 2.36 in Envoy's distroless images: build it on an older glibc" >&2
    exit 1
fi
