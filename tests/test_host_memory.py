"""``--host-memory`` (fedaval/host_memory.py): freed host memory kept for
reuse or given back to the system, checked by what it is for, the page faults
of making a large tensor again. The setting belongs to the process, so the
C library's behaviour is measured in an interpreter of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import strip_timing

REMAKE = r"""
import resource, torch
from fedaval import host_memory

def faults_of_remaking(times=20, megabytes=64):
    for _ in range(10):  # glibc settles where it puts the block (after a change, within a few)
        tensor = torch.ones(megabytes * 2**18)
        del tensor
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        tensor = torch.ones(megabytes * 2**18)  # every page written
        del tensor
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

untouched = faults_of_remaking()
kept = host_memory.apply("keep")
keep = faults_of_remaking()
released = host_memory.apply("release")
release = faults_of_remaking(megabytes=96)  # a size the heap holds no free block of
print(untouched, keep, release, kept, released)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_reuses_freed_memory_and_release_gives_it_back():
    out = subprocess.run([sys.executable, "-c", REMAKE], capture_output=True, text=True, check=True).stdout
    untouched, keep, release, kept, released = out.split()
    pages = 64 * 2**20 // 4096  # one 64 MB tensor
    assert (kept, released) == ("True", "True")
    # glibc's own policy maps (and the kernel zeroes) every 64 MB block afresh: 20 x its pages;
    # restored after keep, the same for a size not already free in the heap (blocks kept there
    # while memory was kept stay there for reuse: glibc cannot be made to give those back)
    assert int(untouched) > 15 * pages and int(release) > 15 * pages * 96 // 64
    # kept: the block is reused from the heap as it is
    assert int(keep) < pages // 4


def test_release_alone_leaves_the_c_library_as_it_is(monkeypatch):
    from fedaval import host_memory

    monkeypatch.setattr(host_memory, "_kept", False)
    monkeypatch.setattr(host_memory, "_mallopt", lambda: pytest.fail("mallopt called"))
    assert host_memory.apply("release") is False


def test_without_mallopt_keep_warns_and_changes_nothing(monkeypatch, caplog):
    from fedaval import host_memory

    monkeypatch.setattr(host_memory, "_kept", False)  # earlier runs in this process kept memory
    monkeypatch.setattr(host_memory, "_mallopt", lambda: None)
    assert host_memory.apply("keep") is False
    assert "has no glibc mallopt" in caplog.text


@pytest.mark.slow
def test_a_run_applies_its_setting_and_results_do_not_depend_on_it(tiny_config, tmp_path, monkeypatch):
    from fedaval import host_memory
    from fedaval.api import run_training

    applied = []
    apply = host_memory.apply
    monkeypatch.setattr(host_memory, "apply", lambda choice: applied.append(choice) or apply(choice))
    results = {}
    for choice in ("release", "keep"):
        out = strip_timing(run_training(tiny_config(out=str(tmp_path / choice), host_memory=choice)))
        assert out["config"].pop("host_memory") == choice
        results[choice] = out
    assert applied == ["release", "keep"]
    assert results["release"] == results["keep"]
