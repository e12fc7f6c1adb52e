"""Where a server's CPU goes, read from /proc: a process tree's CPU seconds, the Ray Serve
processes' by role (proxy, ingress, engine replica's loop and step threads, ...), busy or
idle, and the engine step threads' scheduling (running, waiting for a CPU, off it)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path


def _proc_stats() -> Iterator[tuple[int, list[str]]]:
    """Every process's pid and /proc/PID/stat fields after its name (state first)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # a process that ended while read
            continue
        yield int(entry.name), stat[stat.rindex(")") + 2 :].split()


def _tree(root: int) -> dict[int, list[str]]:
    """`root` and every live process under it: pid -> its /proc stat fields."""
    stats = dict(_proc_stats())
    out = {}
    for pid, fields in stats.items():
        p = pid
        while p and p != root:
            p = int(stats[p][1]) if p in stats else 0
        if p == root:
            out[pid] = fields
    return out


def tree_cpu_seconds(root: int) -> float:
    """user + system CPU seconds of `root` and every process under it, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(f[11]) + int(f[12])) / tick for f in _tree(root).values())


def tree_pids(root: int) -> set[int]:
    """`root` and every live process under it (zombies excluded)."""
    return {pid for pid, f in _tree(root).items() if f[0] != "Z"}


def live_pids(pids: set[int]) -> set[int]:
    """Those of `pids` still running (zombies excluded)."""
    return {pid for pid, f in _proc_stats() if pid in pids and f[0] != "Z"}


def machine_ticks() -> dict[str, int]:
    """This machine's CPU time so far, all cores, in clock ticks from /proc/stat: `busy`
    (user, nice, system, irq, softirq), `interrupts` (irq and softirq: work such as loopback
    TCP that no process's own CPU time includes) and `steal` (a runnable vCPU the hypervisor
    gave to another guest)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return {
        "busy": user + nice + system + irq + softirq,
        "interrupts": irq + softirq,
        "steal": steal,
    }


def machine_shares(
    before: dict[str, int], after: dict[str, int], accounted_cpu_s: float, seconds: float
) -> dict:
    """How the machine's cores spent a level: `busy`, `steal` (shares of all cores' wall time),
    `interrupts_cpu_s` and `other_cpu_s`, the busy CPU-seconds that neither interrupts nor
    `accounted_cpu_s` (the server's process tree and the load generator) explain: another
    process competing for the cores."""
    tick = os.sysconf("SC_CLK_TCK")
    capacity = seconds * (os.cpu_count() or 1)
    busy = (after["busy"] - before["busy"]) / tick
    interrupts = (after["interrupts"] - before["interrupts"]) / tick
    return {
        "busy": busy / capacity if capacity else 0.0,
        "steal": (after["steal"] - before["steal"]) / tick / capacity if capacity else 0.0,
        "interrupts_cpu_s": interrupts,
        "other_cpu_s": max(0.0, busy - interrupts - accounted_cpu_s),
    }


# Serve's processes by the role their title names (`ray::ServeReplica:APP:DEPLOYMENT`,
# `ray::ProxyActor`, ...): the serving path is every one of them but the engine's step threads.
SERVE_ROLES = {
    "ProxyActor": "proxy",
    ":ingress": "ingress",
    ":tokenizer": "tokenizer",
    ":grammar": "grammar",
    ":engine": "engine",
    ":admin": "admin",
    ":responses": "responses",
    "ServeController": "controller",
    # The engine replicas' stats and timelines, and the drain flag the admin API keeps.
    "StatsRegistry": "stats_registry",
}
# Not on a completion's path: reported beside, never summed into the serving path's cost.
# The responses runner is on the Responses API's path (benchmarks/responses.py sums it).
BACKGROUND_ROLES = ("controller", "admin", "stats_registry", "responses")


def _cpu_of(stat_path: Path, tick: int) -> float:
    stat = stat_path.read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / tick


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of one process (its threads, not its children)."""
    return _cpu_of(Path(f"/proc/{pid}/stat"), os.sysconf("SC_CLK_TCK"))


def _ray_processes() -> Iterator[tuple[Path, str]]:
    """This machine's Ray worker processes (`ray::...` titles): their /proc folder and title."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # a process that ended while read
            continue
        if title.startswith("ray::"):
            yield entry, title


