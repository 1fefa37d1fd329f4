#!/bin/sh
# Build the T6 front (experiments/docs/fixed-throughput.md). Where crates.io is reachable a plain
# `cargo build --release` does; where it is not, Debian's packaged crates serve as the registry:
#   apt-get install librust-hyper-dev librust-tokio-dev librust-tokio-macros-dev \
#       librust-sha2-dev librust-rmp-dev librust-bytes-dev
set -e
cd "$(dirname "$0")"
if [ -d /usr/share/cargo/registry/hyper-0.14.19 ]; then
    exec cargo build --release --offline \
        --config 'source.crates-io.replace-with="debian"' \
        --config 'source.debian.directory="/usr/share/cargo/registry"'
fi
exec cargo build --release
