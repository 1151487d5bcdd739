"""How fast a bounded number of SMs can move rows: the ceiling under dispatch's row copies, on one GPU
or across the GPUs of one node.

To run:

    python scripts/copy_ceiling.py --rows 4096 --hidden 7168 --num-sms 24,132 --copies 1,2,8
    torchrun --nproc-per-node 2 scripts/copy_ceiling.py --copies 2            # a copy here, one on the peer
    torchrun --nproc-per-node 2 scripts/copy_ceiling.py --copies 1 --peers-only   # the link alone
    torchrun --nproc-per-node 2 scripts/copy_ceiling.py --copies 1 --pull         # reads over the link

Every mode moves ``--rows`` rows of ``--hidden`` elements, each to ``--copies`` destination rows (1: a
plain copy; 2: the rank layout's row to two ranks; 8: the expert layout's token to its 8 slots), with
``num_sms`` CTAs, and reports the slowest rank's median CUDA-event time and the bytes written per second.
In a world of one every copy lands on this GPU. Launched with torchrun (a world of W ranks, one per GPU of
one node, NVSHMEM peer pointers) every rank copies at once, after a barrier on the GPU, and copy c of a
row goes to rank (rank + c) % W (with --peers-only (rank + 1 + c) % W: nothing to this rank while
--copies < W); the line then also gives the bytes each rank wrote into other ranks' memory per second
("off-rank"), the rate the dispatch's NVLink traffic is held to. With --pull every rank instead reads the
rows of rank (rank + 1) % W through its peer pointer into its own memory (one copy per row), as the pull
combines read their rows: the line gives the bytes read from the peer per second. Modes:
    * ``regs4`` / ``regs8``: a warp per row, 128-bit loads into registers, 4 or 8 per lane in flight,
      each piece stored to every destination (``kernels.rows.copy_row_to_lanes``, what dispatch does;
      16 warps per CTA);
    * ``bulk``: a warp per row, lane 0 bulk-copies the row into a shared-memory stage (``cp.async.bulk``
      global -> shared, completion on an mbarrier) and bulk-stores it to every destination (shared ->
      global), two stages per warp so the next row's load overlaps the stores; 4 warps per CTA.
Every destination is checked against its source after the timed runs (exit 1 on a wrong byte). A rank
that waits more than --timeout seconds for the GPU (a peer that never reached the barrier) says so and
exits 1.

Constraints: a CUDA GPU of sm_90 or newer; --hidden * element size a multiple of 16 bytes and at most
``STAGE_BYTES``; --rows, --iters >= 1; --peers-only and --pull need a world of 2 or more, --pull one
copy and not --peers-only. Exit status: 0 done and
every copy right, 1 a wrong copy or a run-time error, 2 bad arguments.
"""

import argparse
import os
import statistics
import sys
import time

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
    p.add_argument("--peers-only", action="store_true",
                   help="with torchrun: copy c goes to rank (rank + 1 + c) %% world "
                        "(none here while copies < world)")
    p.add_argument("--pull", action="store_true",
                   help="with torchrun: each rank reads rank (rank + 1) %% world's rows into its own memory "
                        "(--copies 1)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank waits for the GPU before it exits")
    return p


