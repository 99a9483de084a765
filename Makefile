# Set-up and tests on a Debian/Ubuntu host, as root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: up setup deps test-deps venv images test lint bench console proto

# The whole platform on this machine, in the foreground: prints the API URL and a key.
# The packages and the Python environment first, then `space doctor`, which stops here on what
# cannot work (and shows what will be slow); `space up` then builds the images it lacks.
up: deps venv
	$(BIN)/space doctor --problems
	$(BIN)/space up

# Everything a host needs: system packages, the Python environment, the guest kernel and `base`.
setup: deps venv images

deps:
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		qemu-system-x86 qemu-utils busybox-static mmdebstrap debootstrap ca-certificates \
		btrfs-progs e2fsprogs util-linux kmod cpio lz4 zstd xz-utils nftables iproute2 \
		python3-venv docker-registry apache2-utils

# What only the tests need: the browser that drives the web console (Playwright uses it as it
# is; no browser of its own is downloaded), and E2B's JavaScript SDKs where Node.js is new
# enough for them (their pinned versions, from tests/e2b_js/package-lock.json).
test-deps:
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
	@if node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a * 100 + b >= 2018 ? 0 : 1)' 2>/dev/null; then \
	  cd tests/e2b_js && npm ci --no-audit --no-fund --cache "$${SPACE_CACHE_DIR:-/var/cache/space}/npm"; \
	else echo "no Node.js >= 20.18: the tests of E2B's JavaScript SDKs will be skipped"; fi

venv: $(BIN)/space

$(BIN)/space: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

images: venv
	$(BIN)/space image kernel
	$(BIN)/space image base
	$(BIN)/space image code-interpreter

lint: venv
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

# The test command: lint, then the whole suite (real VMs under QEMU; needs root).
test: setup test-deps lint
	$(BIN)/pytest -ra --durations=25

# The web console's bundle (src/space/console/static/, committed) from console/: the pinned
# packages of its lock file, then esbuild. Only for changing the console; `up` never needs it.
console:
	cd console && npm ci --no-audit --no-fund && npm run build

# The envd wire code (src/space/e2b/proto/*/*_pb.py, *_connect.py, committed) from its .proto
# files. Only for changing them.
proto: venv
	$(BIN)/pip install -q -e '.[codegen]'
	cd src/space/e2b/proto && ../../../../$(BIN)/python -m grpc_tools.protoc -I . \
		--plugin=protoc-gen-py=../../../../$(BIN)/protoc-gen-py \
		--plugin=protoc-gen-connectrpc=../../../../$(BIN)/protoc-gen-connectrpc \
		--py_out=. --connectrpc_out=. process/process.proto filesystem/filesystem.proto

bench: setup
	$(BIN)/python bench/vm_runtime.py --json bench/results/vm_runtime.json
