"""Rank agreement on the rewrite's sites: a site is rewritten only if every rank of its group compiles it too.

Ranks compile their graphs on their own. If dynamo splits a graph on one rank only (a rank-0-only warning or print,
a rank-dependent branch), that rank may have no GEMM + collective site where its peers have one; a rewrite on the
peers alone would make them run the fused op while that rank runs the plain collective, and both would wait for each
other. So before a graph is rewritten, each candidate site is agreed over its group's c10d store:

- A site's key is the hash of its description (the fused op it would become, the group, the operands' shapes and
  dtypes, the source lines of the GEMM and the collective, the module path, forward/backward), plus how many sites of
  that description this process has agreed on before. Ranks whose graphs are split differently still meet at the
  sites they share, and sites of different graphs or compiles never share a key.
- Each rank adds itself to the key's counter; the rank that completes it writes "go". A rank still waiting at the
  bound (TORCH_GEMM_AR_COMPILE_AGREE_S) writes "abort" instead; both writes are compare-and-set on one key, so every
  rank reads the same outcome, and a rank arriving after an abort reads "abort" at once.
- A rank without the site never arrives: its peers reach the bound and keep the plain collective, as it does.
- After a disagreement the ranks' counts of that description differ (the rank without the site did not count it),
  so its later compiles are not fused either (safe, but lost). `torch_gemm_ar.compile.reset()` (restart() here),
  called alike on every rank, starts a new session: fresh counts under fresh keys.
- The keys of an agreement are deleted by the last of its ranks to read the outcome; an agreement that a rank never
  reached leaves its few keys behind (one set per site and compile, so bounded by the number of compiles).

docs/decisions/0017-compile-rewrite-agreement.md gives the reasons and the limits.
"""
import hashlib
import os
import threading
import time
from collections import Counter
from typing import List, Optional, Sequence, Tuple

ENV = "TORCH_GEMM_AR_COMPILE_AGREE_S"
DEFAULT_S = 60.0
_PREFIX = "torch_gemm_ar/compile_agree"
_POLL_S = (0.002, 0.05)  # first and longest pause between polls of the store (doubling in between)

_lock = threading.Lock()
_started: Counter = Counter()  # (group name, description hash) -> agreements this process started on it
_session = 0  # restart() calls in this process: part of every key


def bound_s() -> float:
    """TORCH_GEMM_AR_COMPILE_AGREE_S: how long a compile waits for the group's other ranks at its sites."""
    raw = os.environ.get(ENV, "")
    if not raw.strip():
        return DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV} must be a finite number of seconds > 0; got {raw!r}")
    return value


def _group_store(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group, _world

    group = _resolve_process_group(group_name)
    return group, _world.pg_map[group][1]


class _Site:
    def __init__(self, group_name: str, description: str):
        digest = hashlib.sha256(description.encode()).hexdigest()[:32]
        with _lock:
            occurrence = _started[(group_name, digest)]
            _started[(group_name, digest)] += 1
            session = _session
        self.group, self.store = _group_store(group_name)
        self.world, self.rank = self.group.size(), self.group.rank()
        self.key = f"{_PREFIX}/{session}/{group_name}/{digest}/{occurrence}"
        self.outcome: Optional[bytes] = None

    def arrive(self) -> None:
        self.store.set(f"{self.key}/rank{self.rank}", "1")
        if self.store.add(f"{self.key}/arrived", 1) == self.world:
            self.store.compare_set(f"{self.key}/status", "", "go")

    def poll(self) -> bool:
        if self.store.check([f"{self.key}/status"]):
            self.outcome = self.store.get(f"{self.key}/status")
        return self.outcome is not None

    def give_up(self) -> None:
        self.outcome = self.store.compare_set(f"{self.key}/status", "", "abort")

    def missing(self) -> List[int]:
        return [r for r in range(self.world) if not self.store.check([f"{self.key}/rank{r}"])]

    def finish(self) -> None:
        """The last rank to read the outcome deletes the agreement's keys."""
        if self.store.add(f"{self.key}/done", 1) == self.world:
            for suffix in ["arrived", "status", "done"] + [f"rank{r}" for r in range(self.world)]:
                self.store.delete_key(f"{self.key}/{suffix}")


def agree(sites: Sequence[Tuple[str, str]]) -> List[Optional[str]]:
    """For each (group name, site description), in graph order: None if every rank of the group has that site in
    the graph it compiles now, else the reason it is not rewritten. Waits at most bound_s() in all."""
    if not sites:
        return []
    bound = bound_s()
    try:
        pending = [_Site(group_name, description) for group_name, description in sites]
        for site in pending:
            site.arrive()
        deadline = time.monotonic() + bound
        waiting, pause = list(pending), _POLL_S[0]
        while waiting:
            waiting = [site for site in waiting if not site.poll()]
            if waiting and time.monotonic() >= deadline:
                for site in waiting:
                    site.give_up()
                break
            if waiting:
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(2 * pause, _POLL_S[1])
        reasons: List[Optional[str]] = []
        for site in pending:
            missing = [] if site.outcome == b"go" else site.missing()
            if site.outcome == b"go":
                reasons.append(None)
            elif missing:
                reasons.append(f"not rewritten: rank(s) {missing} of group {site.group.group_name!r} did not "
                               f"compile this site within {ENV}={bound:g}s (the ranks traced different graphs)")
            else:
                reasons.append(f"not rewritten: an earlier compile of this site on group {site.group.group_name!r} "
                               "went without some rank, and the ranks' counts of it differ since "
                               "(torch_gemm_ar.compile.reset() on every rank starts afresh)")
            site.finish()
        return reasons
    except Exception as exc:  # noqa: BLE001  (a store that fails: keep the plain collectives, say why)
        return [f"not rewritten: the rank agreement failed ({type(exc).__name__}: {exc})"] * len(sites)


def restart() -> None:
    """A new session: occurrence counts from zero, under keys no earlier agreement used. Every rank of a group must
    restart alike (torch_gemm_ar.compile.reset() calls it), or their agreements never meet again."""
    global _session
    with _lock:
        _session += 1
        _started.clear()


__all__ = ["DEFAULT_S", "ENV", "agree", "bound_s", "restart"]
