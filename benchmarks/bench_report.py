"""What a benchmark reports: the machine, the numbers derived, and the files written.

- `collect_metadata`: device, driver, versions, seed, environment, command line, UTC date
  (`describe_device`, `driver_info`, `distribution_versions`, `env_snapshot`);
  `gpu_result_header` / `runtime_versions`: the first fields of a standalone GPU script's
  result.
- `attention_flops`, `tflops`, `peak_tflops_for`: sparse-aware FLOPs and the dense bf16 peak
  by device name.
- `jsonable`, `write_json` (atomic), `write_json_and_markdown`, `markdown_table`,
  `load_pyplot` (matplotlib, optional): the result files.
- `error_text`, `error_fields`, `first_line`, `traceback_tail`: how an exception appears in a
  result record and a table.

Everything that needs a GPU library (matplotlib, libcuda) is imported inside the function that
uses it, so this module imports on any machine with torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import traceback
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bench_run import Replica

# FLOP multiplier of each mode relative to the forward pass (backward = 2.5 x forward).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}

# Dense bf16 tensor-core peak (TFLOP/s, no structured sparsity) by device-name substring; the
# first match wins, so more specific names come first.
PEAK_BF16_TFLOPS = (("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100", 989.0))

DISTRIBUTIONS = (
    "torch",
    "triton",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "vsa-core",
    "vsa-triton",
    "vsa-fa4",
    "flash-attn-4-vsa",
    "fastvideo-kernel",
    "matplotlib",
)
ENV_NAMES = (
    "VSA_BACKEND",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "NVIDIA_TF32_OVERRIDE",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
)
ENV_PREFIXES = ("TRITON_", "CUTE_DSL_", "FLASH_ATTENTION", "FA4_", "TORCHINDUCTOR_")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def error_text(exc: BaseException, limit: int = 2000) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def traceback_tail(exc: BaseException, lines: int = 12) -> str:
    formatted = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(formatted.rstrip().splitlines()[-lines:])


def error_fields(exc: BaseException) -> dict[str, str]:
    """A result record's fields for an exception: one-line reason, full text, traceback tail."""
    return {
        "reason": first_line(error_text(exc)),
        "error": error_text(exc),
        "traceback": traceback_tail(exc),
    }


def first_line(text: str | None, limit: int = 160) -> str:
    if not text:
        return ""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---- FLOPs, peaks ---------------------------------------------------------------------------
def attention_flops(head_dim: int, total_pairs: int, mode: str) -> float:
    """FLOPs of attention over ``total_pairs`` (query, key) pairs summed over batch and heads.

    Forward is 2 matmuls of 2 FLOPs per pair and head-dim element: 4 * D per pair, i.e.
    4 * B * H * D * P with P the pairs of one (batch, head); backward counts 2.5 x forward.
    """
    return 4.0 * head_dim * float(total_pairs) * MODE_FLOP_FACTOR[mode]


def tflops(head_dim: int, total_pairs: int, mode: str, ms: float) -> float:
    return attention_flops(head_dim, total_pairs, mode) / (ms * 1e-3) / 1e12


def peak_tflops_for(device_name: str | None, override: float | None = None) -> float | None:
    if override is not None:
        return float(override)
    if not device_name:
        return None
    for needle, peak in PEAK_BF16_TFLOPS:
        if needle.lower() in device_name.lower():
            return peak
    return None


# ---- machine description --------------------------------------------------------------------
def distribution_versions(names: Iterable[str] = DISTRIBUTIONS) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def env_snapshot(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    keep = {k: v for k, v in environ.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    return dict(sorted(keep.items()))


def driver_info() -> dict[str, Any]:
    """NVIDIA driver version from nvidia-smi, else the CUDA driver API version via libcuda,
    plus torch's CUDA runtime."""
    info: dict[str, Any] = {"torch_cuda_runtime": torch.version.cuda}
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        lines = [x.strip() for x in done.stdout.splitlines() if x.strip()]
        if done.returncode == 0 and lines:
            info["driver_version"] = lines[0]
            info["source"] = "nvidia-smi"
            return info
        info["nvidia_smi"] = f"exit {done.returncode}: {first_line(done.stderr)}"
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"unavailable ({error_text(exc, 200)})"
    if torch.cuda.is_available():
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            value = ctypes.c_int(0)
            if lib.cuDriverGetVersion(ctypes.byref(value)) == 0:
                major, minor = divmod(value.value, 1000)
                info["driver_version"] = f"CUDA driver API {major}.{minor // 10}"
                info["source"] = "libcuda cuDriverGetVersion"
        except OSError as exc:
            info["libcuda"] = error_text(exc, 200)
    info.setdefault("driver_version", None)
    return info


def describe_device(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "type": "cuda",
            "index": index,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "total_memory_gib": round(props.total_memory / 2**30, 2),
            "multiprocessors": props.multi_processor_count,
        }
    return {
        "type": device.type,
        "name": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def collect_metadata(
    device: torch.device,
    *,
    seed: int,
    argv: Sequence[str] | None = None,
    replica: Replica | None = None,
) -> dict[str, Any]:
    argv = list(sys.argv if argv is None else argv)
    cudnn = None
    with contextlib.suppress(Exception):
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "date_utc": utc_now(),
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "argv": argv,
        "host": platform.node(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": describe_device(device),
        "driver": driver_info(),
        "cudnn": cudnn,
        "versions": distribution_versions(),
        "seed": seed,
        "env": env_snapshot(),
        "replica": None if replica is None else replica.as_dict(),
    }


def gpu_result_header(benchmark: str) -> dict[str, Any]:
    """The first fields of a standalone GPU script's result: its name, UTC date, device name."""
    return {"benchmark": benchmark, "date": utc_now(), "device": torch.cuda.get_device_name()}


def runtime_versions(extra: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """Python and torch versions, then ``extra`` (a standalone GPU script's ``versions``)."""
    return {"python": platform.python_version(), "torch": torch.__version__, **(extra or {})}


# ---- output: JSON, markdown, plots ----------------------------------------------------------
def jsonable(value: Any) -> Any:
    """Non-finite floats become strings (strict JSON), tuples lists, tensors/dtypes strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return jsonable(value.item())
    return str(value)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomic write (temporary file + rename): a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(jsonable(doc), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def write_json_and_markdown(out: Path, doc: dict[str, Any], markdown: str) -> None:
    """``doc`` as JSON at ``out`` and ``markdown`` beside it (same name, ``.md``)."""
    write_json(out, doc)
    out.with_suffix(".md").write_text(markdown)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return "" if x is None else str(x).replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(cell(h) for h in headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def load_pyplot() -> tuple[Any, str | None]:
    """(matplotlib.pyplot with the Agg backend, None), or (None, why it is unavailable)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # missing or broken: plots are optional
        return None, f"matplotlib unavailable ({error_text(exc, 300)})"
    return plt, None
