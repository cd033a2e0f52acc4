"""Hostile and careless inputs to `tenx plan` and its subcommands (issue 29): output files, ranks beyond the
cluster, a damaged calibration cache, the cache's location, runaway failure simulations, and a fuzz over
every numeric flag (each ends in exit 0 or 2, never a traceback; nan, inf and negatives exit 2)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenx.cli import main
from tenx.plan import calibrate

NO_DATA = ["--set", 'data.dir="/nonexistent-tenx-data"']
PLAN = ["plan", "--config", "tiny", "--cluster", "cpu", "--vocab", "257", *NO_DATA]
FAILURES = ["plan", "failures", "--gpus", "1e3,1e5", "--days", "1", "--replicas", "2"]
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Every test's calibration cache is its own (never the user's ~/.cache/tenx)."""
    monkeypatch.setenv("TENX_CACHE_DIR", str(tmp_path / "cache"))


def fit_file(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text(
        json.dumps({"fit": {"law": "chinchilla", "form": "E + A/N^alpha + B/D^beta", "params": CHINCHILLA}})
    )
    return path


def subcommand_argv(name, tmp_path):
    return {
        "plan": PLAN,
        "failures": [*FAILURES, "--no-sim"],
        "choose": [
            "plan",
            "choose",
            "--config",
            "tiny",
            "--cluster",
            "cpu",
            "--fit",
            str(fit_file(tmp_path)),
            "--budget",
            "1e15",
            "--vocab",
            "257",
        ],  # fmt: skip
        "shapes": ["plan", "shapes", "--config", "tiny", "--vocab", "257", "--repeat", "2", "--threads", "1"],
    }[name]


@pytest.mark.parametrize("name", ["plan", "failures", "choose", "shapes"])
def test_json_refuses_a_directory_and_an_existing_file_without_force(name, tmp_path, capsys):
    """`--json /tmp` ended in an IsADirectoryError traceback, and an existing file was replaced silently."""
    argv = subcommand_argv(name, tmp_path)
    assert main([*argv, "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path} is a directory" in capsys.readouterr().err
    notes = tmp_path / "notes.json"
    notes.write_text("mine")
    assert main([*argv, "--json", str(notes)]) == 2
    assert f"{notes} exists; pass --force" in capsys.readouterr().err
    assert notes.read_text() == "mine"
    if name != "shapes":  # a benchmark: the refusals above are what is new
        assert main([*argv, "--json", str(notes), "--force"]) == 0
        assert json.loads(notes.read_text())


def test_json_never_replaces_the_commands_own_input(tmp_path, capsys):
    fit = fit_file(tmp_path)
    argv = subcommand_argv("choose", tmp_path)
    assert main([*argv, "--json", str(fit), "--force"]) == 2
    assert "is the command's own input" in capsys.readouterr().err
    assert json.loads(fit.read_text())["fit"]["params"] == CHINCHILLA


def test_ranks_above_the_clusters_accelerators_are_refused(capsys):
    """`--cluster cpu --ranks 3` planned 3 ranks on a one-accelerator cluster, exit 0."""
    assert main([*PLAN, "--ranks", "3"]) == 2
    err = capsys.readouterr().err
    assert "--ranks 3: cluster 'cpu-2core'" in err and "cpu.toml" in err and "has 1 accelerator " in err
    assert main(["plan", "--config", "tiny", "--cluster", "h100-node", "--vocab", "257", "--ranks", "9"]) == 2
    assert "has 8 accelerators" in capsys.readouterr().err
    assert main(["plan", "--config", "tiny", "--cluster", "h100-node", "--vocab", "257", "--ranks", "8"]) == 0
    assert "8 ranks" in capsys.readouterr().out


@pytest.mark.parametrize("value", [0, -0.5, float("nan"), "fast", True, 2.0])
def test_a_damaged_calibration_entry_is_an_error_naming_file_and_field(value, capsys):
    """A cache holding `compute_efficiency: 0` made `tenx plan` raise ZeroDivisionError."""
    from tenx.hardware import device_name, pick_device

    path = calibrate.calibration_path()
    path.parent.mkdir(parents=True)
    entry = {"compute_efficiency": value, "measured_on": device_name(pick_device("auto", "device"))}
    path.write_text(json.dumps({"cpu-2core": entry}))
    assert main(PLAN) == 2
    err = capsys.readouterr().err
    assert f"{path}: cpu-2core.compute_efficiency = " in err and "rerun `tenx plan --measure`" in err
    path.write_text("{broken")
    assert main(PLAN) == 2
    assert f"{path}: unreadable" in capsys.readouterr().err


def test_the_calibration_cache_follows_cache_dir_and_never_the_working_directory(tmp_path, monkeypatch):
    """With TENX_CACHE_DIR= (empty) `plan --measure` wrote plan-calibration.json into the working directory."""
    from tenx.utils.io import cache_dir

    monkeypatch.setenv("TENX_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    assert calibrate.calibration_path() == cache_dir() / "plan-calibration.json"
    assert calibrate.calibration_path() == tmp_path / "xdg" / "tenx" / "plan-calibration.json"
    calibrate.save_calibration("cpu-2core", {"compute_efficiency": 0.5}, "cpu: x")
    assert not (tmp_path / "plan-calibration.json").exists()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--days", "1e9"], "argument --days: must be a number > 0 and <= 36,500"),
        (["--days", "1e4"], "the largest --days is"),
        (["--replicas", "1000000"], "argument --replicas: must be an integer >= 2 and <= 1,000"),
        (["--gpus", "1e30"], "argument --gpus: each count must be a number > 0 and at most 1e+12"),
        (["--gpus", "1e12"], "or pass --no-sim"),
        (["--restart-s", "1e300"], "--restart-s must be >= 0 and at most the simulated span"),
        (["--detect-s", "1e300"], "--detect-s must be >= 0 and at most the simulated span"),
        (["--save-cost-s", "1e300"], "--save-cost-s must be > 0 and at most the simulated span"),
        (["--sync-s", "1e300"], "--sync-s must be > 0 and at most the simulated span"),
        (["--groups", "1000000000000"], "--groups 1000000000000: each replica group holds at least one"),
        (["--sync-s", "0"], "argument --sync-s: must be a number > 0"),
    ],
)
def test_failures_refuses_runaway_or_meaningless_values(flags, named, capsys):
    """`--days 1e9` ran for over 30 s, `--restart-s 1e300` printed a table of zeros, `--sync-s 0` exited 0."""
    argv = ["plan", "failures", *flags]
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    assert code == 2
    assert named in capsys.readouterr().err


def test_failures_within_the_bounds_still_computes(capsys):
    assert main([*FAILURES, "--gpus", "1e12", "--groups", "2", "--sync-s", "86400", "--no-sim"]) == 0
    assert "1e+12" in capsys.readouterr().out


def test_measure_steps_are_bounded(capsys):
    """`--measure --steps 1e12` would train for days before failing or finishing."""
    assert main([*PLAN, "--measure", "--steps", "1000000000000"]) == 2
    assert "--steps 1000000000000: --measure takes at most 1000" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main([*PLAN, "--measure", "--steps", "0"])
    assert stop.value.code == 2


NUMERIC_FLAGS = {
    "plan": ["--ranks", "--vocab", "--replica-groups", "--diloco-every", "--steps"],
    "failures": [
        "--gpus",
        "--save-cost-s",
        "--restart-s",
        "--detect-s",
        "--groups",
        "--min-group-gpus",
        "--sync-s",
        "--days",
        "--replicas",
        "--seed",
    ],  # fmt: skip
    "choose": ["--budget", "--days", "--vocab", "--top"],
    "shapes": ["--vocab", "--repeat", "--max-tokens", "--threads"],
}
HOSTILE = ["-1", "-7.5", "0", "nan", "inf", "-inf", "1e300", "-1e300", str(10**30), str(-(10**30))]
CASES = [(name, flag) for name, flags in NUMERIC_FLAGS.items() for flag in flags]


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(CASES), value=st.sampled_from(HOSTILE))
def test_every_numeric_flag_ends_in_a_result_or_a_clear_error(case, value, tmp_path_factory, capsys):
    """Negative, zero, nan, inf and huge values of every numeric flag: exit 0 or 2, never an exception out of
    main; nan, inf and negatives always exit 2 (`--seed` 0 and `--diloco-every` 0 are meaningful)."""
    name, flag = case
    argv = subcommand_argv(name, tmp_path_factory.mktemp("fuzz"))
    if (name, flag, value) == ("shapes", "--max-tokens", str(10**30)):
        return  # a valid row count: a benchmark, not an input check
    try:
        code = main([*argv, flag, value])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    assert code in (0, 2), (name, flag, value, captured.err[-500:])
    if value in ("nan", "inf", "-inf") or value.startswith("-"):
        assert code == 2 and flag in captured.err, (name, flag, value, captured.err[-500:])
    if code == 2:  # one error line (after argparse's usage), never a traceback
        last = captured.err.strip().splitlines()[-1]
        assert "Traceback" not in captured.err and last.startswith("tenx") and " error: " in last