def serve_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this machine's Serve processes, by role, from /proc. An engine
    replica is split: `engine_step` (threads named `ENGINE_THREAD_PREFIX*`: the step thread,
    its OpenMP team, the mask filler) and `engine_loop` (the rest: Serve's event loop, Ray's
    threads)."""
    from actors.torch_thread import ENGINE_THREAD_PREFIX

    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for entry, title in _ray_processes():
        try:
            role = next((r for key, r in SERVE_ROLES.items() if key in title), None)
            if role is None:
                continue
            if role != "engine":
                totals[role] = totals.get(role, 0.0) + _cpu_of(entry / "stat", tick)
                continue
            for task in (entry / "task").iterdir():
                name = (task / "comm").read_text().strip()
                part = "engine_step" if name.startswith(ENGINE_THREAD_PREFIX) else "engine_loop"
                totals[part] = totals.get(part, 0.0) + _cpu_of(task / "stat", tick)
        except (OSError, ValueError):  # a process or thread that ended while read
            continue
    return totals


def idle_serve_cpu(seconds: float, background: tuple[str, ...] = BACKGROUND_ROLES) -> dict:
    """Each Serve role's CPU over `seconds` of an idle server, in ms a second: what its
    processes spend whether or not a token passes (Ray's and Serve's periodic work).
    `path_ms_per_s` sums the roles `serving_cpu_per_token` sums."""
    before, start = serve_cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    after, wall = serve_cpu_seconds(), time.perf_counter() - start
    by_role = _ms_by_role(before, after, wall)
    return {
        "seconds": wall,
        "path_ms_per_s": _path_sum(by_role, background),
        "by_role_ms_per_s": by_role,
    }


def _ms_by_role(before: dict[str, float], after: dict[str, float], per: float) -> dict:
    """Each role's CPU between two `serve_cpu_seconds` readings, in ms per `per` (seconds of
    wall time, or tokens)."""
    return {
        role: (after.get(role, 0.0) - before.get(role, 0.0)) * 1e3 / per
        for role in sorted(set(before) | set(after))
    }


def _path_sum(by_role: dict[str, float], background: tuple[str, ...]) -> float:
    """The serving path's part of a per-role reading: every role but the engine's step
    threads and the `background` ones."""
    return sum(v for r, v in by_role.items() if r != "engine_step" and r not in background)


def step_thread_schedstat() -> dict[str, tuple[int, int, int]]:
    """Per engine step thread (named `ENGINE_THREAD_PREFIX*`, in any Serve replica or Ray
    worker on this machine): nanoseconds on a CPU and waiting for one while runnable, from
    /proc/PID/task/TID/schedstat, and the times it was taken off its CPU while runnable
    (`nonvoluntary_ctxt_switches` in its status)."""
    from actors.torch_thread import ENGINE_THREAD_PREFIX

    out: dict[str, tuple[int, int, int]] = {}
    for entry, _ in _ray_processes():
        try:
            for task in (entry / "task").iterdir():
                if (task / "comm").read_text().startswith(ENGINE_THREAD_PREFIX):
                    run, wait, _ = (task / "schedstat").read_text().split()
                    status = (task / "status").read_text()
                    preempted = status.split("nonvoluntary_ctxt_switches:")[1].split()[0]
                    out[f"{entry.name}/{task.name}"] = (int(run), int(wait), int(preempted))
        except (OSError, ValueError, IndexError):  # a process or thread that ended while read
            continue
    return out


def step_thread_shares(
    before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]], seconds: float
) -> dict:
    """Where the engine's step threads spent a level's wall time, averaged over the threads:
    `running`; `waiting_for_cpu` (runnable, another thread on the core); `off_cpu` (the rest:
    the GIL, an OpenMP barrier, no work); and `preempted_per_s`, how often a thread was taken
    off its core while it had work."""
    threads = [t for t in after if t in before]
    if not threads or seconds <= 0:
        return {"threads": 0}

    def mean(i: int) -> float:
        return sum(after[t][i] - before[t][i] for t in threads) / seconds / len(threads)

    run, wait = mean(0) / 1e9, mean(1) / 1e9
    return {
        "threads": len(threads),
        "running": run,
        "waiting_for_cpu": wait,
        "off_cpu": max(0.0, 1.0 - run - wait),
        "preempted_per_s": mean(2),
    }


def serving_cpu_per_token(
    before: dict[str, float],
    after: dict[str, float],
    tokens: int,
    background: tuple[str, ...] = BACKGROUND_ROLES,
) -> dict:
    """CPU ms per output token, by role, between two `serve_cpu_seconds` readings; `serving`
    sums the path outside the engine's step threads and the `background` roles."""
    per = _ms_by_role(before, after, max(tokens, 1))
    return {"serving": _path_sum(per, background), "by_role": per}


# A production-shaped JSON schema for constrained-decode benchmarks: nested objects, enums and
# arrays. Many small items: every row keeps visiting keys, enums and numbers (the masks that
# cost the most to fill), and none can close the object within the tokens decoded here.
