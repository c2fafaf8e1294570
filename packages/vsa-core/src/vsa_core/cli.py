"""The ``vsa`` command: ``vsa info``, ``vsa demo`` and ``vsa --version``.

A bad option never ends in a traceback: it gives one line on stderr, ``vsa demo: <option>:
<what was expected>``, and exit status 2 (argparse's convention for usage errors).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

import torch

from vsa_core.backends import OVERRIDE_ENV, AttentionCall, backend_entries, select_backend
from vsa_core.backends.registry import backend_override, refusal
from vsa_core.coarse import pool_tiles, select_topk
from vsa_core.layout import BlockSparseLayout
from vsa_core.ops import block_sparse_attn, video_sparse_attn
from vsa_core.tiling import VideoTiling

OUR_PACKAGES = ("vsa-core", "vsa-triton", "vsa-fa4", "flash-attn-4-vsa")
THIRD_PARTY = ("torch", "triton", "flash-attn-4", "nvidia-cutlass-dsl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Parser(argparse.ArgumentParser):
    """argparse, with every usage error as one line ``<prog>: <option>: <message>`` (exit 2)
    instead of the usage text and ``error: argument <option>: ...``."""

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        self.exit(2, f"{self.prog}: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="vsa", description="Video Sparse Attention tools")
    parser.add_argument(
        "--version",
        action="version",
        version=versions_line(),
        help="print the versions of the installed vsa packages and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, GPU and the state of every backend")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    demo = sub.add_parser(
        "demo", help="run VSA on a synthetic video latent and check it against the reference"
    )
    _add_demo_arguments(demo)
    args = parser.parse_args(argv)
    if args.command == "info":
        return run_info(as_json=args.json)
    return run_demo(args)


def versions_line() -> str:
    """``vsa-core 0.1.0, vsa-triton 0.1.0, ...``: the installed ones of our packages."""
    installed = [(name, _version(name)) for name in OUR_PACKAGES]
    return ", ".join(f"{name} {ver}" for name, ver in installed if ver is not None)


# ---- vsa info --------------------------------------------------------------------------------
def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA version the installed NVIDIA driver supports, as (major, minor), or
    None when no driver is found (a CPU-only machine). Asks the driver itself
    (``cuDriverGetVersion``, which needs no GPU context), so it works where torch cannot use
    the GPU, e.g. because the driver is too old for torch's CUDA runtime."""
    names = {"win32": ("nvcuda.dll",), "darwin": ()}.get(
        sys.platform, ("libcuda.so.1", "libcuda.so")
    )
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            number = ctypes.c_int(0)
            if lib.cuDriverGetVersion(ctypes.byref(number)) == 0 and number.value > 0:
                return number.value // 1000, number.value % 1000 // 10
        except (OSError, AttributeError):
            continue
    return None


def parse_cuda_version(text: str | None) -> tuple[int, int] | None:
    """``"12.8"`` -> (12, 8); None for None or anything unreadable."""
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (TypeError, ValueError):
        return None


def driver_warning(runtime: str | None, driver: tuple[int, int] | None) -> str | None:
    """Why torch's CUDA runtime ``runtime`` (``torch.version.cuda``) cannot trust a driver
    that supports CUDA up to ``driver``, or None when it is new enough (or either is unknown,
    e.g. a CPU build of torch, or no driver)."""
    needed = parse_cuda_version(runtime)
    if needed is None or driver is None or driver >= needed:
        return None
    have = f"{driver[0]}.{driver[1]}"
    text = (
        f"torch {torch.__version__} is built for CUDA {runtime}, but the NVIDIA driver "
        f"supports CUDA up to {have}: install a driver for CUDA {runtime} or newer, or a "
        f"torch built for CUDA {have} or older"
    )
    if driver[0] == needed[0]:
        text += (
            " (within one major version, minor version compatibility may run prebuilt "
            "kernels, not code compiled at run time such as Triton's)"
        )
    return text


