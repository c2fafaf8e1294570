"""A whole diffusers WanTransformer3DModel with dense attention vs VSA: the step time users feel.

Random weights at Wan 2.1's real configurations (1.3B at 480p, 14B at 720p; ``tiny`` for a CPU smoke
run), bf16 on CUDA. Per sparsity, mode (``fwd``: one denoising step's transformer forward;
``train``: forward + backward of a mean-square loss) and way (``eager``, ``compile``:
``torch.compile``, by default of each repeated block, as diffusers' ``compile_repeated_blocks``
does, so that the thirty blocks share one compiled graph per arm; ``--compile whole`` compiles the
transformer as one graph), the dense model (diffusers' own attention processors, PyTorch SDPA) and
the same model after `vsa_core.integrations.diffusers.enable_vsa` are timed one after the other (not
interleaved: the switch reinstalls processors), in both views (`bench_timing.call_views`: one call
waited for, and back to back), with peak extra memory; on a CPU nothing is timed (a smoke run).
Before timing, VSA with every tile selected and no coarse term is checked against the dense model
(bf16 tolerance).

Arms (``--arms``): ``dense`` (diffusers' processors), ``vsa``, and two that run VSA's own
processor with its attention step replaced, so everything around attention is identical to the
``vsa`` arm: ``dense_fa4`` (FlashAttention-4's dense ``flash_attn_func``: the baseline the
issue's targets name) and ``no_attention`` (the values passed through: the step's floor when
attention is free). ::

    python3 benchmarks/bench_dit.py --config wan1.3b --sparsities 0.875 0.9 --out $OUT/dit.json
    python3 benchmarks/bench_dit.py --config tiny --device cpu --ways eager --reps 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import bench_report as brep
import bench_timing as bt
import torch

from vsa_core.integrations.diffusers import VSAWanAttnProcessor, disable_vsa, enable_vsa

_WAN = dict(
    patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
    freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    rope_max_seq_len=1024,
)  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    # Wan 2.1 T2V 1.3B / 14B transformer shapes (public configs); latents before patching
    "wan1.3b": {
        "model": {**_WAN, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
        "latent": (21, 60, 104),  # 480p, 81 frames -> 21 x 30 x 52 tokens
        "text_tokens": 512,
    },
    "wan14b": {
        "model": {**_WAN, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
        "latent": (21, 90, 160),  # 720p, 81 frames -> 21 x 45 x 80 tokens
        "text_tokens": 512,
    },
    "tiny": {
        "model": dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
            cross_attn_norm=True, rope_max_seq_len=32,
        ),
        "latent": (3, 10, 12),
        "text_tokens": 8,
    },
}  # fmt: skip


@torch.compiler.disable
def _dense_fa4(query, key, value):
    """FA4's dense attention, run eagerly under ``torch.compile`` (a graph break: dynamo cannot
    trace FA4's Python launcher, which is no custom op; the block compiles around it)."""
    from flash_attn.cute import flash_attn_func

    return flash_attn_func(query, key, value)[0]


class DenseFA4Processor(VSAWanAttnProcessor):
    """VSA's processor with dense FA4 attention in place of VSA (raster-order BSHD)."""

    def attend(self, query, key, value, tiling, gate):
        return _dense_fa4(query, key, value)


class NoAttentionProcessor(VSAWanAttnProcessor):
    """VSA's processor with attention replaced by the values: what the step costs without it."""

    def attend(self, query, key, value, tiling, gate):
        return value


ARMS = ("dense", "dense_fa4", "no_attention", "vsa")


def install(model, arm: str, sparsity: float, tile, backend: str, copy_to_tiles=True) -> bool:
    """Put ``arm``'s attention into the model; True when `disable_vsa` must undo it."""
    if arm == "dense":
        return False
    settings = enable_vsa(
        model, sparsity=sparsity, tile=tile, backend=backend,
        copy_to_tiles=copy_to_tiles if arm == "vsa" else True,
    )  # fmt: skip
    processor = {"dense_fa4": DenseFA4Processor, "no_attention": NoAttentionProcessor}.get(arm)
    if processor is not None:
        for block in model.blocks:
            block.attn1.set_processor(processor(settings))
    return True


