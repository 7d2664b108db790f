# shellcheck shell=bash
# scripts/pg_bin_dir.sh — sourced by services.sh, test.sh and chaos.sh.
#
# pg_bin_dir prints the directory holding initdb and pg_ctl, or fails.
# Prefers TASKHUB_PG_BIN, then the newest /usr/lib/postgresql/*/bin, then PATH.
pg_bin_dir() {
    local d
    if [[ -n ${TASKHUB_PG_BIN:-} && -x ${TASKHUB_PG_BIN}/initdb ]]; then
        printf '%s\n' "$TASKHUB_PG_BIN"
        return 0
    fi
    d=$(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
    if [[ -x $d/initdb && -x $d/pg_ctl ]]; then
        printf '%s\n' "$d"
        return 0
    fi
    if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
        dirname "$(readlink -f "$(command -v initdb)")"
        return 0
    fi
    return 1
}
