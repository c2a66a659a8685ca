#!/usr/bin/env bash
# Installs what the `mpi` feature builds and runs with (tensor and pipeline parallelism on
# CPUs): Open MPI and libclang (the `mpi` crate generates its bindings with bindgen), from
# Debian's packages, when they are missing. About 10 s.
set -euo pipefail
pkgs="libopenmpi-dev openmpi-bin libclang-dev iproute2"
dpkg -s $pkgs >/dev/null 2>&1 && exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q $pkgs >/dev/null
