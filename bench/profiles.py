"""Profiles of a bench's service: `--profile FILE --profiler py-spy|perf` (Profile), and where the
CPU went in a perf recording (`shares`: FILE.json, written beside it).

perf samples CPU time: each sample is the code on a CPU at that instant, C, kernel or Python, and
never a thread that waits. With CPython's perf trampoline (3.12+) every Python function's frames
carry its name (`py::qualname:file`). perf unwinds the C stack from its DWARF tables, which the
trampoline's generated code lacks: a sample's chain ends at its first Python frame. So a sample
counts for that function, with the C and kernel code it called (a json.dumps, a socket write, the
GC it set off): the function's own CPU, as a profile's "self" column, not its callees in Python.
Samples with no Python frame (a C thread, the interpreter itself) count as "(no Python frame)".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from bench.common import REPO, STOP_TIMEOUT_SECONDS

PROFILERS = ("py-spy", "perf")


@dataclass(frozen=True)
class Profile:
    """A bench's `--profile FILE --profiler TOOL`: the service's process recorded while the
    measured phase runs, to `path`.

    py-spy (the dev extra) samples every thread's Python stack by wall-clock time, idle or not, and
    pauses the process to read it; with `--gil` only the thread holding the GIL counts. It shows
    whole call paths, but its shares are not CPU: a thread waiting for the GIL, or inside a system
    call that wakes another process, is sampled as busy, and with `--gil` a thread that works
    without the GIL as idle (measured: the storage was in 17% of py-spy's samples of a
    concurrency.py run on SQLite and 33% of perf's). perf samples CPU time only, whatever runs on
    it (C, the kernel, every thread), and CPython 3.12's perf trampoline names each Python
    function; its DWARF unwinding stops at the first Python frame, so each sample is the CPU of
    one Python function and the C and kernel code under it (see `shares`). perf is
    the one to ask where CPU goes, py-spy the one to ask from where. Either slows the process: a
    profiled run's CPU figures are comparable only with another profiled run's."""

    path: Path
    profiler: str = "py-spy"

    def __post_init__(self) -> None:
        if self.profiler not in PROFILERS:
            raise ValueError(f"profiler must be one of {PROFILERS}, not {self.profiler!r}")


def add_arguments(parser: argparse.ArgumentParser, recorded: str) -> None:
    """A bench's `--profile FILE` and `--profiler`; `recorded` says what is recorded, and where."""
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"{recorded}, recorded by --profiler (bench.profiles.Profile): py-spy's raw stacks, or perf's "
        "samples (and where their CPU went, beside them: .json); CPU figures then include the profiler's "
        "cost: compare profiled runs only with each other",
    )
    parser.add_argument("--profiler", choices=PROFILERS, default="py-spy")


def from_arguments(args: argparse.Namespace) -> Profile | None:
    """The Profile that `add_arguments`' options ask for, if any."""
    return None if args.profile is None else Profile(args.profile, args.profiler)


def profiled_env(profile: Profile | None) -> dict[str, str]:
    """What the environment of a process that `profiling` will record needs: CPython's perf
    trampoline on from its start, for perf."""
    return {"PYTHONPERFSUPPORT": "1"} if profile is not None and profile.profiler == "perf" else {}


@contextmanager
def profiling(
    pid: int, profile: Profile | None, py_spy_options: Sequence[str] = ("--gil",)
) -> Iterator[None]:
    """Records process `pid` with `profile`'s profiler while the block runs (nothing if None). A
    process other than this one is recorded by perf only if it was started with `profiled_env`."""
    if profile is None:
        yield
        return
    trampoline = profile.profiler == "perf" and pid == os.getpid()
    if profile.profiler == "perf":
        if not hasattr(sys, "activate_stack_trampoline"):
            raise SystemExit("--profiler perf needs CPython 3.12 or newer (its perf trampoline)")
        command = ["perf", "record", "--quiet", "-F", "997", "--call-graph", "dwarf,16384",
                   "-p", str(pid), "-o", str(profile.path)]  # fmt: skip
        if trampoline:
            sys.activate_stack_trampoline("perf")  # Python functions entered from now on are named
    else:
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        command = [py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200",
                   *py_spy_options, "-o", str(profile.path)]  # fmt: skip
    try:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except FileNotFoundError as error:
        raise SystemExit(f"--profiler {profile.profiler}: {command[0]} is not installed") from error
    time.sleep(1.0)  # it attaches
    if process.poll() is not None:
        message = process.stderr.read().decode() if process.stderr else ""
        raise RuntimeError(f"{profile.profiler} exited: {message}")
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)  # it writes the profile and exits
        process.wait(STOP_TIMEOUT_SECONDS)
        if process.stderr is not None:
            process.stderr.close()
        if trampoline:
            sys.deactivate_stack_trampoline()
    if profile.profiler == "perf":
        shares_path = profile.path.with_name(f"{profile.path.name}.json")
        shares_path.write_text(json.dumps({"profile": str(profile.path), **perf_shares(profile.path)}))


