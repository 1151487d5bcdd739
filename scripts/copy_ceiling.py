"""How fast a bounded number of SMs can move rows: the ceiling under dispatch's row copies, on one GPU.

To run (one GPU, no NVSHMEM, no torchrun):

    python scripts/copy_ceiling.py --rows 4096 --hidden 7168 --num-sms 24,132 --copies 1,2,8

Every mode moves ``--rows`` rows of ``--hidden`` elements, each to ``--copies`` destination rows (1: a
plain copy; 2: the rank layout's row to two ranks; 8: the expert layout's token to its 8 slots), with
``num_sms`` CTAs, and reports the slowest of the median CUDA-event times and the bytes written per
second. Modes:
    * ``regs4`` / ``regs8``: a warp per row, 128-bit loads into registers, 4 or 8 per lane in flight,
      each piece stored to every destination (``kernels.rows.copy_row_to_lanes``, what dispatch does;
      16 warps per CTA);
    * ``bulk``: a warp per row, lane 0 bulk-copies the row into a shared-memory stage (``cp.async.bulk``
      global -> shared, completion on an mbarrier) and bulk-stores it to every destination (shared ->
      global), two stages per warp so the next row's load overlaps the stores; 4 warps per CTA.
Every destination is checked against the source after the timed runs (exit 1 on a wrong byte).

Constraints: a CUDA GPU of sm_90 or newer; --hidden * element size a multiple of 16 bytes and at most
``STAGE_BYTES``; --rows, --iters >= 1. Exit status: 0 done and every copy right, 1 a wrong copy or a
run-time error, 2 bad arguments.
"""


import argparse
import statistics
import sys

DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
STAGE_BYTES = 16384  # one row per stage in the bulk mode (two stages per warp)
BULK_WARPS = 4  # 4 warps x 2 stages x 16 KB = 128 KB of shared memory per CTA
REG_WARPS = 16  # as the dispatch kernel


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--num-sms", default="24,132", help="comma list of CTA counts")
    p.add_argument("--copies", default="1,2,8", help="comma list of destinations per row")
    p.add_argument("--modes", default="regs4,regs8,bulk", help="comma list of regs4, regs8, bulk")
    p.add_argument("--iters", type=int, default=20)
    return p


def parse(argv: list[str] | None) -> argparse.Namespace | None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.sms = [int(v) for v in args.num_sms.split(",")]
        args.copy_list = [int(v) for v in args.copies.split(",")]
    except ValueError:
        print(f"error: --num-sms and --copies take comma lists of integers, got {args.num_sms!r} and "
              f"{args.copies!r}", file=sys.stderr)
        return None
    args.mode_list = [m for m in args.modes.split(",") if m]
    row_bytes = args.hidden * DTYPES[args.dtype]
    bad = [m for m in args.mode_list if m not in ("regs4", "regs8", "bulk")]
    problems = [
        (bad, f"--modes takes regs4, regs8, bulk; got {bad}"),
        (row_bytes % 16 or row_bytes > STAGE_BYTES,
         f"--hidden * element size must be a multiple of 16 and <= {STAGE_BYTES} bytes, got {row_bytes}"),
        (args.rows < 1 or args.iters < 1, f"--rows and --iters must be >= 1, got {args.rows}, {args.iters}"),
        (min(args.sms) < 1 or min(args.copy_list) < 1 or max(args.copy_list) > 32,
         f"--num-sms values must be >= 1 and --copies in [1, 32], got {args.sms} and {args.copy_list}"),
    ]
    for failed, msg in problems:
        if failed:
            print(f"error: {msg}", file=sys.stderr)
            return None
    return args


