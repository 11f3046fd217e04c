"""The GPU check's kernel-shape step: each case of ``kernel_plan`` against its float32
reference, recorded as pass/fail, ``|out - ref| / |ref|`` (norms over the whole output), the
reference's own error in the kernel's dtype beside it, the median time (``do_bench``) and the
exception, if any. A case that fails or raises never stops the others; the JSON is rewritten
after every case, so a run stopped by its limit leaves what it measured.

    python -m benchmarks.gpu_check.kernel_shapes --out kernel_shapes.json [--dry-run]

A first pass builds and checks every case (compiling its kernels) in a few threads, so that
Triton's compiles overlap; the timings follow, one case at a time.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.gpu_check.kernel_cases import Case, Prepared
from benchmarks.gpu_check.kernel_plan import cases

# The error beyond which a kernel fails, unless the reference in the same dtype errs as much
# (then twice that, up to five times this).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass
class CaseResult:
    name: str
    kernel: str
    shape: str
    dtype: str
    status: str = "error"  # pass | fail | error
    rel_err: float | None = None
    ref_native_rel_err: float | None = None
    median_ms: float | None = None
    seconds: float = 0.0  # building, compiling and checking it
    error: str | None = None


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).norm()
    return float(diff / ref.float().norm().clamp(min=1e-30))


def check(case: Case, device: torch.device) -> tuple[CaseResult, Prepared | None]:
    result = CaseResult(case.name, case.kernel, case.shape, str(case.dtype)[6:])
    begin = time.monotonic()
    prepared = None
    try:
        prepared = case.build(device)
        out = prepared.ours()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result.rel_err = relative_error(out, prepared.ref32)
        if prepared.ref_native is not None:
            result.ref_native_rel_err = relative_error(prepared.ref_native, prepared.ref32)
        tol = TOLERANCE[case.dtype]
        # (capped: a reference broken in the low dtype must not excuse the kernel)
        allowed = max(tol, min(2 * (result.ref_native_rel_err or 0.0), 5 * tol))
        finite = bool(torch.isfinite(out.float()).all())
        result.status = "pass" if finite and result.rel_err <= allowed else "fail"
    except Exception as exc:
        result.error = "".join(traceback.format_exception_only(exc)).strip()[-2000:]
        prepared = None
    result.seconds = round(time.monotonic() - begin, 2)
    return result, prepared


def time_case(prepared: Prepared, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(prepared.ours, warmup=5, rep=25, return_mode="median"))
    begin = time.perf_counter()  # the interpreter: one call, to prove the path
    prepared.ours()
    return (time.perf_counter() - begin) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--workers", type=int, default=4, help="threads building and compiling cases (GPU)")
    ap.add_argument("--only", nargs="+", default=None, help="cases whose name contains one of these")
    args = ap.parse_args(argv)

    device = torch.device("cpu" if args.dry_run else "cuda")
    plan = [c for c in cases(args.dry_run) if args.only is None or any(s in c.name for s in args.only)]
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "cases": []}
    begin = time.monotonic()

    def write() -> None:
        report["seconds"] = round(time.monotonic() - begin, 1)
        report["counts"] = {s: sum(r["status"] == s for r in report["cases"]) for s in ("pass", "fail", "error")}
        args.out.write_text(json.dumps(report, indent=2))

    # (the interpreter is not thread-safe: one thread there)
    workers = 1 if args.dry_run else max(1, args.workers)
    with ThreadPoolExecutor(workers) as pool:
        checked = list(pool.map(lambda c: check(c, device), plan))
    # Two threads compiling one Triton kernel at once can race inside Triton (seen on an H200
    # with 3.6: "lazy wrapper should be called at most once"), which says nothing of the kernel:
    # a case that raised is checked again alone, and that answer stands. (One thread compiles
    # the 30 cases in minutes, four in seconds.)
    checked = [(r, p) if r.error is None else check(case, device) for case, (r, p) in zip(plan, checked, strict=True)]
    for result, _ in checked:
        report["cases"].append(asdict(result))
    write()
    for i, (result, prepared) in enumerate(checked):
        if prepared is not None:
            try:
                report["cases"][i]["median_ms"] = round(time_case(prepared, device), 4)
            except Exception as exc:
                report["cases"][i]["error"] = f"timing: {exc}"
        checked[i] = (result, None)  # free its tensors
        r = report["cases"][i]
        print(
            f"{r['status']:<5} {r['name']:<60} err {r['rel_err'] if r['rel_err'] is not None else '-':<10.3g}"
            if r["rel_err"] is not None
            else f"{r['status']:<5} {r['name']:<60} {r['error']}",
            f"ref {r['ref_native_rel_err']:.3g}" if r["ref_native_rel_err"] is not None else "",
            f"{r['median_ms']:.3f} ms" if r["median_ms"] is not None else "",
            flush=True,
        )
        write()
    print(f"kernel_shapes: {report['counts']} in {report['seconds']:.0f}s")
    return 0 if report["counts"]["fail"] + report["counts"]["error"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
