"""Every script in cookbook/ and benchmarks/ answers ``--help``, and the loops refuse flags they would ignore."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


def _scripts() -> list[Path]:
    """Files with a ``__main__`` guard under cookbook/ and benchmarks/ (modules without one are libraries)."""
    files = sorted([*ROOT.glob("cookbook/**/*.py"), *ROOT.glob("benchmarks/**/*.py")])
    return [f for f in files if 'if __name__ == "__main__":' in f.read_text()]


def test_script_list_is_not_empty():
    names = {str(p.relative_to(ROOT)) for p in _scripts()}
    assert {"cookbook/grpo_sync.py", "cookbook/grpo_async.py", "cookbook/plot.py",
            "benchmarks/cookbook/async_vs_sync.py"} <= names, names


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_help(script: Path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="error:rlblocks::DeprecationWarning")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("usage: "), p.stdout[:500]


@pytest.mark.parametrize("loop", ["grpo_async", "grpo_sync"])
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--loss", "ppo", "--rollout-weight-cap", "3"], "--rollout-weight-cap"),
        (["--loss", "gspo", "--rollout-weight-cap", "3"], "--rollout-weight-cap"),
        (["--correction-cap", "3"], "--correction-cap"),  # --correction none: nothing to bound
        (["--correction", "tis", "--correction-cap", "0.5"], "--correction-cap"),
        (["--ppo-epochs", "0"], "--ppo-epochs"),
        (["--mini-batches", "0"], "--mini-batches"),
        (["--max-model-len", "-1"], "--max-model-len"),
    ],
)
def test_ignored_or_bad_flags_are_refused(loop, argv, flag, capsys):
    import importlib

    from plumbing import parse_flags

    mod = importlib.import_module(loop)
    with pytest.raises(SystemExit) as e:
        parse_flags(mod.Config, argv, check=mod.check_flags)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("loop", ["grpo_async", "grpo_sync"])
def test_accepted_flags_reach_the_config(loop):
    import importlib

    from plumbing import parse_flags

    mod = importlib.import_module(loop)
    cfg = parse_flags(mod.Config, ["--loss", "decoupled", "--rollout-weight-cap", "3", "--eps-low", "0.1",
                                   "--correction", "mis", "--correction-cap", "4", "--ppo-epochs", "2",
                                   "--mini-batches", "4"], check=mod.check_flags)
    assert (cfg.rollout_weight_cap, cfg.eps_low, cfg.eps_high, cfg.correction_cap) == (3.0, 0.1, None, 4.0)
    assert (cfg.ppo_epochs, cfg.mini_batches) == (2, 4)
    cfg = parse_flags(mod.Config, [], check=mod.check_flags)
    assert (cfg.eps_low, cfg.eps_high, cfg.rollout_weight_cap, cfg.correction_cap) == (None, None, None, None)


@pytest.mark.parametrize("loop", ["grpo_async", "grpo_sync"])
def test_unknown_flags_are_refused(loop, capsys):
    # no hidden spellings: a flag that is not a field of the loop's Config is an error, not an alias
    import importlib

    from plumbing import parse_flags

    mod = importlib.import_module(loop)
    with pytest.raises(SystemExit) as e:
        parse_flags(mod.Config, ["--loss", "decoupled", "--behav-weight-cap", "3"], check=mod.check_flags)
    assert e.value.code == 2 and "unrecognized arguments: --behav-weight-cap" in capsys.readouterr().err


@pytest.mark.parametrize("loop", ["grpo_async", "grpo_sync"])
def test_new_flag_spelling_does_not_warn(loop):
    import importlib
    import warnings

    from plumbing import parse_flags

    mod = importlib.import_module(loop)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = parse_flags(mod.Config, ["--loss", "decoupled", "--rollout-weight-cap", "3"], check=mod.check_flags)
    assert cfg.rollout_weight_cap == 3.0


def test_help_states_each_losss_own_clip_defaults():
    import inspect

    from plumbing import POLICY_LOSSES, loss_defaults

    text = loss_defaults("eps_high")
    for name, fn in POLICY_LOSSES.items():
        assert f"{name} {inspect.signature(fn).parameters['eps_high'].default:g}" in text
    assert "cispo 0.28" in text and "gspo 0.0004" in text  # the published defaults (MiniMax-M1, GSPO paper)


@pytest.mark.parametrize("loop", ["grpo_async", "grpo_sync"])
def test_demo_runs_are_step_governed(loop):
    # a wall-clock budget makes the demo's result depend on how loaded the machine is (a loaded 2-core CPU ran
    # fewer steps and learned less); the default run is a fixed number of steps, the clock only an opt-in limit
    import importlib

    from plumbing import parse_flags

    mod = importlib.import_module(loop)
    cfg = parse_flags(mod.Config, [], check=mod.check_flags)
    assert cfg.time_limit == 0 and cfg.steps > 0
    assert parse_flags(mod.Config, ["--time-limit", "60"], check=mod.check_flags).time_limit == 60


LOOPS = ["grpo_sync", "grpo_async", "ppo", "agent_async", "agent_gateway"]


@pytest.mark.parametrize("loop", LOOPS)
def test_eval_every_zero_means_before_and_after_only(loop, capsys):
    # --eval-every 0 is a valid setting in every loop (no periodic evaluation), a negative value is refused
    import importlib

    from plumbing import every, parse_flags

    mod = importlib.import_module(loop)
    if "eval_every" not in {f for f in mod.Config.__dataclass_fields__}:
        pytest.skip(f"{loop} evaluates before and after only")
    assert parse_flags(mod.Config, ["--eval-every", "0"], check=mod.check_flags).eval_every == 0
    assert not any(every(step, 0) for step in range(1, 100))
    assert [s for s in range(1, 10) if every(s, 3)] == [3, 6, 9]
    with pytest.raises(SystemExit) as e:
        parse_flags(mod.Config, ["--eval-every", "-1"], check=mod.check_flags)
    assert e.value.code == 2 and "--eval-every" in capsys.readouterr().err


@pytest.mark.parametrize("loop", LOOPS)
def test_every_loop_parses_its_flags_from_one_dataclass(loop, capsys):
    # one flag machinery for every loop: --help lists every Config field, with its default
    import dataclasses
    import importlib

    from plumbing import parse_flags

    mod = importlib.import_module(loop)
    with pytest.raises(SystemExit) as e:
        parse_flags(mod.Config, ["--help"], check=mod.check_flags)
    out = capsys.readouterr().out
    assert e.value.code == 0
    for f in dataclasses.fields(mod.Config):
        assert "--" + f.name.replace("_", "-") in out, f.name


def _makefile_loop_commands() -> list[tuple[str, list[str]]]:
    """``(loop module, argv)`` of every cookbook loop the Makefile's recipes run (continued lines joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for word in line.split():
            if word.startswith("cookbook/") and word.endswith(".py") and word != "cookbook/plot.py":
                out.append((Path(word).stem, line.split(word, 1)[1].split()))
    return out


def test_makefile_demos_run_loops_with_flags_they_accept():
    import importlib

    from plumbing import parse_flags

    commands = _makefile_loop_commands()
    assert {m for m, _ in commands} >= {"grpo_async", "agent_async", "ppo", "grpo_sync"}, commands
    for module, argv in commands:
        mod = importlib.import_module(module)
        if not hasattr(mod, "Config"):  # a driver (real.py): its own flags, and grpo_sync.py's with its recipe
            own = argv[: argv.index("--")] if "--" in argv else argv
            extra = argv[argv.index("--") + 1:] if "--" in argv else []
            assert mod.parser().parse_args(own).name.startswith("demo"), (module, argv)
            grpo_sync = importlib.import_module("grpo_sync")
            parse_flags(grpo_sync.Config, [*mod.RECIPE, *extra])
            continue
        cfg = parse_flags(mod.Config, argv, check=mod.check_flags)
        assert cfg.name.startswith("demo"), (module, argv)