def build(config: dict[str, Any], device: torch.device, dtype: torch.dtype):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    # built on the device: initialised on the host in float32, the 14B model needs 56 GB of host
    # memory and minutes of CPU time (2 cores here: 12.7 s for 0.94 B parameters) before the
    # move, inside a GPU call of at most 10 minutes
    with torch.device(device):
        model = WanTransformer3DModel(**config["model"])
    model = model.to(device)  # anything a constructor placed on the host explicitly
    # as from_pretrained(torch_dtype=...) does: the modules diffusers keeps in float32 stay so
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not keep.intersection(name.split(".")):
            tensor.data = tensor.data.to(dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    channels = config["model"]["in_channels"]
    latent = torch.randn(1, channels, *config["latent"], generator=gen, device=device, dtype=dtype)
    text_shape = (1, config["text_tokens"], config["model"]["text_dim"])
    text = torch.randn(text_shape, generator=gen, device=device, dtype=dtype)
    return model, (latent, torch.tensor([500], device=device), text)


@contextmanager
def compiled(model, way: str, how: str) -> Iterator[Any]:
    """The model to time for ``way``: itself (``eager``), or compiled (``compile``): per
    repeated block (``how="regional"``, diffusers' ``compile_repeated_blocks``; undone on exit,
    so that later eager cells run eager) or whole (``"whole"``, a ``torch.compile`` wrapper)."""
    if way != "compile":
        yield model
        return
    if how == "whole" or not getattr(model, "_repeated_blocks", None):
        yield torch.compile(model)
        return
    model.compile_repeated_blocks()
    try:
        yield model
    finally:
        for module in model.modules():  # nn.Module.compile's state: back to the eager call
            if getattr(module, "_compiled_call_impl", None) is not None:
                module._compiled_call_impl = None


def step_fn(model, inputs, mode: str):
    def forward():
        return model(*inputs, return_dict=False)[0]

    if mode == "fwd":

        def step():
            with torch.no_grad():
                return forward()

        return step

    def train_step():
        out = forward()
        out.float().square().mean().backward()
        return out

    return train_step


def measure(fn, device: torch.device, args) -> dict[str, Any]:
    """Both views and peak extra memory on CUDA; on a CPU one call, untimed (a smoke run).
    The memory call comes first and compiles; ``args.warmup`` calls follow it."""
    if device.type != "cuda":
        fn()
        return {}
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    peak = bt.peak_extra_mib(fn, device)
    views = bt.call_views(
        fn, args.reps, b2b_calls=2, warmup=args.warmup, b2b_rounds=args.b2b_rounds
    )
    # cudaMalloc retries after freeing the cache (each synchronizes): memory pressure
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    return {**views, "peak_extra_mib": peak, "alloc_retries": retries}


def profile_step(fn, path: str) -> None:
    """One step under torch.profiler: its CUDA kernels by total time, to ``path``."""
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=90
    )
    with open(path, "w") as f:
        f.write(table)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_all_tiles(model, inputs, tile, backend: str) -> dict[str, Any]:
    """The gate before timing: VSA over every tile without the coarse term is dense attention."""
    with torch.no_grad():
        dense_out = model(*inputs, return_dict=False)[0]
        enable_vsa(model, topk=10**9, tile=tile, coarse="drop", backend=backend)
        all_tiles = model(*inputs, return_dict=False)[0]
        disable_vsa(model)
    return {"check": "all tiles, no coarse term vs dense", "rel_err": rel(all_tiles, dense_out)}


def run_cells(args, model, runner, inputs, mode: str, way: str, tile, device, log) -> None:
    """Time every arm at every sparsity for one mode and way; ``log`` each row."""
    graphs_before = _compiled_graphs()
    for sparsity in args.sparsities:
        arms = {}
        for arm in args.arms:
            installed = install(model, arm, sparsity, tile, args.backend,
                                not args.no_tile_copies)  # fmt: skip
            try:
                fn = step_fn(runner, inputs, mode)
                arms[arm] = measure(fn, device, args)
                if args.profile:
                    profile_step(fn, f"{args.profile}/{mode}-{way}-{arm}.txt")
            except Exception as exc:  # a failure is a finding: record it, go on
                arms[arm] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            finally:
                if installed:
                    disable_vsa(model)
                model.zero_grad(set_to_none=True)
            print(f"# {mode} {way} {sparsity} {arm}: {arms[arm]}", file=sys.stderr)
        row = {"mode": mode, "way": way, "sparsity": sparsity, **{
            f"{arm}_{k}": v for arm, d in arms.items() for k, v in d.items()
        }}  # fmt: skip
        for base in ("dense", "dense_fa4"):
            for view in ("once_ms", "b2b_ms"):
                pair = arms.get(base, {}), arms.get("vsa", {})
                if view in pair[0] and view in pair[1]:
                    speedup = pair[0][view] / pair[1][view]
                    row[f"speedup_vs_{base}_{view[:-3]}"] = speedup
        if way == "compile":
            row["compiled_graphs"] = _compiled_graphs() - graphs_before
        log(row)


