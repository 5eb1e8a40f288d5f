"""The benches' `--profiler perf` (bench/profiles.py): each sample counts for its innermost Python
function, and a real perf recording of a process names the function that spent its CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.profiles import NO_PYTHON, Profile, located, profiled_env, profiling, shares

# `perf script -F tid,ip,sym,dso` as it prints three samples of two threads: a json.dumps and a
# socket write under two Python functions, and one in a C thread.
SCRIPT = textwrap.dedent(
    """\
    4242
    \t          1b636c _PyDict_LoadGlobal (/usr/lib/libpython3.12.so.1.0)
    \t          114a23 _PyEval_EvalFrameDefault (/usr/lib/libpython3.12.so.1.0)
    \t    7f8acccbc93e py::json_text:/srv/app/service/storage/db.py (/tmp/perf-4242.map)

    4242
    \tffffffff8143f416 tcp_sendmsg ([kernel.kallsyms])
    \t          d0043 __GI___send (/usr/lib/x86_64-linux-gnu/libc.so.6)
    \t    7f8ac7a09e1c py::_Connection.send:/srv/app/service/engine/transport.py (/tmp/perf-4242.map)
    \t    7f8ac7a09e1c py::SocketTransport.stream:/srv/app/service/engine/transport.py (/tmp/perf-4242.map)

    4250
    \t          2aecb9 take_gil (/usr/lib/libpython3.12.so.1.0)

    4242
    \t          1b636c PyObject_Malloc (/usr/lib/libpython3.12.so.1.0)
    \t    7f8acccbc93e py::json_text:/srv/app/service/storage/db.py (/tmp/perf-4242.map)
    """
)


def test_a_sample_counts_for_its_innermost_python_function_with_what_it_called() -> None:
    result = shares(SCRIPT.splitlines())
    assert result["samples"] == 4
    assert result["threads"] == [("4242", 0.75), ("4250", 0.25)]
    assert result["functions"] == [
        ("json_text (service/storage/db.py)", 0.5),
        ("_Connection.send (service/engine/transport.py)", 0.25),
        (NO_PYTHON, 0.25),
    ]
    assert dict(result["packages"]) == {"service/storage": 0.5, "service/engine": 0.25, NO_PYTHON: 0.25}


def test_a_file_belongs_to_its_distribution_its_standard_module_or_this_repository() -> None:
    assert located("/app/.venv/lib/python3.12/site-packages/sqlalchemy/engine/base.py")[1] == "sqlalchemy"
    assert located("/usr/lib/python3.12/asyncio/runners.py")[1] == "asyncio"
    assert located("/usr/lib/python3.12/json/encoder.py")[1] == "json"
    assert located("/elsewhere/checkout/service/loop/tokens.py")[1] == "service/loop"
    assert located("<string>")[1] == "<string>"


BURNER = textwrap.dedent(
    """\
    import sys, time

    def burn_cpu(seconds):
        end = time.process_time() + seconds
        total = 0
        while time.process_time() < end:
            total += sum(range(1000))
        return total

    print("ready", flush=True)
    sys.stdin.readline()
    burn_cpu(2.0)
    """
)


@pytest.mark.skipif(shutil.which("perf") is None, reason="perf (Debian's linux-perf) is not installed")
@pytest.mark.skipif(sys.version_info < (3, 12), reason="CPython's perf trampoline is 3.12's")
def test_perf_names_the_python_function_that_spent_a_process_cpu(tmp_path: Path) -> None:
    profile = Profile(tmp_path / "burn.data", "perf")
    with subprocess.Popen(
        [sys.executable, "-c", BURNER],
        env={**os.environ, **profiled_env(profile)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as burner:
        assert burner.stdin is not None and burner.stdout is not None
        assert burner.stdout.readline().strip() == "ready"
        with profiling(burner.pid, profile):
            burner.stdin.write("go\n")
            burner.stdin.flush()
            assert burner.wait(30) == 0
    Path(f"/tmp/perf-{burner.pid}.map").unlink(missing_ok=True)  # the trampoline's map, read by now
    result = json.loads(profile.path.with_name("burn.data.json").read_text())
    assert int(result["samples"]) > 200  # 2 s of CPU at 997 Hz, less the attach
    top, share = result["functions"][0]
    assert top == "burn_cpu (<string>)" and share > 0.5, result["functions"][:5]
