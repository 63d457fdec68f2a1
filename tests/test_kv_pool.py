"""The KV pool's memory: committed when it is made (the process's resident memory grows by it
then, not under load), and refused at start where the memory left cannot hold it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spectral.mem.kv_pool import KVPool
from spectral.worker.model_worker import cgroup_memory_left
from tests.server_utils import launch_command

# 2 layers x K, V x 2 heads x 64 x float32: 4 buffers of 40 MiB, each above glibc's largest
# mmap threshold (32 MiB), so each is a fresh mapping (never freed memory already resident).
POOL_SLOTS = 81920


RESIDENT = """
import json, os, sys, torch
from spectral.mem.kv_pool import KVPool

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident()
pool = KVPool(int(sys.argv[2]), 2, 2, 64, torch.float32, commit=sys.argv[1] == "commit")
print(json.dumps([resident() - before, pool.nbytes, pool.committed,
                  all(float(buf[0].abs().sum()) == 0 for buf in pool.k + pool.v)]))
"""


@pytest.mark.parametrize("commit", [True, False])
def test_a_committed_pool_is_resident_from_the_start(commit):
    """In a fresh process (a test process's heap may hold freed pages already resident)."""
    out = subprocess.run(
        [sys.executable, "-c", RESIDENT, "commit" if commit else "lazy", str(POOL_SLOTS)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    grown, nbytes, committed, zero = json.loads(out)
    assert nbytes == 4 * (POOL_SLOTS + 1) * 2 * 64 * 4 and committed == commit and zero
    if commit:
        assert grown >= 0.95 * nbytes
    else:  # the control: only the dummy slot's pages were written
        assert grown < 0.05 * nbytes


def test_a_pool_that_does_not_fit_is_refused_naming_the_sizes():
    KVPool.check_fits(1000, 4096, 1000 * 4096, "free")  # exactly fits
    with pytest.raises(RuntimeError) as err:
        KVPool.check_fits(3 * 2**20, 4096, 5 * 2**30, "of cpu memory is free")
    assert str(err.value).startswith(
        "the KV pool of 3145728 tokens needs 12.00 GiB (4096 bytes a token) but 5.00 GiB of cpu "
        "memory is free"
    )


@pytest.mark.parametrize(
    "membership, files, left",
    [
        # v1: the memory controller's limit and usage
        (
            "4:memory:/job\n0::/\n",
            {"memory/job/memory.limit_in_bytes": "1000", "memory/job/memory.usage_in_bytes": "400"},
            600,
        ),
        (
            "4:memory:/job\n",
            {
                "memory/job/memory.limit_in_bytes": str(2**63 - 4096),
                "memory/job/memory.usage_in_bytes": "400",
            },
            None,
        ),
        # v2: one hierarchy
        ("0::/job\n", {"job/memory.max": "5000", "job/memory.current": "1000"}, 4000),
        ("0::/job\n", {"job/memory.max": "max", "job/memory.current": "1000"}, None),
        ("0::/job\n", {"job/memory.max": "100", "job/memory.current": "300"}, 0),
        ("0::/\n", {}, None),  # no files: no limit known
    ],
)
def test_the_cgroups_memory_left_is_read_from_v1_or_v2(tmp_path, membership, files, left):
    (tmp_path / "cgroup").write_text(membership)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    assert cgroup_memory_left(str(tmp_path / "fs"), str(tmp_path / "cgroup")) == left


def test_a_server_whose_pool_does_not_fit_refuses_to_start(peaky_model_dir):
    """--max-total-tokens far beyond the memory: the server exits at start-up with the sizes."""
    tokens = 10**12
    flags = {"--model-path": peaky_model_dir, "--max-total-tokens": str(tokens), "--port": "0"}
    run = subprocess.run(
        launch_command(*(word for pair in flags.items() for word in pair)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert f"the KV pool of {tokens} tokens needs" in run.stdout + run.stderr, run.stderr[-2000:]