def perf_shares(recording: Path, top: int = 40) -> dict[str, object]:
    """`shares` of a perf recording (perf script reads it with the Python functions' names, from
    the perf maps the recorded process wrote in /tmp)."""
    script = subprocess.run(
        ["perf", "script", "-i", str(recording), "-F", "tid,ip,sym,dso"],
        capture_output=True,
        text=True,
        check=False,
    )
    if script.returncode != 0:
        raise RuntimeError(f"perf script failed: {script.stderr.strip()[-2000:]}")
    return shares(script.stdout.splitlines(), top)


# ---- Where a perf recording's CPU went. ----

NO_PYTHON = "(no Python frame)"
# A trampoline frame as perf script prints it: "<ip> py::<qualname>:<file> (<map file>)".
_PY_FRAME = re.compile(r"\spy::(?P<function>[^:\s]+):(?P<file>\S+)\s+\(")
_TOP_DIRECTORIES = frozenset(path.name for path in REPO.iterdir() if path.is_dir())
_STDLIB = re.compile(r"/lib/python3\.\d+/(?P<module>[^/]+?)(?:\.py)?(?:/|$)")


def samples(lines: Iterable[str]) -> Iterator[tuple[str, list[str]]]:
    """(thread id, frames leaf first) of each sample of `perf script -F tid,ip,sym,dso`."""
    thread, frames = "", []
    for line in lines:
        if line.startswith("\t"):
            frames.append(line.strip())
        elif line.strip():
            if frames:
                yield thread, frames
            thread, frames = line.split()[0], []
        elif frames:
            yield thread, frames
            thread, frames = "", []
    if frames:
        yield thread, frames


def python_frame(frames: list[str]) -> tuple[str, str] | None:
    """(function, file) of the sample's innermost Python frame, if it has one."""
    for frame in frames:
        if (match := _PY_FRAME.search(frame)) is not None:
            return match["function"], match["file"]
    return None


def in_repository(file: str) -> str | None:
    """`file` from this repository's root (of its checkout, or of another checkout of it: the
    path from its first directory named as one of the root's), else None."""
    parts = Path(file).parts
    for index, part in enumerate(parts[:-1]):
        if part in _TOP_DIRECTORIES:
            return "/".join(parts[index:])
    return None


@cache
def located(file: str) -> tuple[str, str]:
    """(`file` as the tables name it, the package it belongs to): from site-packages, its path
    there and its distribution; from the standard library, its path from the library's directory
    and its module (`asyncio`); from this repository, its path from the root and its two first
    levels (`service/storage`); else the file itself, twice. Asked of every sample: cached."""
    if "site-packages/" in file:
        inside = file.split("site-packages/", 1)[1]
        return inside, inside.split("/", 1)[0].removesuffix(".py")
    if (stdlib := _STDLIB.search(file)) is not None:
        return file[stdlib.start() + 1 :], stdlib["module"]
    if (own := in_repository(file)) is not None:
        return own, "/".join(own.split("/")[:2]).removesuffix(".py")
    return file, file


def shares(lines: Iterable[str], top: int = 40) -> dict[str, object]:
    """Of `perf script -F tid,ip,sym,dso`'s output: the samples, and the share of them of each
    thread, of each package and of each Python function (the `top` largest), largest first."""
    threads: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    for thread, frames in samples(lines):
        threads[thread] += 1
        found = python_frame(frames)
        if found is None:
            functions[NO_PYTHON] += 1
            packages[NO_PYTHON] += 1
            continue
        function, file = found
        shown, package = located(file)
        functions[f"{function} ({shown})"] += 1
        packages[package] += 1
    total = sum(threads.values())

    def ranked(counts: Counter[str], limit: int) -> list[tuple[str, float]]:
        return [(name, round(count / total, 4)) for name, count in counts.most_common(limit)]

    return {
        "samples": total,
        "threads": ranked(threads, 8),
        "packages": ranked(packages, top),
        "functions": ranked(functions, top),
    }
