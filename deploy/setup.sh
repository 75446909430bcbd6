#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for p2pxfer: system packages (libfabric,
# a C compiler and pkg-config, iproute2 for namespace tests, etcd for the etcd
# backend, systemd for `systemd-analyze verify` of the unit), then a
# virtual environment in .venv with p2pxfer built in place (cffi compiles the
# libfabric binding). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
    libfabric-dev libfabric-bin gcc libc6-dev python3 python3-venv python3-dev \
    pkg-config iproute2 ethtool nftables etcd-server procps systemd curl >/dev/null

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
echo "p2pxfer is set up: .venv/bin/p2pxfer --help"