def collect_info() -> dict:
    """Everything ``vsa info`` reports, as plain data."""
    driver = driver_cuda_version()
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            devices.append(
                {
                    "index": i,
                    "name": torch.cuda.get_device_name(i),
                    "capability": f"sm_{major}{minor}",
                }
            )
    device = torch.device("cuda", 0) if devices else torch.device("cpu")
    # What a typical training call on this machine would need: bf16, D=128, 64-token tiles.
    call = AttentionCall(device, torch.bfloat16, 128, (64, 64), requires_grad=True)
    backends = []
    for name, entry in sorted(
        backend_entries().items(),
        key=lambda kv: -(kv[1].backend.priority_for(call) if kv[1].backend else -1),
    ):
        if entry.backend is None:
            state, reason = "unusable", entry.load_error
        else:
            reason = entry.backend.availability()
            if reason is None:
                reason = entry.backend.supports(call)
                state = "available" if reason is None else "refuses the typical call"
            else:
                state = "unavailable"
        backends.append({"name": name, "origin": entry.origin, "state": state, "reason": reason,
                         "capabilities": _capabilities(entry.backend)})  # fmt: skip
    return {
        "python": platform.python_version(),
        "shapes": _shape_table(device),
        "packages": {name: _version(name) for name in OUR_PACKAGES},
        "dependencies": {name: _version(name) for name in THIRD_PARTY},
        "torch_cuda": torch.version.cuda,
        "cuda_driver": None if driver is None else f"{driver[0]}.{driver[1]}",
        "warnings": [w for w in (driver_warning(torch.version.cuda, driver),) if w],
        "devices": devices,
        "typical_call": "bfloat16, head_dim 128, 64x64 blocks, with gradients, on " + str(device),
        "auto_picks": select_backend(call).name,
        "backends": backends,
        "deterministic": _verdicts(call, deterministic=True),
        "raster_in_place": _verdicts(call, raster_inputs=True),
    }


CAPABILITIES = {
    # Backend class attribute -> what `vsa info` says when it is set (`vsa_core.backends.base`)
    "fuses_combine": "fused combine (inference: fine + gate * coarse in the fine kernel)",
    "reads_raster": "reads raster rows (copy_to_tiles=False)",
    "key_padding_safe": "reads key padding as it is (no zeroed copies)",
    "handles_deterministic": "deterministic=True where it can keep it",
}


def _capabilities(backend) -> list[str]:
    """The optional capabilities a backend declares (its class attributes set), by name."""
    if backend is None:
        return []
    return [name for name in CAPABILITIES if getattr(backend, name, False)]


def _verdicts(call: AttentionCall, **changes) -> dict:
    """The typical training call with ``changes`` (``deterministic=True``: bitwise
    reproducible; ``raster_inputs=True``: `video_sparse_attn`'s ``copy_to_tiles=False``): each
    usable backend's verdict (None = runs it, else why not) and auto's pick (None if none
    can)."""
    call = dataclasses.replace(call, **changes)
    verdicts = {name: refusal(b, call) for name, b in sorted(_usable_backends().items())}
    try:
        pick = select_backend(call).name
    except ValueError:
        pick = None
    return {"verdicts": verdicts, "auto_picks": pick}


WAN_480P = (12 * 39_936, 39_936)  # (query rows, query length): 12 heads x Wan 2.1 480p's
WAN_720P = (40 * 92_160, 92_160)  # 40 heads x Wan 2.1 720p's padded tile-order tokens
HUNYUAN_720P = (24 * 138_240, 138_240)  # 24 heads x HunyuanVideo 720p's
INFO_SHAPES: tuple[tuple[tuple[int, int], int, bool, tuple[int, int]], ...] = (
    ((64, 64), 1, False, WAN_480P),
    ((64, 64), 1, False, WAN_720P),
    ((64, 64), 1, False, HUNYUAN_720P),
    ((64, 64), 1, True, WAN_720P),
    ((64, 64), 2, False, WAN_720P),
    ((128, 64), 1, False, WAN_720P),
    ((128, 128), 1, False, WAN_720P),
    ((256, 256), 1, False, WAN_720P),
)
"""(block shape, q_group_size, kv_blocks_full, (query rows, query length)) rows of ``vsa
info``'s table: 64x64 at three problem sizes, and with pairs sharing key lists (refined from a
coarser layout) or all key blocks full (a tile-aligned latent), since backends may rank those
differently."""


def _usable_backends() -> dict:
    """The installed backends that loaded and are available on this machine, by name."""
    return {
        name: entry.backend
        for name, entry in backend_entries().items()
        if entry.backend is not None and entry.backend.availability() is None
    }


