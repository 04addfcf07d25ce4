"""Real rank processes for multi-rank tests.

A RankPool starts `world` spawned processes once, joined in a gloo process group on 127.0.0.1 (a free port), and runs
test functions on all of them: `pool.run(fn, *args)` calls `fn(rank, world, *args)` on every rank and returns the
per-rank results. Every call is bounded: a rank that raises, dies or does not answer in time fails the test with
each rank's traceback, and a pool that timed out or lost a rank is torn down (the next test gets a fresh one).
`fn` must be a module-level function of an importable module (test modules are importable in the ranks).
A pool given `extension_path` (tests/hooked_build.py) loads that build as torch_gemm_ar._C in every rank: the test build with
the negative controls' hooks.
"""
import datetime
import multiprocessing as mp
import os
import socket
import traceback

DEFAULT_TIMEOUT_S = 120.0
# Set by tests/conftest.py while a test outside the multirank lane runs: the reason a RankPool must not start then.
refuse_to_start = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(AssertionError):
    pass


def _rank_main(rank, world, port, conn, threads, extension_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # Engine waits end well before the pool's own bound, so a protocol hang shows up as the engine's error.
    os.environ.setdefault("TORCH_GEMM_AR_TIMEOUT_S", "30")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        if extension_path is not None:
            from hooked_build import load_as_torch_gemm_ar_c

            load_as_torch_gemm_ar_c(extension_path)
        import torch_gemm_ar  # noqa: F401  (registers the op in this rank)

        conn.send(("ready", None))
    except BaseException:  # report start-up failures to the parent instead of dying silently
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(rank, world, *args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001  (the parent re-raises it with the rank's traceback)
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class RankPool:
    def __init__(self, world: int, timeout_s: float = DEFAULT_TIMEOUT_S, extension_path=None):
        if refuse_to_start:
            raise RuntimeError(refuse_to_start)
        self.world = world
        self.broken = False
        ctx = mp.get_context("spawn")
        port = free_port()
        threads = max(1, (os.cpu_count() or 1) // world)
        self._conns, self.procs = [], []
        for rank in range(world):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, world, port, child_end, threads, extension_path), daemon=True)
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self.procs.append(proc)
        self._collect("start-up", timeout_s)

    def _collect(self, what, timeout_s, tolerate_deaths=False):
        import time

        deadline = time.monotonic() + timeout_s
        results, errors = [None] * self.world, []
        pending = set(range(self.world))
        while pending:
            for rank in list(pending):
                conn, proc = self._conns[rank], self.procs[rank]
                if conn.poll(0.02):
                    try:
                        status, value = conn.recv()
                    except EOFError:  # the rank exited or was killed
                        proc.join(timeout=5)
                        status, value = "error", f"rank {rank} closed its pipe (exit code {proc.exitcode})"
                        if tolerate_deaths:
                            status, value = "ok", None
                    pending.discard(rank)
                    if status == "error":
                        errors.append(f"--- rank {rank} ---\n{value}")
                    else:
                        results[rank] = value
                elif not proc.is_alive():
                    pending.discard(rank)
                    if not tolerate_deaths:
                        errors.append(f"--- rank {rank} died with exit code {proc.exitcode} ---")
            if pending and time.monotonic() > deadline:
                self.close(force=True)
                raise RankFailure(
                    f"{what}: ranks {sorted(pending)} did not answer within {timeout_s:.0f}s\n" + "\n".join(errors)
                )
        if tolerate_deaths and any(not p.is_alive() for p in self.procs):
            self.broken = True
        if errors:
            if any("died" in e or "closed its pipe" in e for e in errors):
                self.close(force=True)
            raise RankFailure(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return results

    def run(self, fn, *args, timeout_s: float = DEFAULT_TIMEOUT_S, tolerate_deaths: bool = False, **kwargs):
        """fn(rank, world, *args, **kwargs) on every rank; the list of their results. With tolerate_deaths, a rank
        that dies (on purpose) gives None and the pool is retired afterwards."""
        if self.broken:
            raise RankFailure("this rank pool was torn down by an earlier failure")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", "call"), timeout_s, tolerate_deaths)

    def close(self, force: bool = False):
        self.broken = True
        for conn in self._conns:
            try:
                if not force:
                    conn.send(None)
                conn.close()
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
