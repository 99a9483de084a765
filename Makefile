# Set-up and tests on a Debian/Ubuntu host, as root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: up setup deps venv images test lint bench

# The whole platform on this machine, in the foreground: prints the API URL and a key.
up: setup
	$(BIN)/space up

# Everything a host needs: system packages, the Python environment, the guest kernel and `base`.
setup: deps venv images

deps:
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		qemu-system-x86 qemu-utils busybox-static mmdebstrap debootstrap ca-certificates \
		btrfs-progs e2fsprogs util-linux kmod cpio lz4 zstd xz-utils nftables iproute2 \
		python3-venv docker-registry apache2-utils

venv: $(BIN)/space

$(BIN)/space: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

images: venv
	$(BIN)/space image kernel
	$(BIN)/space image base

lint: venv
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

# The test command: lint, then the whole suite (real VMs under QEMU; needs root).
test: setup lint
	$(BIN)/pytest -ra

bench: setup
	$(BIN)/python bench/vm_runtime.py --json bench/results/vm_runtime.json