def world_size() -> int:
    """The launch's world size (torchrun's WORLD_SIZE; 1 without torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


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
        (args.peers_only and world_size() < 2,
         "--peers-only needs a world of 2 or more ranks (launch with torchrun --nproc-per-node 2 or more), "
         f"got WORLD_SIZE={world_size()}"),
        (args.pull and (world_size() < 2 or args.peers_only or args.copy_list != [1]),
         "--pull needs a world of 2 or more ranks, --copies 1 and no --peers-only (each rank reads the next "
         f"rank's rows once), got WORLD_SIZE={world_size()}, --copies {args.copies}"
         f"{', --peers-only' if args.peers_only else ''}"),
        (args.timeout <= 0, f"--timeout must be > 0, got {args.timeout}"),
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

    from cute_ep.kernels.rows import copy_row_to_lanes, gmem_tensor

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
        """A launch of ``ncta`` CTAs of ``warps`` warps; a subclass writes ``kernel``. Copy c of row r
        lands at ``bases[c] + r * row_bytes`` (``bases``: the address of ``copies`` int64 addresses, this
        GPU's or a peer's memory)."""

        warps = REG_WARPS

        @cute.jit
        def __call__(self, src: Int64, bases: Int64, rows: Int32, copies: Int32, row_bytes: Int32,
                     ncta: Int32):
            launch = self.kernel(src, bases, rows, copies, row_bytes)
            launch.launch(grid=(ncta, 1, 1), block=(self.warps * 32, 1, 1))

    class RegisterCopy(CopyKernel):
        def __init__(self, unroll: int) -> None:
            self.unroll = unroll

        @cute.kernel
        def kernel(self, src: Int64, bases: Int64, rows: Int32, copies: Int32, row_bytes: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            ncta, _, _ = cute.arch.grid_dim()
            lane = tid % 32
            table = gmem_tensor(Int64, bases, cute.make_layout(32), 8)
            base = Int64(0)  # lane c holds copy c's base
            if lane < copies:
                base = table[lane]
            dests = (Int32(1) << copies) - Int32(1)
            if copies >= 32:
                dests = Int32(-1)
            for r in range(bid * REG_WARPS + tid // 32, rows, ncta * REG_WARPS):
                mine = base + Int64(r) * Int64(row_bytes)
                row = src + Int64(r) * Int64(row_bytes)
                copy_row_to_lanes(dtype, row, mine, dests, row_bytes // 16, lane, self.unroll)

    class BulkCopy(CopyKernel):
        warps = BULK_WARPS

        @cute.kernel
        def kernel(self, src: Int64, bases: Int64, rows: Int32, copies: Int32, row_bytes: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            ncta, _, _ = cute.arch.grid_dim()
            warp = tid // 32
            lane = tid % 32
            table = gmem_tensor(Int64, bases, cute.make_layout(32), 8)
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
                        bulk_s2g(table[c] + Int64(r) * Int64(row_bytes),
                                 stages.iterator + (warp * 2 + s) * STAGE_BYTES, row_bytes)
                    cute.arch.cp_async_bulk_commit_group()
                    n = n + 1
                cute.arch.cp_async_bulk_wait_group(0)

    return {"regs4": RegisterCopy(4), "regs8": RegisterCopy(8), "bulk": BulkCopy()}


def wait_gpu(what: str, rank: int, timeout: float) -> None:
    """Wait for this rank's queued GPU work; after ``timeout`` s say where it waits and exit 1."""
    import torch

    done = torch.cuda.Event()
    done.record()
    start = time.monotonic()
    while not done.query():
        if time.monotonic() - start > timeout:
            print(f"error: rank {rank} waited {timeout:.0f} s for the GPU ({what}): a peer never reached it",
                  file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(1e-4)


def source_rows(args: argparse.Namespace, rank: int):
    """Rank ``rank``'s rows [rows, hidden], drawn on the GPU from a seed every rank knows (a receiver
    checks a sender's copies against them)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    return torch.randn(args.rows, args.hidden, device="cuda", generator=g).to(getattr(torch, args.dtype))


class Places:
    """Where copy c of this rank's rows lands: block ``rank * max_copies + c`` of the receive rows of rank
    ``(rank + shift + c) % world`` (a world of one: this GPU's rows; else NVSHMEM symmetric rows reached
    through peer pointers). With ``args.pull``: this rank's block of its own receive rows, copied from the
    rows of rank ``(rank + 1) % world`` (``source_of``)."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, dtype) -> None:
        import torch

        self.rank, self.world, self.args = rank, world, args
        self.shift = 1 if args.peers_only else 0
        self.max_copies = max(args.copy_list)
        shape = (world * self.max_copies * args.rows, args.hidden)
        if world == 1:
            self.recv = torch.empty(shape, device="cuda", dtype=dtype)
        else:
            import nvshmem.core as nvshmem

            self.recv = nvshmem.tensor(shape, dtype=dtype)
        self.bytes_per_block = args.rows * args.hidden * self.recv.element_size()

    def target(self, sender: int, c: int) -> int:
        return sender if self.args.pull else (sender + self.shift + c) % self.world

    def source_of(self, sender: int) -> int:
        """The rank whose rows ``sender``'s copies hold: the next one when pulling, else ``sender``."""
        return (sender + 1) % self.world if self.args.pull else sender

    def bases(self, copies: int):
        """int64 [copies]: the address of each copy's first row."""
        import torch

        addrs = []
        for c in range(copies):
            t = self.target(self.rank, c)
            if t == self.rank:
                base = self.recv.data_ptr()
            else:
                import nvshmem.core as nvshmem

                base = nvshmem.get_peer_tensor(self.recv, t).data_ptr()
            addrs.append(base + (self.rank * self.max_copies + c) * self.bytes_per_block)
        return torch.tensor(addrs, dtype=torch.int64, device="cuda")

    def off_rank(self, copies: int) -> int:
        """Copies of a row this rank writes into (or with ``pull`` reads from) other ranks' memory."""
        if self.args.pull:
            return copies
        return sum(self.target(self.rank, c) != self.rank for c in range(copies))

    def right(self, copies: int) -> bool:
        """Every block another rank (or this one) copied here equals that sender's rows, bit for bit."""
        import torch

        bits = torch.int16 if self.recv.element_size() == 2 else torch.int32
        rows = self.args.rows
        ok = True
        for sender in range(self.world):
            want = None
            for c in range(copies):
                if self.target(sender, c) != self.rank:
                    continue
                want = source_rows(self.args, self.source_of(sender)) if want is None else want
                block = (sender * self.max_copies + c) * rows
                ok = ok and torch.equal(self.recv[block: block + rows].view(bits), want.view(bits))
        return ok


def measure(compiled, src: int, places: Places, copies: int, ncta: int, args: argparse.Namespace,
            row_bytes: int, meet) -> tuple[float, bool]:
    """(median us, right): ``args.iters`` timed launches from the rows at address ``src``, every rank's after
    a barrier on the GPU, then every destination row against its source."""
    import torch
    from cutlass import Int32, Int64

    bases = places.bases(copies)

    def run() -> None:
        compiled(Int64(src), Int64(bases.data_ptr()), Int32(args.rows), Int32(copies),
                 Int32(row_bytes), Int32(ncta))

    places.recv.fill_(float("nan"))
    meet("the poisoned receive rows")
    run()
    meet("the first copy")
    times = []
    for _ in range(args.iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        meet("the start of a timed copy", host=False)
        a.record()
        run()
        b.record()
        wait_gpu("a timed copy", places.rank, args.timeout)
        times.append(a.elapsed_time(b) * 1e3)
    meet("the end of the timed copies")
    return statistics.median(times), places.right(copies)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args is None:
        return 2
    import torch

    if not torch.cuda.is_available():  # one line instead of a traceback from the first CUDA tensor
        print("error: scripts/copy_ceiling.py needs a CUDA GPU (torch sees none)",
              file=sys.stderr)
        return 2
    if world_size() == 1:
        torch.cuda.set_device(0)
        return run(args, None)
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime

    env = DistEnv.from_environ()
    row_bytes = args.hidden * DTYPES[args.dtype]
    heap = (env.world_size * max(args.copy_list) + int(args.pull)) * args.rows * row_bytes
    with Runtime(env, symmetric_bytes=heap) as rt:
        return run(args, rt)


def run(args: argparse.Namespace, rt) -> int:
    """Every mode, SM count and copy count; rank 0 prints (``rt``: the Runtime of a torchrun world)."""
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass import Int32, Int64

    rank, world = (0, 1) if rt is None else (rt.env.rank, rt.env.world_size)

    def meet(what: str, host: bool = True) -> None:
        if rt is not None:
            import nvshmem.core as nvshmem

            nvshmem.barrier_all(torch.cuda.current_stream())
        if host:
            wait_gpu(what, rank, args.timeout)
            if rt is not None:
                rt.barrier(device_sync=False)

    def gather(value):
        if rt is None:
            return [value]
        from cute_ep.collectives import all_gather_objects

        return all_gather_objects(value, rt.cpu_group)

    cdtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}
    row_bytes = args.hidden * DTYPES[args.dtype]
    src = source_rows(args, rank)
    places = Places(args, rank, world, src.dtype)
    src_addr, shared_src = src.data_ptr(), None
    if args.pull:  # the rows in symmetric memory, read by the previous rank through its peer pointer
        import nvshmem.core as nvshmem

        shared_src = nvshmem.tensor(tuple(src.shape), dtype=src.dtype)
        shared_src.copy_(src)
        src_addr = nvshmem.get_peer_tensor(shared_src, places.source_of(rank)).data_ptr()
    kernels = make_kernels(cdtype[args.dtype])
    say = print if rank == 0 else (lambda *a, **k: None)
    where = "" if world == 1 else f", {world} ranks (copy c to rank + {places.shift} + c)"
    if args.pull:
        where = f", {world} ranks (each reads rank + 1's rows)"
    say(f"copy ceiling: {torch.cuda.get_device_name()}{where}, {args.rows} rows x {row_bytes} B; slowest "
        f"rank's median of {args.iters} (us) and bytes written per second", flush=True)
    ok = True
    for mode in args.mode_list:
        compiled = cute.compile(kernels[mode], Int64(0), Int64(0), Int32(1), Int32(1), Int32(16), Int32(1))
        for ncta in args.sms:
            for copies in args.copy_list:
                us, right = measure(compiled, src_addr, places, copies, ncta, args, row_bytes, meet)
                seen = gather((us, right))
                us = max(u for u, _ in seen)
                ok = ok and all(r for _, r in seen)
                gbs = args.rows * copies * row_bytes / us / 1e3
                off_gbs = args.rows * places.off_rank(copies) * row_bytes / us / 1e3
                link = "read from the peer" if args.pull else "off-rank"
                off = "" if world == 1 else f"  {off_gbs:7.1f} {link}"
                wrong = [r for r, (_, good) in enumerate(seen) if not good]
                say(f"  {mode:6s} num_sms {ncta:4d} copies {copies:2d}: {us:9.1f} us  {gbs:7.1f} GB/s "
                    f"written{off}{f'  WRONG on ranks {wrong}' if wrong else ''}", flush=True)
    if world > 1:
        import nvshmem.core as nvshmem

        meet("the end")
        nvshmem.free_tensor(places.recv)
        if shared_src is not None:
            nvshmem.free_tensor(shared_src)
    say("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
