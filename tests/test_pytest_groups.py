"""build_tools/pytest_groups.py (gpu-check's concurrent pytest processes): grouping and summaries."""
import collections
import os
import sys

import pytest

import pytest_groups


def test_groups_hold_whole_files_once_and_balance_weight():
    counts = collections.Counter({"tests/gpu/test_a.py": 500, "tests/gpu/test_b.py": 300, "tests/test_c.py": 900,
                                  "tests/test_d.py": 100, "tests/gpu/test_e.py": 50, "tests/test_f.py": 10})
    groups = pytest_groups.group_files(counts, 3)
    assert len(groups) == 3
    assert sorted(f for g in groups for f in g) == sorted(counts)
    weight = [sum(counts[f] * (pytest_groups.GPU_WEIGHT if "/gpu/" in f else 1) for f in g) for g in groups]
    # the heaviest file (2000) alone; the rest fill the two others
    assert max(weight) == 2000 and min(weight) >= 900


def test_more_jobs_than_files_gives_a_group_a_file():
    groups = pytest_groups.group_files(collections.Counter({"tests/test_x.py": 3, "tests/test_y.py": 2}), 8)
    assert sorted(map(tuple, groups)) == [("tests/test_x.py",), ("tests/test_y.py",)]


def test_summary_line_is_pytests_last_one(tmp_path):
    log = tmp_path / "g.log"
    log.write_text("...\nFAILED tests/test_x.py::t - boom\n=== 1 failed, 12 passed, 2 skipped in 3.1s ===\n")
    assert pytest_groups.summary_line(log) == "1 failed, 12 passed, 2 skipped in 3.1s"
    log.write_text("Traceback\nImportError: no\n")
    assert pytest_groups.summary_line(log) == "ImportError: no"


def test_summary_line_under_q_with_stderr_after_it(tmp_path):
    # -q prints the closing line bare; a process's exit (JAX's logging) may write after it, and a
    # traceback line naming a failure is not the summary (gpu-check's total missed 388 tests so).
    log = tmp_path / "g.log"
    log.write_text("....\n388 passed in 81.50s (0:01:21)\nTraceback\n"
                   "RuntimeError: launch of k failed: CUDA_ERROR_LAUNCH_FAILED (injected) [x='jit']\n")
    assert pytest_groups.summary_line(log) == "388 passed in 81.50s (0:01:21)"


def test_a_file_that_fails_to_collect_fails_the_run(tmp_path):
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "test_broken.py").write_text("import not_a_module_of_this_suite\n\ndef test_b():\n    pass\n")
    env = dict(os.environ)
    with pytest.raises(SystemExit, match="collection failed"):
        pytest_groups.collect(sys.executable, [str(tmp_path)], env)
    (tmp_path / "test_broken.py").unlink()
    counts = pytest_groups.collect(sys.executable, [str(tmp_path)], env)
    assert list(counts.values()) == [1] and next(iter(counts)).endswith("test_ok.py")
