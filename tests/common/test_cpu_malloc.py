"""common.cpu_malloc: the benches' restart under tcmalloc (the same command line, tcmalloc preloaded, once)."""
import os
import subprocess
import sys

import pytest

from common import cpu_malloc

pytestmark = pytest.mark.skipif(cpu_malloc.tcmalloc_path() is None, reason="no tcmalloc installed (Debian: "
                                "libtcmalloc-minimal4, which .ci/run installs)")

SCRIPT = """
import sys
from common import cpu_malloc
print("start", sys.argv[1:], flush=True)
cpu_malloc.reexec_with_tcmalloc()
print("loaded", cpu_malloc.tcmalloc_loaded(), flush=True)
"""


def run(**env) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "--flag", "x y"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def test_restarts_once_with_the_same_arguments_under_tcmalloc():
    assert run(LD_PRELOAD=None, NPU_COOKBOOK_MALLOC=None, NPU_COOKBOOK_MALLOC_REEXEC=None) == [
        "start ['--flag', 'x y']", "start ['--flag', 'x y']", "loaded True"]


def test_glibc_keeps_the_process():
    assert run(LD_PRELOAD=None, NPU_COOKBOOK_MALLOC="glibc", NPU_COOKBOOK_MALLOC_REEXEC=None) == [
        "start ['--flag', 'x y']", "loaded False"]
