"""Find a case where vsa-core's `video_sparse_attn` property fails on the fa4 backend, and say
which part of the fa4 path it needs (session 32).

`test_properties.py::test_video_sparse_attn_matches_the_model[gpu_fa4]` failed on an H100 and
an H200 while the same property passed on the CPU through fa4's adapter with FA4's float64
model (`tests/test_fa4_model_properties.py`), so the failure lies in what only a GPU runs.
This draws cases with the property's own strategy and checks (``test_properties``'
`draw_video_case` and `check_video_case`, the GPU fa4 target) until one fails or ``--cases``
ran, then runs that case again:

- ``shipped``: as the test does;
- ``replay_off``: the fork's launch replay off (every launch through upstream's launcher);
- ``float32_dq``: the float32-reduction backward instead of the dS-writing one;
- ``triton``: the Triton fine backend (the same coarse stage and op);

and writes each run's verdict per output (out, dq, dk, dv, dgate). ::

    python3 -m research.fa4_adapter.property_failure --cases 60 --out $OUT/property_failure.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from research.harness import core_test_module


def verdicts(case: dict[str, Any], backend: str, props: Any, target: Any) -> dict | None:
    """The property's checks of ``case`` (`check_video_case`) on ``backend``: per output "ok"
    or the check's message, all of them run; None when the case's top-k is too near a tie
    for its dtype (the property skips it)."""
    found: dict[str, str] = {}

    def record(got, want, tol, what, terms=1):
        try:
            props._close(got, want, tol, what, terms)
        except AssertionError as failure:
            found[what] = str(failure)
        else:
            found[what] = "ok"

    return found if props.check_video_case(target, case, record, backend) else None


def first_failure(props: Any, target: Any, cases: int, seed: int) -> tuple[dict | None, int]:
    """The first case of the property's own strategy (`draw_video_case`) for ``target`` whose
    checks fail on fa4, within ``cases`` draws; and how many cases ran."""
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    found: list[dict] = []
    ran = [0]

    @settings(max_examples=cases, deadline=None, phases=(Phase.generate,), database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @hypothesis_seed(seed)
    @given(data=st.data())
    def search(data):
        case = props.draw_video_case(target, data)  # drawn every time: hypothesis checks
        if found:  # the draws are the same run to run
            return
        try:
            result = verdicts(case, "fa4", props, target)
        except Exception as error:  # a crash is a failure too (session 33's was a ValueError)
            result = {"call": f"{type(error).__name__}: {error}"}
        assume(result is not None)
        ran[0] += 1
        print(json.dumps({"case": case, "fa4": result}, default=str), flush=True)
        if any(v != "ok" for v in result.values()):
            found.append(case)

    search()
    return (found[0] if found else None), ran[0]


@contextlib.contextmanager
def _variant(name: str):
    """The fa4 path changed for one diagnosis run (see the module doc); yields the backend."""
    if name == "replay_off":
        from flash_attn_vsa import launch_replay

        saved = [(r, r._on_devices) for r in (launch_replay.FORWARDS, launch_replay.BACKWARDS)]
        for record, _ in saved:
            record._on_devices = lambda t: False
        try:
            yield "fa4"
        finally:
            for record, test in saved:
                record._on_devices = test
    elif name == "float32_dq":
        from flash_attn_vsa import bwd_sm90
        from vsa_core.backends import register_backend, unregister_backend
        from vsa_fa4.backend import FA4Backend
        from vsa_fa4.launch import KernelChoice

        register_backend(FA4Backend(kernels=KernelChoice(backward=bwd_sm90.KV64_CONFIG)))
        try:
            yield "fa4"
        finally:
            unregister_backend(FA4Backend.name)
    else:
        yield {"shipped": "fa4", "triton": "triton"}[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    props = core_test_module("test_properties")
    import pytest

    try:
        case, ran = first_failure(props, props.GPU_FA4, args.cases, args.seed)
    except pytest.skip.Exception as skipped:  # the backend is unusable on this machine
        raise SystemExit(f"fa4's property cannot run here: {skipped.msg}") from None
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cases_run": ran, "failing_case": case}  # fmt: skip
    if case is not None:
        report["variants"] = {}
        for name in ("shipped", "replay_off", "float32_dq", "triton"):
            with _variant(name) as backend:
                try:
                    report["variants"][name] = verdicts(case, backend, props, props.GPU_FA4)
                except Exception as error:  # a variant may refuse the case, or crash
                    report["variants"][name] = f"{type(error).__name__}: {error}"
            print(json.dumps({name: report["variants"][name]}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "variants"}, default=str))


if __name__ == "__main__":
    main()