def write_result(path: str, name: str, config: dict[str, Any], rows: list, complete: bool) -> None:
    """The result document: command, date, versions, the configuration and the rows so far
    (``complete`` once every cell ran)."""
    result = {
        "command": " ".join(["python3", *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "versions": brep.runtime_versions(),
        "config": name,
        "num_layers": config["model"]["num_layers"],
        "complete": complete,
        "rows": rows,
    }
    brep.write_json(path, result)  # atomic: a run killed mid-write keeps the previous rows


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (regional compilation: one per block
    variant, not one per block)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="wan1.3b")
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.875, 0.9])
    ap.add_argument("--modes", nargs="+", default=["fwd", "train"])
    ap.add_argument("--ways", nargs="+", default=["eager", "compile"])
    ap.add_argument(
        "--no-mix-order-reduction",
        action="store_true",
        help="turn inductor's mix-order reduction off (torch._inductor.config.triton."
        "mix_order_reduction = False): with it, torch 2.10-2.11 compiled training of Wan on "
        "CUDA fails ('CompiledFunctionBackward returned an invalid gradient ... got [1536] but "
        "expected shape compatible with [1, 1, 1536]', pytorch/pytorch#178080)",
    )
    ap.add_argument(
        "--compile",
        choices=["regional", "whole"],
        default="regional",
        help="what --ways compile compiles: each repeated block (diffusers' "
        "compile_repeated_blocks; the default) or the whole transformer",
    )
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=["dense", "vsa"])
    ap.add_argument("--backend", default="auto", help="VSA's fine backend")
    ap.add_argument("--tile", type=int, nargs=3, default=[4, 4, 4])
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="blocks of the model (default: the config's; fewer to see per-layer "
        "costs without the memory pressure of the whole stack in training)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--warmup", type=int, default=3, help="calls after the first (memory) call, untimed"
    )
    ap.add_argument(
        "--b2b-rounds",
        type=int,
        default=3,
        help="rounds of two back-to-back calls (their median is b2b_ms); with --reps and "
        "--warmup, 1 + warmup + 2 * reps + 2 * rounds calls an arm (Wan 14B: ~10 s each)",
    )
    ap.add_argument(
        "--no-tile-copies",
        action="store_true",
        help="the vsa arm with enable_vsa(copy_to_tiles=False): the fine backend reads each "
        "layer's raster q, k, v in place (triton; less memory, slower kernels)",
    )
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="diffusers' gradient checkpointing (each block's forward recomputed in the "
        "backward): what a 14B training step needs to fit one GPU",
    )
    ap.add_argument(
        "--no-check",
        action="store_true",
        help="skip the all-tiles-vs-dense check before timing (two model calls; a run that "
        "repeats an earlier run's check on the same config)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after timing each arm, profile one step (torch.profiler) and write its "
        "kernel table to DIR/<mode>-<way>-<arm>.txt",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = CONFIGS[args.config]
    if args.layers is not None:
        config = {**config, "model": {**config["model"], "num_layers": args.layers}}
    model, inputs = build(config, device, dtype)
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    tile = tuple(args.tile)
    rows: list[dict[str, Any]] = []

    def log(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:  # rewritten after every row: a run cut short keeps what it measured
            write_result(args.out, args.config, config, rows, complete=False)

    if not args.no_check:
        log(check_all_tiles(model, inputs, tile, args.backend))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if args.no_mix_order_reduction:
        import torch._inductor.config as inductor_config

        inductor_config.triton.mix_order_reduction = False
    for mode in args.modes:
        for way in args.ways:
            with compiled(model, way, args.compile) as runner:
                run_cells(args, model, runner, inputs, mode, way, tile, device, log)
    if args.out:
        write_result(args.out, args.config, config, rows, complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