def make_kernels(dtype):
    """The copy kernels of each mode for element type ``dtype`` (traced when compiled)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.memory
    from cutlass import Int32, Int64
    from cutlass._mlir.dialects import llvm
    from cutlass._mlir.dialects import nvvm as _nvvm
    from cutlass.base_dsl.enums import AddressSpace
    from cutlass.cutlass_dsl import dsl_user_op

    from cute_ep.kernels.rows import copy_row_to_lanes

    @dsl_user_op
    def bulk_g2s(smem: cute.Pointer, src: Int64, nbytes: Int32, mbar: cute.Pointer, *, loc=None, ip=None):
        """cp.async.bulk global -> shared of ``nbytes`` (a run-time size: the DSL's bulk-copy atoms take a
        compile-time one), completing on ``mbar``."""
        dst = llvm.addrspacecast(llvm.PointerType.get(AddressSpace.dsmem), smem.to_llvm_ptr(loc=loc, ip=ip),
                                 loc=loc, ip=ip)
        gptr = llvm.inttoptr(llvm.PointerType.get(AddressSpace.gmem), Int64(src).ir_value(loc=loc, ip=ip),
                             loc=loc, ip=ip)
        _nvvm.cp_async_bulk_shared_cluster_global(dst, gptr, mbar.to_llvm_ptr(loc=loc, ip=ip),
                                                  Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)

    @dsl_user_op
    def bulk_s2g(dst: Int64, smem: cute.Pointer, nbytes: Int32, *, loc=None, ip=None):
        """cp.async.bulk shared -> global of ``nbytes`` (bulk-group completion)."""
        gptr = llvm.inttoptr(llvm.PointerType.get(AddressSpace.gmem), Int64(dst).ir_value(loc=loc, ip=ip),
                             loc=loc, ip=ip)
        _nvvm.cp_async_bulk_global_shared_cta(gptr, smem.to_llvm_ptr(loc=loc, ip=ip),
                                              Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


    class CopyKernel:
        """A launch of ``ncta`` CTAs of ``warps`` warps; a subclass writes ``kernel``."""

        warps = REG_WARPS

        @cute.jit
        def __call__(self, src: Int64, dst: Int64, rows: Int32, copies: Int32, row_bytes: Int32, ncta: Int32):
            launch = self.kernel(src, dst, rows, copies, row_bytes)
            launch.launch(grid=(ncta, 1, 1), block=(self.warps * 32, 1, 1))

    class RegisterCopy(CopyKernel):
        def __init__(self, unroll: int) -> None:
            self.unroll = unroll

        @cute.kernel
        def kernel(self, src: Int64, dst: Int64, rows: Int32, copies: Int32, row_bytes: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            ncta, _, _ = cute.arch.grid_dim()
            lane = tid % 32
            for r in range(bid * REG_WARPS + tid // 32, rows, ncta * REG_WARPS):
                mine = dst + (Int64(r) * Int64(copies) + Int64(lane)) * Int64(row_bytes)
                dests = (Int32(1) << copies) - Int32(1)
                if copies >= 32:
                    dests = Int32(-1)
                row = src + Int64(r) * Int64(row_bytes)
                copy_row_to_lanes(dtype, row, mine, dests, row_bytes // 16, lane, self.unroll)

    class BulkCopy(CopyKernel):
        warps = BULK_WARPS

        @cute.kernel
        def kernel(self, src: Int64, dst: Int64, rows: Int32, copies: Int32, row_bytes: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            ncta, _, _ = cute.arch.grid_dim()
            warp = tid // 32
            lane = tid % 32
            smem = cutlass.memory.SmemAllocator()
            stages = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(BULK_WARPS * 2 * STAGE_BYTES), 128)
            bars = smem.allocate_tensor(Int64, cute.make_layout(BULK_WARPS * 2), 8)
            if lane == 0:
                for s in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(bars.iterator + (warp * 2 + s), 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if lane == 0:
                first = bid * BULK_WARPS + warp
                step = ncta * BULK_WARPS
                n = Int32(0)  # rows this warp has loaded
                if first < rows:
                    bar = bars.iterator + warp * 2
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, row_bytes)
                    bulk_g2s(stages.iterator + warp * 2 * STAGE_BYTES, src + Int64(first) * Int64(row_bytes),
                             row_bytes, bar)
                for r in range(first, rows, step):
                    s = n % 2
                    nxt = r + step
                    if nxt < rows:
                        # the other stage's stores (issued for the row before) must have read it
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                        bar2 = bars.iterator + (warp * 2 + 1 - s)
                        cute.arch.mbarrier_arrive_and_expect_tx(bar2, row_bytes)
                        bulk_g2s(stages.iterator + (warp * 2 + 1 - s) * STAGE_BYTES,
                                 src + Int64(nxt) * Int64(row_bytes), row_bytes, bar2)
                    cute.arch.mbarrier_wait(bars.iterator + (warp * 2 + s), (n // 2) % 2)
                    for c in range(copies):
                        bulk_s2g(dst + (Int64(r) * Int64(copies) + Int64(c)) * Int64(row_bytes),
                                 stages.iterator + (warp * 2 + s) * STAGE_BYTES, row_bytes)
                    cute.arch.cp_async_bulk_commit_group()
                    n = n + 1
                cute.arch.cp_async_bulk_wait_group(0)

    return {"regs4": RegisterCopy(4), "regs8": RegisterCopy(8), "bulk": BulkCopy()}


def measure(compiled, src, dst, copies: int, ncta: int, args: argparse.Namespace, row_bytes: int):
    """(median us, right): ``args.iters`` timed launches, then every destination row against the source."""
    import torch
    from cutlass import Int32, Int64

    def run() -> None:
        compiled(Int64(src.data_ptr()), Int64(dst.data_ptr()), Int32(args.rows), Int32(copies),
                 Int32(row_bytes), Int32(ncta))

    dst.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    bits = torch.int16 if DTYPES[args.dtype] == 2 else torch.int32
    want = src.repeat_interleave(copies, dim=0)
    return statistics.median(times), torch.equal(dst[: args.rows * copies].view(bits), want.view(bits))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args is None:
        return 2
    import torch

    if not torch.cuda.is_available():  # one line instead of a traceback from the first CUDA tensor
        print("error: scripts/copy_ceiling.py needs a CUDA GPU (torch sees none)",
              file=sys.stderr)
        return 2
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    cdtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}
    row_bytes = args.hidden * DTYPES[args.dtype]
    src = torch.randn(args.rows, args.hidden, device="cuda").to(getattr(torch, args.dtype))
    dst = torch.empty(args.rows * max(args.copy_list), args.hidden, device="cuda", dtype=src.dtype)
    kernels = make_kernels(cdtype[args.dtype])
    print(f"copy ceiling: {torch.cuda.get_device_name()}, {args.rows} rows x {row_bytes} B; median of "
          f"{args.iters} (us) and bytes written per second", flush=True)
    ok = True
    for mode in args.mode_list:
        compiled = cute.compile(kernels[mode], Int64(0), Int64(0), Int32(1), Int32(1), Int32(16), Int32(1))
        for ncta in args.sms:
            for copies in args.copy_list:
                us, right = measure(compiled, src, dst, copies, ncta, args, row_bytes)
                ok = ok and right
                gbs = args.rows * copies * row_bytes / us / 1e3
                print(f"  {mode:6s} num_sms {ncta:4d} copies {copies:2d}: {us:9.1f} us  {gbs:7.1f} GB/s "
                      f"written{'' if right else '  WRONG'}", flush=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