def _shape_table(device: torch.device) -> list[dict]:
    """Per block shape and pass (inference, training): every usable backend's verdict on a
    bf16, head dim 128 call on ``device`` (None = runs it, else its reason) and auto's pick."""
    usable = _usable_backends()
    rows = []
    for block_shape, group, full, (query_rows, query_len) in INFO_SHAPES:
        for grad in (False, True):
            call = AttentionCall(
                device, torch.bfloat16, 128, block_shape, grad, group, full,
                query_rows=query_rows, query_len=query_len,
            )  # fmt: skip
            notes = {name: b.ranking_note(call) for name, b in usable.items()}
            rows.append(
                {
                    "block_shape": list(block_shape),
                    "q_group_size": group,
                    "kv_blocks_full": full,
                    "query_rows": query_rows,
                    "query_len": query_len,
                    "requires_grad": grad,
                    "verdicts": {name: b.supports(call) for name, b in usable.items()},
                    "auto_picks": select_backend(call).name,
                    "auto_rules": {name: note for name, note in notes.items() if note},
                }
            )
    return rows


def _print_shape_table(rows: list[dict]) -> None:
    names = sorted({n for r in rows for n in r["verdicts"]})
    print("per block shape (bfloat16, head_dim 128; forward / forward+backward):")
    reasons: dict[str, int] = {}
    by_shape: dict[str, list[dict]] = {}
    for r in rows:
        label = "x".join(map(str, r["block_shape"])) + (
            f" ({r['query_rows'] / 1e6:.1f} M rows, {r['query_len']:,} tokens a head)"
        )
        if r["q_group_size"] > 1:
            label += f" (pairs share lists, q_group_size {r['q_group_size']})"
        if r["kv_blocks_full"]:
            label += " (key blocks all full)"
        by_shape.setdefault(label, []).append(r)
    for label, (fwd, bwd) in by_shape.items():
        cells = []
        for name in names:
            marks = []
            for r in (fwd, bwd):
                reason = r["verdicts"].get(name)
                if reason is None:
                    marks.append("ok")
                else:
                    marks.append(f"no[{reasons.setdefault(reason, len(reasons) + 1)}]")
            cells.append(f"{name} {'/'.join(marks)}")
        picks = f"auto: {fwd['auto_picks']} / {bwd['auto_picks']}"
        print(f"  {label:<56} {'  '.join(cells)}  {picks}")
        for r in (fwd, bwd):
            mode = "training" if r["requires_grad"] else "inference"
            for name, note in r.get("auto_rules", {}).items():
                print(f"      rule ({mode}): {name} {note}")
    for reason, number in reasons.items():
        print(f"  [{number}] {reason}")


def _print_verdicts(title: str, verdicts: dict) -> None:
    """One `_verdicts` section: auto's pick, then each backend's verdict."""
    print(f"{title}: auto picks {verdicts['auto_picks'] or 'none'}")
    for name, reason in verdicts["verdicts"].items():
        print(f"  {name:<10} {'ok' if reason is None else 'refuses: ' + reason}")


def run_info(as_json: bool = False) -> int:
    info = collect_info()
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"python {info['python']}")
    for name, ver in {**info["packages"], **info["dependencies"]}.items():
        print(f"  {name:<20} {ver or 'not installed'}")
    cuda = info["torch_cuda"] or "none (CPU build)"
    print(f"torch CUDA runtime: {cuda}")
    driver = info["cuda_driver"]
    print(f"CUDA driver: {driver or 'none found'}")
    for warning in info["warnings"]:
        print(f"warning: {warning}")
    if info["devices"]:
        for d in info["devices"]:
            print(f"GPU {d['index']}: {d['name']} ({d['capability']})")
    else:
        print("GPU: none visible (CPU only)")
    print(f"backends, for a typical call ({info['typical_call']}):")
    for b in info["backends"]:
        line = f"  {b['name']:<10} {b['state']}"
        if b["reason"]:
            line += f": {b['reason']}"
        print(line)
        for name in b["capabilities"]:
            print(f"  {'':<10} - {CAPABILITIES[name]}")
    print(f"backend='auto' picks: {info['auto_picks']}")
    _print_verdicts("with deterministic=True", info["deterministic"])
    _print_verdicts("with copy_to_tiles=False", info["raster_in_place"])
    _print_shape_table(info["shapes"])
    return 0


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# ---- vsa demo --------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive integer, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, got {text!r}") from None


