"""A run directory copied elsewhere (a backup, `cp -r`, each test's own copy of the one tiny run trained
per test process) is a whole run: it translates, evaluates and resumes, and the original is untouched."""

from __future__ import annotations

from pathlib import Path


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_copied_run_translates_evaluates_and_resumes_leaving_the_original_alone(trained_workdir: Path,
                                                                                    workdir: Path, tmt_here):
    original = files(trained_workdir)
    assert workdir != trained_workdir and files(workdir) == original

    result = tmt_here("translate", "--run", "runs/tiny", "Good morning.", "Where is the station?", cwd=workdir)
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 2, result.stderr
    evaluated = workdir / "runs" / "tiny" / "evaluation" / "test.best.beam1.txt"
    evaluated.unlink()
    result = tmt_here("evaluate", "--run", "runs/tiny", "--quiet", cwd=workdir)
    assert result.returncode == 0, result.stderr
    # The same model: greedy translations of the test split as training's final test wrote them.
    assert evaluated.read_text("utf-8") == original["runs/tiny/evaluation/test.best.beam1.txt"].decode("utf-8")

    result = tmt_here("train", "--config", "tiny.yaml", "--resume", "--no-progress", "--set", "train.max_steps=6",
                      cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "resuming from" in result.stderr and "step_00000004.pt: step 4" in result.stderr, result.stderr
    assert (workdir / "runs" / "tiny" / "checkpoints" / "step_00000006.pt").is_file()
    assert files(trained_workdir) == original
