#!/usr/bin/env bash
# Checks the set-up a new user gets with the distribution's own Python, as on a stock Debian or
# Ubuntu, whose pip refuses to install into it (PEP 668, "externally-managed-environment"):
#   1. `scripts/setup.sh` with /usr/bin/python3 first on PATH succeeds (it installs into the
#      project's .venv, never into the system Python);
#   2. `grpo devices` then finds the CPU plugin and libtpu in .venv, with that python3 first on
#      PATH, from another working directory;
#   3. and the same with an unrelated virtual environment activated.
# CI runs it first on its clean clone, so there .venv is made by /usr/bin/python3. It builds
# grpo the way the quickstart does (`cargo build --release`), so the quickstart reuses the build.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd -P)
system_python=/usr/bin/python3
if [ ! -x "$system_python" ]; then
    echo "error: $system_python does not exist; this check is for a distribution's own Python" >&2
    exit 1
fi
plain_path="/usr/bin:/bin:$(dirname "$(command -v cargo)")"

if PATH=$plain_path python3 -m pip install --dry-run --quiet --no-deps six >/dev/null 2>&1; then
    echo "note: $system_python accepts pip installs here (not marked externally managed)"
else
    echo "$system_python refuses pip installs into itself (PEP 668), as on a stock Debian or Ubuntu"
fi

made_here=no
[ -e .venv ] || made_here=yes
PATH=$plain_path scripts/setup.sh
echo "setup with $system_python first on PATH: ok (.venv $( [ $made_here = yes ] && echo "made now by" || echo "already there, made by"): $(sed -n 's/^home = //p' .venv/pyvenv.cfg))"

cargo build --release --quiet
grpo="$root/target/release/grpo"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# `grpo devices` in the given environment must list the CPU plugin and libtpu from .venv.
expect_plugins() {
    local what=$1
    shift
    local out
    if ! out=$(cd "$tmp" && "$@" "$grpo" devices 2>&1); then
        echo "$out" >&2
        echo "error: grpo devices failed $what" >&2
        exit 1
    fi
    for kind in cpu tpu; do
        if ! grep -q "^$kind: $root/.venv/lib/python3[^/]*/site-packages/" <<<"$out"; then
            echo "$out" >&2
            echo "error: grpo devices $what did not find the $kind plugin in $root/.venv" >&2
            exit 1
        fi
    done
    if ! grep -Eq "platform cpu.*, [0-9]+ device\(s\)" <<<"$out"; then
        echo "$out" >&2
        echo "error: grpo devices $what found the CPU plugin but no CPU device" >&2
        exit 1
    fi
    echo "grpo devices $what: $(grep -E '^(cpu|tpu):' <<<"$out" | sed "s|$root/||" | paste -sd ';' -)"
}

expect_plugins "with $system_python first on PATH" env PATH="$plain_path"
"$system_python" -m venv --without-pip "$tmp/unrelated"
expect_plugins "with an unrelated virtual environment active" \
    bash -c 'source "$0/unrelated/bin/activate" && [ "$(command -v python3)" = "$0/unrelated/bin/python3" ] && exec "$@"' "$tmp"
echo "python environment check: ok"