def _sparsity(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a number in [0, 1), got {text!r}")
    return value


def _device_name(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"cpu, cuda, cuda:N or auto, got {text!r}")


def _backend_name(text: str) -> str:
    known = sorted(["auto", *backend_entries()])
    if text not in known:
        raise argparse.ArgumentTypeError(f"one of {', '.join(known)}, got {text!r}")
    return text


def _add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--latent",
        type=_positive_int,
        nargs=3,
        metavar=("T", "H", "W"),
        help="latent shape (default: 9 22 30 on CPU, 21 30 52 = Wan 480p on GPU)",
    )
    p.add_argument(
        "--tile", type=_positive_int, nargs=3, default=(4, 4, 4), metavar=("t", "h", "w")
    )
    p.add_argument("--heads", type=_positive_int, help="default: 4 on CPU, 12 on GPU")
    p.add_argument("--head-dim", type=_positive_int, help="default: 64 on CPU, 128 on GPU")
    p.add_argument(
        "--sparsity",
        type=_sparsity,
        default=0.875,
        help="share of key tiles each query tile skips, in [0, 1) (default 0.875)",
    )
    p.add_argument(
        "--topk", type=_positive_int, help="key tiles per query tile (overrides --sparsity)"
    )
    p.add_argument(
        "--backend",
        type=_backend_name,
        default="auto",
        help=f"a backend name or auto (default; the {OVERRIDE_ENV} variable may replace it)",
    )
    p.add_argument(
        "--device", type=_device_name, default="auto", help="cpu, cuda, cuda:N or auto (default)"
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on GPU"
    )
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed runs after one warm-up")
    p.add_argument("--seed", type=_int, default=0)


def _demo_error(option: str, expected: str) -> NoReturn:
    """A bad option found after parsing: one line, exit status 2 (as for argparse's)."""
    print(f"vsa demo: {option}: {expected}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def run_demo(args: argparse.Namespace) -> int:
    device = _demo_device(args.device)
    on_gpu = device.type == "cuda"
    latent = tuple(args.latent) if args.latent else ((21, 30, 52) if on_gpu else (9, 22, 30))
    heads = args.heads or (12 if on_gpu else 4)
    head_dim = args.head_dim or (128 if on_gpu else 64)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if on_gpu else torch.float32)
    tiling = VideoTiling(latent, tuple(args.tile))
    n = tiling.num_tiles
    topk = args.topk if args.topk is not None else max(1, round((1 - args.sparsity) * n))
    if not 1 <= topk <= n:
        _demo_error("--topk", f"an integer in [1, {n}] (the number of tiles), got {topk}")

    _say(
        f"latent {latent}, tile {tiling.tile_shape}: {n} tiles, {tiling.seq_len} tokens "
        f"({tiling.padded_len} padded), {heads} heads x {head_dim}, {dtype}, {device}"
    )
    _say(f"top-k {topk} of {n} tiles per query tile: {1 - topk / n:.1%} sparse")
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (
        t.to(device=device, dtype=dtype) for t in synthetic_video_qkv(latent, heads, head_dim, gen)
    )
    # Permute to tile order once, as a model would once per forward pass (not per layer).
    q, k, v = (tiling.to_tiles(t) for t in (q, k, v))

    valid = tiling.valid_sizes(device)
    layout = select_topk(
        pool_tiles(q, valid), pool_tiles(k, valid), valid, topk, tiling.tile_tokens
    )
    try:
        backend = select_backend(AttentionCall.describe(q, k, v, layout), args.backend)
    except ValueError as exc:
        from_env = args.backend == "auto" and backend_override()
        what = f"a backend that runs {dtype} on {device} with {tiling.tile_tokens}-token tiles"
        _demo_error(OVERRIDE_ENV if from_env else "--backend", f"{what}; {exc}")
    _say(f"backend: {backend.name}")

    seconds = _time_op(
        lambda: video_sparse_attn(q, k, v, topk=topk, tiling=tiling, backend=backend.name),
        device,
        args.repeats,
    )
    _say(f"video_sparse_attn: {seconds * 1e3:.2f} ms (median of {args.repeats})")

    # Accuracy of the fine stage on the very tiles VSA selected, against the float64 reference.
    out, _ = block_sparse_attn(q, k, v, layout, backend=backend.name)
    ref, _ = block_sparse_attn(*(t.double() for t in (q, k, v)), layout, backend="reference")
    real = tiling.indices(device).nonpad_index
    diff = (out.double() - ref)[:, real]
    rel_l2 = (diff.norm() / ref[:, real].norm().clamp(min=1e-300)).item()
    _say(
        f"fine attention vs float64 reference: max |error| {diff.abs().max().item():.2e}, "
        f"relative L2 {rel_l2:.2e}"
    )

    captured = attention_mass_captured(q, k, layout, tiling)
    _say(
        f"selected tiles capture {captured:.1%} of dense attention mass "
        f"(a random choice of {topk} tiles would capture about {topk / n:.1%})"
    )
    return 0


