#!/usr/bin/env bash
# The linker of the native build (`make native`): the system's cc, with gcc's unwinder linked
# in statically (libgcc_eh.a) where Rust's standard library asks for the shared one
# (-lgcc_s). Envoy itself needs nothing of gcc's, so Envoy's distroless images do not ship
# libgcc_s.so.1, and a module that needed it would fail to load there. The unwinder must stay:
# the module is built to unwind, so that every hook can catch a panic.
# Rust offers no stable switch for this (crt-static refuses a cdylib on linux-gnu).
set -euo pipefail
args=()
for arg in "$@"; do
    if [[ $arg == -lgcc_s ]]; then
        args+=(-l:libgcc_eh.a)
    else
        args+=("$arg")
    fi
done
# CC may be several words (`ccache gcc`, `gcc -m64`), as make and autoconf allow.
read -r -a cc <<<"${CC:-cc}"
((${#cc[@]})) || cc=(cc)
exec "${cc[@]}" "${args[@]}"
