#!/usr/bin/env bash
# scripts/test.sh — run the whole test suite (unit, integration and doc tests).
#
# Usage:  bash scripts/test.sh [cargo test arguments...]
#   e.g.  bash scripts/test.sh                      everything
#         bash scripts/test.sh --test it crash::     one area of the integration
#                                                  tests (tests/it/crash.rs)
#         bash scripts/test.sh -- --nocapture       show the tests' output
#
# What it does:
# 1. makes sure the programs the tests start themselves are installed: they
#    run private `redis-server` and `initdb`/`pg_ctl` instances (and a private
#    Redis Cluster joined with `redis-cli --cluster create`), render pages in
#    chromium, make certificates with openssl, check metrics with promtool
#    and count the benchmark's instructions with valgrind, so it installs the
#    Debian packages redis-server, redis-tools, postgresql, chromium, openssl,
#    valgrind and prometheus if missing;
# 2. exports TASKHUB_PG_BIN, the directory holding initdb and pg_ctl (Debian
#    keeps them in /usr/lib/postgresql/<version>/bin, outside PATH);
# 3. makes sure Redis and PostgreSQL answer at the defaults (scripts/services.sh);
# 4. runs `cargo test` with RUST_BACKTRACE=1, passing your arguments through.
# The exit status is cargo test's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -f $HOME/.cargo/env ]]; then
    # shellcheck source=/dev/null
    source "$HOME/.cargo/env"
fi
command -v cargo >/dev/null 2>&1 || {
    echo "test.sh: cargo not found; install Rust with rustup (https://rustup.rs)" >&2
    exit 1
}

# shellcheck source=pg_bin_dir.sh
source scripts/pg_bin_dir.sh

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
# tests/it/cluster.rs joins its private cluster nodes with `redis-cli --cluster create`.
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
# tests/it/dlq_page.rs renders the dead-letter page in a real headless Chromium.
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
pg_bin_dir >/dev/null || missing+=(postgresql)
# tests/it/tls.rs and tests/it/cluster.rs make their certificates with the openssl
# command (the build itself needs no OpenSSL: TLS is rustls).
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
# tests/it/bench_smoke.rs runs scripts/instructions.sh, which counts
# instructions with valgrind.
command -v valgrind >/dev/null 2>&1 || missing+=(valgrind)
# tests/it/operate.rs checks /metrics with `promtool check metrics`; the package
# alone, not the services it recommends.
lean=()
command -v promtool >/dev/null 2>&1 || lean+=(prometheus)
if ((${#missing[@]} + ${#lean[@]})); then
    echo "test.sh: installing ${missing[*]} ${lean[*]} (the tests start their own servers)" >&2
    sudo=()
    [[ $EUID -eq 0 ]] || sudo=(sudo)
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    if ((${#missing[@]})); then
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    if ((${#lean[@]})); then
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${lean[@]}" >/dev/null
    fi
fi
TASKHUB_PG_BIN=$(pg_bin_dir) || {
    echo "test.sh: initdb/pg_ctl still not found; set TASKHUB_PG_BIN to their directory" >&2
    exit 1
}
export TASKHUB_PG_BIN
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}

bash scripts/services.sh

echo "test.sh: cargo test $* (TASKHUB_PG_BIN=$TASKHUB_PG_BIN)" >&2
cargo test "$@"

# Batch mode is the default; the exactly-once, one-outcome, crash-window
# and failure tests run a second time in per-event mode (TASKHUB_MODE
# reaches every taskhub process the tests start, and support::mode() the
# in-process workers). The whole suite passes in per-event mode too
# (TASKHUB_MODE=per-event scripts/test.sh --test it), in about 4 minutes.
if (($# == 0)); then
    echo "test.sh: exactly-once, one-outcome, crash and failure tests again with TASKHUB_MODE=per-event" >&2
    TASKHUB_MODE=per-event cargo test --test it -- crash:: exactly_once:: one_outcome:: failures::
fi