def synthetic_video_qkv(
    latent: tuple[int, int, int], heads: int, head_dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [1, T*H*W, heads, head_dim] in raster order from a spatially smooth latent.

    Features are random noise at 1/4 resolution, upsampled trilinearly: neighbouring tokens
    look alike, so (as in real video latents) attention concentrates on nearby tokens.
    """
    channels = 32
    coarse = [max(2, math.ceil(s / 4)) for s in latent]
    field = torch.randn(1, channels, *coarse, generator=gen)
    field = torch.nn.functional.interpolate(
        field, size=latent, mode="trilinear", align_corners=True
    )
    tokens = field.flatten(2).transpose(1, 2)[0]  # [S, C]
    tokens = tokens - tokens.mean(0)
    if tokens.shape[0] > 1:  # one token has no spread (std would be NaN): leave it at 0
        tokens = tokens / tokens.std(0).clamp(min=1e-12)
    proj = torch.randn(channels, heads * head_dim, generator=gen) / math.sqrt(channels)
    noise = [torch.randn(tokens.shape[0], heads * head_dim, generator=gen) for _ in range(3)]
    # Matching q/k logits reach about sharpness**2 * sqrt(D) = 9: peaked, not one-hot.
    sharpness = 3.0 / head_dim**0.25
    q = sharpness * tokens @ proj + 0.3 * noise[0]
    k = sharpness * tokens @ proj + 0.3 * noise[1]
    v = tokens @ torch.randn(channels, heads * head_dim, generator=gen) + 0.1 * noise[2]
    return tuple(t.view(1, -1, heads, head_dim) for t in (q, k, v))  # type: ignore[return-value]


@torch.no_grad()
def attention_mass_captured(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: BlockSparseLayout,
    tiling: VideoTiling,
    max_query_tiles: int = 64,
) -> float:
    """Mean share of dense softmax mass that falls in the selected tiles (real tokens only).

    Evaluated on at most ``max_query_tiles`` query tiles, evenly spaced, to bound the cost.
    """
    idx = tiling.indices(q.device)
    real_keys = idx.tile_to_raster >= 0
    key_tile = torch.arange(tiling.padded_len, device=q.device) // tiling.tile_tokens
    selected = layout.to_block_mask()[0]  # [H, N, N]
    step = max(1, layout.num_q_blocks // max_query_tiles)
    shares = []
    for tile in range(0, layout.num_q_blocks, step):
        rows = slice(tile * tiling.tile_tokens, (tile + 1) * tiling.tile_tokens)
        q_rows = q[0, rows].transpose(0, 1).float()  # [H, T, D]
        scores = q_rows @ k[0].transpose(0, 1).float().transpose(1, 2) * q.shape[-1] ** -0.5
        probs = scores.masked_fill(~real_keys, float("-inf")).softmax(-1)
        inside = selected[:, tile, key_tile]  # [H, S]: key token lies in a selected tile
        share = (probs * inside.unsqueeze(1)).sum(-1)  # [H, T]
        real_rows = idx.tile_to_raster[rows] >= 0
        shares.append(share[:, real_rows].flatten())
    return torch.cat(shares).mean().item()


def _time_op(fn, device: torch.device, repeats: int) -> float:
    with torch.no_grad():
        fn()  # warm-up (compilation, caches)
        times = []
        for _ in range(max(1, repeats)):
            if device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _demo_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            _demo_error("--device", f"cpu or auto: no CUDA device is visible, got {name!r}")
        if device.index is not None and device.index >= count:
            _demo_error("--device", f"cuda:0 to cuda:{count - 1} ({count} visible), got {name!r}")
    return device


def _say(message: str) -> None:
    print(f"[vsa demo] {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
