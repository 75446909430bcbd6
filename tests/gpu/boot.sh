# shellcheck shell=bash
# Source from the repository root on a bare remote machine:
#     source tests/gpu/boot.sh
# Unpacks libfabric (+ the shared libraries it needs) from .dev/debs/*.deb into
# /tmp/fab (never into /), installs .dev/whl/*.whl into /tmp/site, and exports
# LD_LIBRARY_PATH, PATH and PYTHONPATH so `python3 -m pytest` / `python3 -m p2pxfer`
# run the working tree. Returns non-zero (loudly) if any step fails. Idempotent:
# a second source reuses /tmp/fab and /tmp/site when the debs/wheels are unchanged
# and does not duplicate path entries.
# Overrides: P2PX_FAB (default /tmp/fab), P2PX_SITE (default /tmp/site),
# P2PX_NO_PRUNE=1 (keep every unpacked library even where the system has its own).

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "boot.sh: source this file (source tests/gpu/boot.sh); running it cannot export anything" >&2
    exit 2
fi

_p2px_boot() {
    local here dev root fab site stamp py ml lib f so
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" || return 1
    root="$(cd "$here/../.." && pwd)" || return 1
    dev="$root/.dev"
    fab="${P2PX_FAB:-/tmp/fab}"
    site="${P2PX_SITE:-/tmp/site}"
    py="$(command -v python3)" || { echo "boot.sh: FAILED: no python3 on PATH" >&2; return 1; }

    _p2px_die() { echo "boot.sh: FAILED: $*" >&2; return 1; }

    local debs=("$dev"/debs/*.deb) whls=("$dev"/whl/*.whl)
    [[ -e "${debs[0]}" ]] || { _p2px_die "no .deb files in $dev/debs"; return 1; }
    [[ -e "${whls[0]}" ]] || { _p2px_die "no .whl files in $dev/whl"; return 1; }
    [[ -f "$root/src/p2pxfer/_fabric.abi3.so" ]] || { _p2px_die "$root/src/p2pxfer/_fabric.abi3.so missing (not built/carried)"; return 1; }

    # Stamp = checksum of the inputs (and this script); unchanged inputs => skip the work.
    stamp="$(cat "${debs[@]}" "${whls[@]}" "$here/boot.sh" | sha256sum | cut -d' ' -f1)" \
        || { _p2px_die "sha256sum"; return 1; }

    lib="$fab/usr/lib/x86_64-linux-gnu"
    ml="$lib:$fab/lib/x86_64-linux-gnu"     # libnl-3 unpacks under /lib (Debian 12 layout)

    # ---- 1. libfabric runtime ------------------------------------------------
    if [[ "$(cat "$fab/.p2px-stamp" 2>/dev/null)" != "$stamp" ]]; then
        echo "boot.sh: unpacking ${#debs[@]} .debs into $fab" >&2
        local tmp="$fab.tmp.$$"
        rm -rf "$tmp" || { _p2px_die "rm $tmp"; return 1; }
        mkdir -p "$tmp" || { _p2px_die "mkdir $tmp"; return 1; }
        if dpkg --version >/dev/null 2>&1; then
            for f in "${debs[@]}"; do
                dpkg -x "$f" "$tmp" || { _p2px_die "dpkg -x $f"; rm -rf "$tmp"; return 1; }
            done
        else
            # No dpkg: a .deb is an ar archive holding data.tar.{xz,zst,gz}.
            "$py" - "$tmp" "${debs[@]}" <<'PYEOF' || { _p2px_die "python .deb unpack"; rm -rf "$tmp"; return 1; }
import io, sys, tarfile
dest = sys.argv[1]
for deb in sys.argv[2:]:
    data = open(deb, "rb").read()
    assert data[:8] == b"!<arch>\n", deb
    off = 8
    while off < len(data):
        name = data[off:off + 16].decode().strip().rstrip("/")
        size = int(data[off + 48:off + 58])
        body = data[off + 60:off + 60 + size]
        off += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                sys.exit(f"{deb}: {name} needs dpkg or zstd")
            with tarfile.open(fileobj=io.BytesIO(body)) as t:
                t.extractall(dest, filter="tar") if hasattr(tarfile, "data_filter") else t.extractall(dest)
PYEOF
        fi
        local tlib="$tmp/usr/lib/x86_64-linux-gnu"
        local tml="$tlib:$tmp/lib/x86_64-linux-gnu"
        # Debian's postinst makes this link with update-alternatives; dpkg -x does not.
        if [[ -f "$tmp/usr/lib/libpsm1/libpsm_infinipath.so.1.16" ]]; then
            ln -sfn ../libpsm1/libpsm_infinipath.so.1.16 "$tlib/libpsm_infinipath.so.1" \
                || { _p2px_die "psm symlink"; rm -rf "$tmp"; return 1; }
        fi
        [[ -e "$tlib/libfabric.so.1" ]] || { _p2px_die "libfabric.so.1 not in the unpacked debs"; rm -rf "$tmp"; return 1; }

        # Prefer the system's copy of a library where it has one (other code in the
        # process, e.g. torch/NCCL, may need the system's newer version); groups
        # that must match each other are dropped only together.
        local ldc; ldc="$(command -v ldconfig || echo /sbin/ldconfig)"
        if [[ "${P2PX_NO_PRUNE:-0}" != 1 ]] && "$ldc" -p >/dev/null 2>&1; then
            local sys_sos; sys_sos="$("$ldc" -p | awk '/x86-64/ {print $1}')"
            _p2px_has() { local s; for s in "$@"; do grep -qxF "$s" <<<"$sys_sos" || return 1; done; }
            local -a dropped=()
            _p2px_drop() {  # drop <sonames...> if the system has all of them
                _p2px_has "$@" || return 0
                local s; for s in "$@"; do rm -f "$tlib/$s" "$tlib/$s".* "$tmp/lib/x86_64-linux-gnu/$s" "$tmp/lib/x86_64-linux-gnu/$s".*; done
                dropped+=("$@")
            }
            _p2px_drop libuuid.so.1
            _p2px_drop libatomic.so.1
            _p2px_drop libnuma.so.1
            _p2px_drop libpsm2.so.2
            _p2px_drop libnl-3.so.200 libnl-route-3.so.200
            _p2px_drop libpsm_infinipath.so.1 libinfinipath.so.4
            if _p2px_has libibverbs.so.1 librdmacm.so.1 libefa.so.1; then
                _p2px_drop libibverbs.so.1 librdmacm.so.1 libefa.so.1 libmana.so.1 libmlx4.so.1 libmlx5.so.1
                rm -rf "$tlib/libibverbs" "$tlib/rsocket"
            fi
            [[ ${#dropped[@]} -gt 0 ]] && echo "boot.sh: using the system's ${dropped[*]}" >&2
            unset -f _p2px_has _p2px_drop
        fi

        # Every library libfabric needs must resolve, with the right symbol versions.
        # (running fi_info really loads libfabric.so.1 and all it needs)
        local out ok=1
        out="$(LD_LIBRARY_PATH="$tml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$tlib/libfabric.so.1" 2>&1 \
               && LD_LIBRARY_PATH="$tml${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$tmp/usr/bin/fi_info" --version 2>&1)" || ok=0
        if [[ $ok -eq 0 ]] || grep -qiE 'not found|no such file|too short|error|cannot' <<<"$out"; then
            echo "boot.sh: libfabric does not load with the system's copies; keeping all unpacked libs:" >&2
            echo "$out" >&2
            rm -rf "$tmp"
            if [[ "${P2PX_NO_PRUNE_RETRIED:-0}" != 1 ]]; then
                P2PX_NO_PRUNE=1 P2PX_NO_PRUNE_RETRIED=1 _p2px_boot; return $?
            fi
            _p2px_die "libfabric dependencies unresolved even without pruning:"$'\n'"$out"; return 1
        fi
        rm -rf "$fab" || { _p2px_die "rm -rf $fab"; return 1; }
        mv "$tmp" "$fab" || { _p2px_die "mv $tmp $fab"; return 1; }
        echo "$stamp" > "$fab/.p2px-stamp" || { _p2px_die "write stamp"; return 1; }
    fi

    # ---- 2. wheels -----------------------------------------------------------
    if [[ "$(cat "$site/.p2px-stamp" 2>/dev/null)" != "$stamp" ]]; then
        echo "boot.sh: installing ${#whls[@]} wheels into $site" >&2
        local stmp="$site.tmp.$$"
        rm -rf "$stmp" && mkdir -p "$stmp" || { _p2px_die "mkdir $stmp"; return 1; }
        if "$py" -m pip --version >/dev/null 2>&1; then
            "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --disable-pip-version-check --target "$stmp" "${whls[@]}" \
                || { _p2px_die "pip install --target $stmp"; rm -rf "$stmp"; return 1; }
        else
            # No pip: these wheels are plain purelib/platlib zips (no .data dirs, no scripts).
            echo "boot.sh: no pip; unzipping wheels" >&2
            "$py" -c 'import sys, zipfile
for w in sys.argv[2:]: zipfile.ZipFile(w).extractall(sys.argv[1])' "$stmp" "${whls[@]}" \
                || { _p2px_die "unzip wheels"; rm -rf "$stmp"; return 1; }
        fi
        rm -rf "$site" && mv "$stmp" "$site" || { _p2px_die "mv $stmp $site"; return 1; }
        echo "$stamp" > "$site/.p2px-stamp" || { _p2px_die "write stamp"; return 1; }
    fi

    # ---- 3. environment (prepend once, no duplicates on re-source) -----------
    _p2px_prepend() {  # _p2px_prepend VAR dir1:dir2...
        local var="$1" cur="${!1-}" d new=""
        local -a ds; IFS=: read -r -a ds <<<"$2"
        for d in "${ds[@]}"; do new="${new:+$new:}$d"; done
        # strip existing occurrences of our dirs from the current value
        local -a keep=() parts; IFS=: read -r -a parts <<<"$cur"
        for d in "${parts[@]}"; do
            [[ -z "$d" ]] && continue
            [[ ":$2:" == *":$d:"* ]] || keep+=("$d")
        done
        local rest; rest="$(IFS=:; echo "${keep[*]}")"
        export "$var=$new${rest:+:$rest}"
    }
    _p2px_prepend LD_LIBRARY_PATH "$ml"
    _p2px_prepend PATH "$fab/usr/bin"
    _p2px_prepend PYTHONPATH "$root/src:$site"
    unset -f _p2px_prepend
    # libfabric 1.17 from Debian has every provider built in (no DSO providers);
    # FI_PROVIDER_PATH is not needed.

    # ---- 4. smoke check --------------------------------------------------------
    fi_info --version >/dev/null 2>&1 || { _p2px_die "fi_info does not run: $(fi_info --version 2>&1 | tail -3)"; return 1; }
    "$py" -c 'import cffi, pycparser, trio, outcome, sniffio, structlog, pytest_trio, cryptography.x509
import p2pxfer._fabric, p2pxfer._pages' \
        || { _p2px_die "python imports (cffi/trio/structlog/cryptography/p2pxfer._fabric)"; return 1; }
    echo "boot.sh: ok ($(fi_info --version | head -1 | tr -d '\n'); python $("$py" -c 'import sys; print(sys.version.split()[0])'))" >&2
    return 0
}

_p2px_rc=0
_p2px_boot || _p2px_rc=$?
unset -f _p2px_boot _p2px_die 2>/dev/null
if [[ $_p2px_rc -ne 0 ]]; then
    echo "boot.sh: *** environment NOT ready (rc=$_p2px_rc) ***" >&2
fi
return $_p2px_rc
