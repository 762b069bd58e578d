"""derivgen norms under DistributedDataParallel (gloo, processes on localhost) train exactly
as one process on the concatenated batch. A hung collective fails the test (timeout), it
does not hang CI."""

import os
import signal
import subprocess
import sys

from conftest import ROOT, require_module

require_module("torch")


def test_ddp_two_processes_match_one_process():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "ddp_driver.py"), "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"DDP run did not finish in 300 s:\n{out}\n{err[-3000:]}")
    assert p.returncode == 0, out + err[-3000:]
    assert "max relative difference" in out
