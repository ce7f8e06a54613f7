# trtbuild — the README's commands. `make setup` installs everything into .venv; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU machines without a GPU: torch==2.13.0 (a CPU build lies on this kind of machine's disk).
# With a GPU: `make setup TORCH=torch` to get your usual CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup setup-peers test test-fast lint demo bench gpu-check clean

setup: $(STAMP) setup-peers

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	# peers: NVIDIA ModelOpt, so the ModelOpt interop test runs here and in CI (+10 s install, ~70 s of tests)
	$(BIN)/pip install --quiet -e '.[dev,peers]'
	# tensorrt-stubs depends on `tensorrt`, whose package needs NVIDIA's index: install the stubs alone.
	$(BIN)/pip install --quiet --no-deps 'tensorrt-stubs>=10.13,<11'
	# The stubs ship as plain `tensorrt/*.pyi` without py.typed, which mypy reads only from its mypy_path; a few
	# signatures name a parameter `in` (a Python keyword), renamed `in_` in our copy, and add_scale_nd puts a
	# parameter without a default after defaulted ones: given `= ...` here, so that mypy can parse the file.
	rm -rf $(VENV)/typings && mkdir -p $(VENV)/typings
	site=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	cp -r $$site/tensorrt $$site/tensorrt_bindings $(VENV)/typings/
	sed -i -e 's/\([(,] *\)in: /\1in_: /g' -e 's/channel_axis: int) -> IScaleLayer/channel_axis: int = ...) -> IScaleLayer/' \
		$(VENV)/typings/tensorrt_bindings/tensorrt.pyi
	touch $(STAMP)

# The producers of pre-quantized checkpoints that tests/prequant runs as subprocesses (skipped, naming this target,
# where a venv is absent), each in its own venv: llm-compressor 0.14 (compressed-tensors 0.19) and gptqmodel 7.7.
# Both on the same CPU torch as trtbuild's: llm-compressor accepts it (torch >=2.10,<=2.14.0); gptqmodel declares
# torch>=2.14.1, for which PyPI has only the CUDA build (~4.5 GB with its nvidia wheels), so it is installed without
# its dependencies over that torch and its other requirements, listed here from its metadata (its CPU path runs
# there: tests/prequant/test_gptq.py). Measured on a 2-core machine: ~45 s and ~290 s, 1.5 GB each.
PEERS ?= $(HOME)/.cache/trtbuild-peers
GPTQMODEL_DEPS := "numpy>=2.4.6" "safetensors>=0.8.0" "transformers>=5.20.2" "threadpoolctl>=3.7.0" "packaging>=26.3" \
	"device-smi>=0.5.7" "protobuf>=7.36.2" "pillow>=13.0.0" "requests>=2.34.2" "pypcre>=0.6.4" "tokenicer>=0.0.14" \
	"logbar>=0.4.15" jinja2 "datasets>=5.1.0" "pyarrow>=26.0.0" "dill>=0.4.1" "defuser>=0.0.28" "accelerate>=1.15.0" \
	"filelock>=4.2.4"

setup-peers: $(PEERS)/venvs/llmcompressor/.installed $(PEERS)/venvs/gptqmodel/.installed $(PEERS)/venvs/lm-eval/.installed

$(PEERS)/venvs/llmcompressor/.installed:
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install --quiet "$(TORCH)" "llmcompressor==0.14.0.1" "compressed-tensors==0.19.0"
	touch $@

$(PEERS)/venvs/gptqmodel/.installed:
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install --quiet "$(TORCH)" $(GPTQMODEL_DEPS)
	$(@D)/bin/pip install --quiet --no-deps "gptqmodel==7.7.0"
	touch $@

# lm-evaluation-harness, which tests/serve/test_lm_eval.py runs against `serve` (its local-completions model, the
# tokenizer read from the server): no torch, no transformers; measured ~40 s and 763 MB.
$(PEERS)/venvs/lm-eval/.installed:
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install --quiet "lm-eval[api]==0.4.13"
	touch $@

# pytest exits 5 when it collected no tests: that is a failure, not a pass.
test: $(STAMP)
	@$(BIN)/python -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

# The inner loop: every test not marked `slow` (each slow one takes over a few seconds: end to end, subprocesses,
# servers, the machine-independence runs). Under 2 minutes on a quiet 2-core machine; `make test` runs them all.
test-fast: $(STAMP)
	@$(BIN)/python -m pytest -q -m "not slow"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check toolchain tests bench plugins
	$(BIN)/ruff format --check toolchain tests bench plugins
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/trtbuild tiny-model demo/tiny-llama --seed 0 --force
	$(BIN)/trtbuild run recipes/demo.yaml --force
	$(BIN)/trtbuild inspect demo/out
	$(BIN)/trtbuild verify demo/out

bench: $(STAMP)
	$(BIN)/python bench/convert.py
	$(BIN)/python bench/quantize.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/ifb.py
	$(BIN)/python bench/step_overhead.py
	$(BIN)/python bench/step_profile.py
	$(BIN)/python bench/serve.py --no-aiperf
	@echo "peers (onnxruntime-genai, vLLM CPU, in their own venvs): $(BIN)/python bench/peers.py --setup"

# On a GPU machine (the device tool's H200 image: torch with CUDA, Triton, cuda-python; no TensorRT): the Triton
# kernels natively and through the driver API as TensorRT launches them, against the reference on tests/vectors;
# compute-sanitizer; decode timings against SDPA. Writes gpu-check.json/.md to $$OUT or .; `--cpu` runs the
# native part under Triton's interpreter anywhere (docs/kernels.md).
gpu-check:
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) python3 plugins/gpu_check.py

clean:
	rm -rf demo .pytest_cache .mypy_cache .ruff_cache
